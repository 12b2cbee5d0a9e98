"""Evaluation of MegaScan's straggler detection: the entry point of
megatronapp.faultlab.evaluation.cli (read its docstring for the commands).

    python benchmarks/scan_eval.py frozen thresholds --out out/frozen/thresholds.json
    python benchmarks/scan_eval.py frozen freeze out/frozen/design1 --thresholds out/frozen/thresholds.json \
        --runs-per-kind 3 --clean-runs 4
    python benchmarks/scan_eval.py frozen run out/frozen/design1
    python benchmarks/scan_eval.py frozen score out/frozen/design1

The frozen mode (real faults from the fault lab, megatronapp/faultlab) is the one whose figures
are quoted; run/tune/summarize/rejudge evaluate the in-process injectors (kept for comparison).
"""

import sys

from megatronapp.faultlab.evaluation.cli import build_parser, main

__all__ = ["build_parser", "main"]  # build_parser: the documented commands parse (tests/project)

if __name__ == "__main__":
    sys.exit(main())
