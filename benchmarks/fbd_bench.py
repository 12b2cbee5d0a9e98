"""MegaFBD benchmark: throughput, backward-worker memory and the largest micro batch, FBD
against the plain engine, on layouts that fit the machine.

    PYTHONPATH=. python benchmarks/fbd_bench.py --device cuda --out fbd.json    # the H200: ~5-7 min
    PYTHONPATH=. python -m pytest -q tests/gpu/test_fbd_gpu.py                        # one-GPU FBD parity
    PYTHONPATH=. python benchmarks/fbd_bench.py --device cpu --pp 2 --dp 2 --rounds 3   # 8 CPU processes

On CUDA the defaults fit the visible GPUs: backward workers TP1 x DP1 x PP (PP1 on one GPU, PP2
on two or more; never two ranks of one NCCL group on a GPU), the 350m preset (24 x 1024, seq
2048, bf16) at micro batch 8 x 4 microbatches per step; the whole run keeps to `--budget-s`
(default 420 s on CUDA): a job that would start later is skipped and says so.

Variants (same model, data and backward layout; FBD adds TF x PP x DP forward ranks):
  plain            the engine, 1F1B
  recompute        the engine with full activation recompute (the fair baseline: FBD recomputes)
  fbd              FBD, forward workers on --device (on CUDA: their twin's GPU, separate process;
                   hand-off and weights through host memory, since NCCL cannot link one GPU to itself)
  fbd_cpu_forward  FBD, forward workers on CPUs (on CUDA run last, `--cpu-forward-rounds` rounds of
                   one step of one microbatch: a CPU forward of this model takes tens of seconds)
  free_forward     FBD whose forward workers (on CPUs) send zeros without computing: the upper
                   bound of backward workers that never wait (its losses are meaningless)

Phases: (1) throughput, variants interleaved round by round (A B C A B C ...), each run a fresh
job; tokens/s median and min..max over rounds (steady state: `--warmup` steps dropped), peak GPU
memory of backward workers (and of forward workers on a GPU). (2) largest micro batch: per
variant one job trains one step at micro batch `--search-from`, 2x, 4x ... up to
`--max-micro-batch` (PP microbatches per step) until a rank fails (out of memory); fbd_cpu_forward
is not searched: its GPU holds what free_forward's does. The JSON report (`--out`) is rewritten
after every job.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

from megatronapp.config import MODEL_PRESETS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fbd_bench_rank import child, compute_placements, world_of

VARIANTS = ("plain", "recompute", "fbd", "fbd_cpu_forward", "free_forward")


class Budget:
    """Wall-clock budget of the whole run: jobs get what is left, later ones are skipped."""

    def __init__(self, seconds: float | None):
        self.seconds, self.start = seconds, time.monotonic()

    def left(self) -> float:
        return float("inf") if self.seconds is None else self.seconds - (time.monotonic() - self.start)


def run_job(variant: str, cfg, probes: list[tuple], budget: Budget) -> list[dict]:
    """One fresh job of `variant` running `probes` [(micro_batch, microbatches, steps, warmup)]
    in turn; a list with one entry per probe every rank finished, then the first failure."""
    gpus = torch.cuda.device_count() if cfg.device == "cuda" else 0
    try:
        compute_placements(variant, cfg, gpus)  # refuse before spawning, in one line
    except ValueError as e:
        return [{"micro_batch": probes[0][0], "error": f"layout refused: {e}"}]
    timeout = min(cfg.timeout, budget.left())
    if timeout < 20:
        return [{"micro_batch": probes[0][0], "error": "skipped: time budget spent"}]
    world, ctx = world_of(variant, cfg), mp.get_context("spawn")
    results = ctx.Queue()
    store = os.path.join(tempfile.mkdtemp(prefix="fbd-bench-"), "store")
    procs = [ctx.Process(target=child, args=(r, world, variant, cfg, store, probes, results)) for r in range(world)]
    for p in procs:
        p.start()
    done, out = {}, []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < len(probes):
            rank, mbs, res, err = results.get(timeout=max(0.1, deadline - time.monotonic()))
            if err:
                out.append({"micro_batch": mbs if mbs is not None else probes[0][0], "error": f"rank {rank}: {err}"})
                break
            done.setdefault(mbs, {})[rank] = res
            if len(done[mbs]) == world:
                microbatches = next(p[1] for p in probes if p[0] == mbs)
                out.append(_probe_summary(mbs, microbatches, done[mbs], cfg))
    except queue.Empty:
        out.append({"micro_batch": probes[len(out)][0], "error": f"timed out after {timeout:.0f} s"})
    for p in procs:
        if out and "error" in out[-1]:
            p.kill()
        p.join(timeout=20)
        if p.is_alive():  # finished its probes but hangs on exit: not worth the budget
            p.kill()
            p.join()
    return out


def _probe_summary(micro_batch: int, microbatches: int, by_rank: dict, cfg) -> dict:
    """Tokens/s of the global batch at the slowest backward rank; peak GPU memory per role."""
    backward = [r for r in by_rank.values() if r["role"] == "backward"]
    forward_gpu = [r["peak_gb"] for r in by_rank.values() if r["role"] == "forward" and "peak_gb" in r]
    step_s = max(r["step_s"] for r in backward)
    tokens = micro_batch * cfg.dp * microbatches * (cfg.seq_length or MODEL_PRESETS[cfg.model].seq_length)
    peaks = [r["peak_gb"] for r in backward if "peak_gb" in r]
    return {
        "micro_batch": micro_batch,
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "peak_gb": max(peaks) if peaks else None,
        "forward_peak_gb": max(forward_gpu) if forward_gpu else None,
    }


def _summary(values: list[float]) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def bench_throughput(cfg, budget: Budget, report: dict, save, variants: list[str], rounds: int) -> None:
    """Rounds of `variants`, interleaved; on CUDA fbd_cpu_forward times `--cpu-forward-steps`
    steps of `--cpu-forward-microbatches` (a CPU forward of this model takes seconds)."""
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(rounds):
        for v in variants:
            slow = v == "fbd_cpu_forward" and cfg.device == "cuda"
            probe = (
                (cfg.micro_batch, cfg.cpu_forward_microbatches, cfg.cpu_forward_steps, 0)
                if slow
                else (cfg.micro_batch, cfg.microbatches, cfg.steps, cfg.warmup)
            )
            res = run_job(v, cfg, [probe], budget)[0]
            runs[v].append(res)
            print(f"throughput round {r} {v}: {res}", file=sys.stderr, flush=True)
            report["throughput"][v] = _throughput_entry(runs[v])
            save(report)


def _throughput_entry(rs: list[dict]) -> dict:
    ok = [x for x in rs if "error" not in x]
    return {
        "tokens_per_s": _summary([x["tokens_per_s"] for x in ok]),
        "peak_gb": _summary([x["peak_gb"] for x in ok]),
        "forward_peak_gb": _summary([x["forward_peak_gb"] for x in ok]),
        "runs": rs,
        "errors": [x["error"] for x in rs if "error" in x],
    }


def bench_max_micro_batch(cfg, budget: Budget, report: dict, save) -> None:
    """Per variant, one job trying doubling micro batches (one step, PP microbatches each)."""
    sizes, m = [], cfg.search_from
    while m <= cfg.max_micro_batch:
        sizes.append(m)
        m *= 2
    for v in cfg.search_variants:
        tried = run_job(v, cfg, [(s, cfg.pp, 1, 0) for s in sizes], budget)
        fits = [t["micro_batch"] for t in tried if "error" not in t]
        failed = next((t for t in tried if "error" in t), None)
        report["max_micro_batch"][v] = {
            "largest": max(fits) if fits else None,
            "stopped_by": failed["error"] if failed else f"limit: all sizes up to {sizes[-1]} fit",
            "tried": tried,
        }
        print(
            f"max micro batch {v}: {report['max_micro_batch'][v]['largest']} "
            f"({report['max_micro_batch'][v]['stopped_by']})",
            file=sys.stderr,
            flush=True,
        )
        save(report)


def resolve_defaults(cfg) -> None:
    """Fill the flags left unset from the device: on CUDA, layouts that fit the visible GPUs."""
    cuda = cfg.device == "cuda"
    gpus = torch.cuda.device_count() if cuda else 0
    defaults = {
        "model": "350m" if cuda else "tiny",
        "tp": 1,
        "dp": 1 if cuda else 2,
        "pp": (1 if gpus < 2 else 2) if cuda else 2,
        "micro_batch": 8 if cuda else 2,
        "threads": 4 if cuda else 1,
        "budget_s": 420.0 if cuda else None,
        "max_micro_batch": 512 if cuda else 0,
        "search_from": 8 if cuda else 2,
        "variants": list(VARIANTS) if cuda else ["plain", "recompute", "fbd", "free_forward"],
        "cpu_forward_threads": max(1, (os.cpu_count() or 2) - 2),
    }
    for name, value in defaults.items():
        if getattr(cfg, name) is None:
            setattr(cfg, name, value)
    cfg.search_variants = [v for v in cfg.variants if v != "fbd_cpu_forward" or cfg.device == "cpu"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model", default=None, choices=tuple(MODEL_PRESETS), help="default: 350m on CUDA, tiny on CPU")
    p.add_argument("--seq-length", type=int, default=None)
    p.add_argument("--tp", type=int, default=None, help="backward workers' TP (default 1)")
    p.add_argument("--pp", type=int, default=None, help="default: CUDA 1 on one GPU, else 2; CPU 2")
    p.add_argument("--dp", type=int, default=None, help="default: CUDA 1, CPU 2")
    p.add_argument("--tf", type=int, default=1, help="forward workers' TP size")
    p.add_argument("--micro-batch", type=int, default=None, help="default: CUDA 8, CPU 2")
    p.add_argument("--microbatches", type=int, default=4, help="per DP rank and step")
    p.add_argument("--max-ahead", type=int, default=2)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=None, help="default: all on CUDA")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--cpu-forward-rounds", type=int, default=1, help="CUDA: rounds of fbd_cpu_forward")
    p.add_argument("--cpu-forward-steps", type=int, default=1, help="CUDA: timed steps of fbd_cpu_forward")
    p.add_argument("--cpu-forward-microbatches", type=int, default=1, help="CUDA: fbd_cpu_forward's per step")
    p.add_argument("--threads", type=int, default=None, help="torch threads per GPU-side (or CPU-bench) process")
    p.add_argument("--cpu-forward-threads", type=int, default=None, help="CUDA: threads of CPU forward workers")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds per job before it is killed")
    p.add_argument("--budget-s", type=float, default=None, help="whole run (default: CUDA 420, CPU none)")
    p.add_argument("--max-micro-batch", type=int, default=None, help="search limit; 0: no search (CPU default)")
    p.add_argument("--search-from", type=int, default=None, help="first micro batch of the search")
    p.add_argument("--out", default=None, help="JSON report, rewritten after every job")
    return p


def _saver(path: str | None):
    def save(report: dict) -> None:
        if path:  # atomic: a killed run leaves the last complete report
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(report, f, indent=1)
            os.replace(tmp, path)

    return save


def main(argv=None) -> int:
    cfg = build_parser().parse_args(argv)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        print("fbd_bench: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    resolve_defaults(cfg)
    budget, save = Budget(cfg.budget_s), _saver(cfg.out)
    # no CUDA call that makes a context here: it would hold GPU memory the search measures
    machine = {
        "gpus": torch.cuda.device_count() if cfg.device == "cuda" else 0,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
    }
    report = {"args": vars(cfg), "machine": machine, "throughput": {}, "max_micro_batch": {}}
    fast = [v for v in cfg.variants if v != "fbd_cpu_forward" or cfg.device == "cpu"]
    bench_throughput(cfg, budget, report, save, fast, cfg.rounds)
    if cfg.max_micro_batch:
        bench_max_micro_batch(cfg, budget, report, save)
    if len(fast) < len(cfg.variants):  # on CUDA the slowest last, so the budget cuts only it
        bench_throughput(cfg, budget, report, save, ["fbd_cpu_forward"], cfg.cpu_forward_rounds)
    report["elapsed_s"] = time.monotonic() - budget.start
    save(report)
    print(
        json.dumps(
            {
                "throughput": {
                    v: {k: e[k] for k in ("tokens_per_s", "peak_gb", "errors")} for v, e in report["throughput"].items()
                },
                "max_micro_batch": {v: e["largest"] for v, e in report["max_micro_batch"].items()},
                "elapsed_s": report["elapsed_s"],
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
