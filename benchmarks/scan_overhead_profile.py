"""Where MegaScan's step-time overhead goes on a launch-bound model: paired rounds of extra
variants that each remove one part of the tracer, then a cProfile of each variant.

    python benchmarks/scan_overhead_profile.py --preset small --rounds 12 --steps 10   # H200
    python benchmarks/scan_overhead_profile.py --device cpu --preset tiny --rounds 2 --steps 2

Variants (all on the same warmed compiled engine, fresh tracer per segment, as scan_overhead.py):
  off, base, full              as scan_overhead.py
  full_host_clock              full, but spans time with the host clock (no CUDA events)
Then each variant once under cProfile: the top functions by own time, to name what a traced
step does that an untraced one does not.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import scan_overhead  # noqa: E402
from megatronapp.engine.hooks import NULL_TRACER  # noqa: E402
from megatronapp.engine.trainer import Trainer  # noqa: E402
from megatronapp.parallel.groups import single_process_groups  # noqa: E402

VARIANTS = ("off", "base", "full", "full_host_clock")


def _tracer_for(variant: str, d: str, device: torch.device):
    if variant == "full_host_clock":
        return scan_overhead._new_tracer("full", d, torch.device("cpu"))
    return scan_overhead._new_tracer(variant, d, device)


def run_segment(trainer: Trainer, variant: str, device: torch.device, steps: int, profile: bool = False):
    """Seconds for `steps` training steps under `variant` (and a pstats text if profiled)."""
    with tempfile.TemporaryDirectory(prefix=f"probe-{variant}-") as d:
        tracer = None if variant == "off" else _tracer_for(variant, d, device)
        trainer.set_tracer(tracer or NULL_TRACER)
        trainer.iteration = max(trainer.iteration, 1)
        prof = cProfile.Profile() if profile else None
        if prof:
            prof.enable()
        seconds = scan_overhead._timed(trainer.train_step, device, steps)
        if prof:
            prof.disable()
        if tracer is not None:
            tracer.close()
        trainer.set_tracer(NULL_TRACER)
    if not prof:
        return seconds, None
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
    return seconds, text.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    scan_overhead.add_job_args(p, rounds=12, warmup=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    job = scan_overhead.make_job(args.preset, args.micro_batch, args.num_micro, device, device.type == "cuda")
    trainer = Trainer(job, single_process_groups(), device, scan_overhead.RandomBatches(job, device))
    for _ in range(args.warmup):
        trainer.train_step()
    results = scan_overhead.run_rounds(lambda v: {"steps_s": run_segment(trainer, v, device, args.steps)[0]},
                                       VARIANTS, args.rounds, 0)
    summary = scan_overhead.summarize(results, args.steps)
    report = {"args": vars(args), "summary": {v: summary[v] for v in VARIANTS if v in summary}, "profiles": {}}
    for variant in VARIANTS:
        seconds, text = run_segment(trainer, variant, device, args.steps, profile=True)
        report["profiles"][variant] = {"profiled_ms_per_step": 1e3 * seconds / args.steps, "top": text}
        print(f"== {variant}: {1e3 * seconds / args.steps:.2f} ms/step under cProfile\n{text}", flush=True)
    print(json.dumps(report["summary"], indent=1, default=str))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
