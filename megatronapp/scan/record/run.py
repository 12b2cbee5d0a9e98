"""Run an unmodified PyTorch program under MegaScan: `python -m megatronapp.scan.record.run SCRIPT ARGS...`.

Meant to be launched once per rank by torchrun (or by `megatronapp trace run`, which does that
and then merges and analyses the traces):

    torchrun --nproc-per-node 2 -m megatronapp.scan.record.run train.py --lr 1e-3

Settings come from MEGATRONAPP_TRACE_* (autotrace.AutoTraceConfig) and faults from
MEGATRONAPP_INJECT_* (injection.inject). The script runs as `__main__` with `sys.argv` = [SCRIPT,
ARGS...], exactly as `python SCRIPT ARGS...` would run it.
"""

from __future__ import annotations

import runpy
import sys

from megatronapp.scan.record.autotrace import AutoTrace, start_from_env

_SESSION: AutoTrace | None = None


def mark_step() -> None:
    """Iteration boundary for programs whose optimizer steps are not one per iteration; a no-op
    when the program is not running under MegaScan."""
    if _SESSION is not None:
        _SESSION.mark_step()


def run_script(argv: list[str]) -> None:
    """Trace `argv[0]` (a Python file) run with arguments `argv[1:]`."""
    global _SESSION
    _SESSION = start_from_env()
    sys.argv = list(argv)
    completed = False
    try:
        runpy.run_path(argv[0], run_name="__main__")
        completed = True
    except SystemExit as exc:
        completed = exc.code in (None, 0)
        raise
    finally:
        session, _SESSION = _SESSION, None
        session.close(probe=completed)  # a failed rank must not wait for its peers in the link probe


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print("usage: python -m megatronapp.scan.record.run SCRIPT [ARGS...]  (under torchrun)", file=sys.stderr)
        return 2
    run_script(sys.argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
