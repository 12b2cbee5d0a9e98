"""How well does MegaScan's detector name the root cause? Inject faults, detect, score.

Each run draws a fault kind (none, slow_compute, slow_link), a faulty rank or link and a
magnitude from --seed, produces a trace directory, runs detection on it and compares the
suspects with the truth. Two sources of traces:

  * default: real training jobs through the CLI (one subprocess per run)
        python -m megatronapp.cli.main train --nproc-per-node N --tensor-model-parallel-size TP
            --pipeline-model-parallel-size PP --model tiny --train-iters 6 --trace --trace-dir D
            --device cpu [--inject-slowdown R:F | --inject-link-delay S:D:MS]
    then load + align + detect on D (what `megatronapp trace detect D` does);
  * --synthetic: megatronapp.scan.synthetic simulates the same layout in-process (no engine).

Scores per fault kind: recall (the culprit is among the suspects), top-1 accuracy (it is
the first suspect), precision (suspects of that cause that were right, over all runs) and
false alarms (fault-free runs that named anybody with that cause). Printed as a table and
written to OUT/scan_eval.json.

    python benchmarks/scan_eval.py --synthetic --runs 30 --seed 0 --out /tmp/scan_eval
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatronapp.parallel.layout import ParallelLayout
from megatronapp.scan.analysis import analyze_trace_dir
from megatronapp.scan.detect import DetectConfig, detect

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the trace simulator lives with the tests

KINDS = ("none", "slow_compute", "slow_link")
FAULT_KINDS = KINDS[1:]


@dataclass(frozen=True)
class PlannedRun:
    index: int
    kind: str  # one of KINDS
    rank: int = -1  # slow rank, or the link's source
    dst: int = -1  # the link's destination
    factor: float = 1.0
    delay_ms: float = 0.0


@dataclass
class RunResult:
    run: PlannedRun
    suspects: list = field(default_factory=list)  # [{"rank", "cause", "link", "confidence"}]
    seconds: float = 0.0
    error: str = ""


def plan_runs(runs: int, seed: int, layout: ParallelLayout, min_factor: float, max_factor: float,
              min_delay_ms: float, max_delay_ms: float) -> list[PlannedRun]:
    """Kinds cycle none/slow_compute/slow_link; ranks, links and magnitudes are drawn from `seed`.
    A link always joins neighbouring pipeline stages of one pipeline (the only p2p traffic)."""
    rng = random.Random(seed)
    kinds = list(KINDS) if layout.pp_size > 1 else ["none", "slow_compute"]
    plan = []
    for i in range(runs):
        kind = kinds[i % len(kinds)]
        if kind == "none":
            plan.append(PlannedRun(i, kind))
        elif kind == "slow_compute":
            plan.append(PlannedRun(i, kind, rank=rng.randrange(layout.world_size),
                                   factor=round(rng.uniform(min_factor, max_factor), 2)))
        else:
            src = rng.randrange(layout.world_size)
            c = layout.coords(src)
            step = rng.choice([s for s in (-1, 1) if 0 <= c.pp + s < layout.pp_size])
            plan.append(PlannedRun(i, kind, rank=src, dst=layout.rank_of(c.tp, c.dp, c.pp + step),
                                   delay_ms=round(rng.uniform(min_delay_ms, max_delay_ms), 1)))
    return plan


def build_train_command(run: PlannedRun, args: argparse.Namespace, trace_dir: Path) -> list[str]:
    """The CLI invocation of one real run (the engine's command-line contract)."""
    cmd = [sys.executable, "-m", "megatronapp.cli.main", "train", "--nproc-per-node", str(args.nproc),
           "--tensor-model-parallel-size", str(args.tp), "--pipeline-model-parallel-size", str(args.pp),
           "--model", "tiny", "--train-iters", str(args.train_iters), "--trace", "--trace-dir", str(trace_dir),
           "--device", "cpu"]
    if run.kind == "slow_compute":
        cmd += ["--inject-slowdown", f"{run.rank}:{run.factor}"]
    elif run.kind == "slow_link":
        cmd += ["--inject-link-delay", f"{run.rank}:{run.dst}:{run.delay_ms}"]
    return cmd


def _suspects_json(report) -> list[dict]:
    return [{"rank": s.rank, "cause": s.cause, "link": list(s.link) if s.link else None,
             "confidence": s.confidence} for s in report.suspects]


def execute_real_run(run: PlannedRun, args: argparse.Namespace, work: Path) -> RunResult:
    trace_dir = work / f"run{run.index:03d}"
    t0 = time.perf_counter()
    cmd = build_train_command(run, args, trace_dir)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return RunResult(run, seconds=time.perf_counter() - t0, error=f"training timed out after {args.timeout}s")
    (work / f"run{run.index:03d}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return RunResult(run, seconds=time.perf_counter() - t0, error=f"training exited {proc.returncode}: {tail}")
    try:
        report = analyze_trace_dir(trace_dir, DetectConfig()).detection
    except (OSError, ValueError) as exc:
        return RunResult(run, seconds=time.perf_counter() - t0, error=f"detect failed: {exc}")
    return RunResult(run, _suspects_json(report), time.perf_counter() - t0)


def execute_synthetic_run(run: PlannedRun, args: argparse.Namespace, layout: ParallelLayout) -> RunResult:
    from scan_simulation import SimulatedJob, simulate_job_traces  # tests/, on sys.path above

    fault = {}
    if run.kind == "slow_compute":
        fault = {"slow_rank": run.rank, "slow_factor": run.factor}
    elif run.kind == "slow_link":
        fault = {"slow_link": (run.rank, run.dst), "link_delay_ns": int(run.delay_ms * 1e6),
                 "link_delay_mode": args.link_delay_mode}
    job = SimulatedJob(tp_size=layout.tp_size, pp_size=layout.pp_size, dp_size=layout.dp_size,
                       iterations=args.train_iters, noise=args.noise, hiccup_prob=args.hiccup_prob,
                       rank_bias=args.rank_bias,
                       seed=args.seed * 1000 + run.index, **fault)
    t0 = time.perf_counter()
    report = detect(simulate_job_traces(job), config=DetectConfig())
    return RunResult(run, _suspects_json(report), time.perf_counter() - t0)


def _is_culprit(suspect: dict, run: PlannedRun) -> bool:
    if suspect["cause"] != run.kind:
        return False
    if run.kind == "slow_link":
        return suspect["link"] == [run.rank, run.dst]
    return suspect["rank"] == run.rank


def compute_scores(results: list[RunResult]) -> dict[str, dict]:
    """Per fault kind: runs, recall, top1, precision, false alarms (see module docstring)."""
    done = [r for r in results if not r.error]
    clean = [r for r in done if r.run.kind == "none"]
    scores = {}
    for kind in FAULT_KINDS:
        faulty = [r for r in done if r.run.kind == kind]
        named = [(s, r.run) for r in done for s in r.suspects if s["cause"] == kind]
        alarms = sum(1 for r in clean if any(s["cause"] == kind for s in r.suspects))
        scores[kind] = {
            "runs": len(faulty),
            "recall": _ratio(sum(any(_is_culprit(s, r.run) for s in r.suspects) for r in faulty), len(faulty)),
            "top1_accuracy": _ratio(sum(bool(r.suspects) and _is_culprit(r.suspects[0], r.run) for r in faulty),
                                    len(faulty)),
            "precision": _ratio(sum(_is_culprit(s, run) for s, run in named), len(named)),
            "false_alarms": alarms,
            "clean_runs": len(clean),
        }
    return scores


def _ratio(num: int, den: int) -> float | None:
    return round(num / den, 3) if den else None


def render_scores(scores: dict[str, dict], failed: int) -> str:
    import io

    from rich.console import Console
    from rich.table import Table

    console = Console(file=io.StringIO(), width=100, record=True, force_terminal=False)
    table = Table(title="MegaScan detection quality")
    for col in ("fault kind", "runs", "recall", "top-1 accuracy", "precision", "false alarms / clean runs"):
        table.add_column(col)
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for kind, s in scores.items():
        table.add_row(kind, str(s["runs"]), fmt(s["recall"]), fmt(s["top1_accuracy"]), fmt(s["precision"]),
                      f"{s['false_alarms']} / {s['clean_runs']}")
    console.print(table)
    if failed:
        console.print(f"{failed} run(s) failed and are not scored (see the JSON file)")
    return console.export_text()


def save_json_atomic(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=2)
    os.replace(tmp, path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=12, help="number of jobs (fault kinds cycle none/compute/link)")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault plan (and of synthetic noise)")
    p.add_argument("--nproc", type=int, default=8, help="ranks per job (--nproc-per-node)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=2, help="pipeline-parallel size")
    p.add_argument("--train-iters", type=int, default=6)
    p.add_argument("--out", default="out/scan_eval", help="directory for traces, logs and scan_eval.json")
    p.add_argument("--synthetic", action="store_true", help="simulate the jobs instead of training (no engine)")
    p.add_argument("--min-factor", type=float, default=1.3)
    p.add_argument("--max-factor", type=float, default=2.0)
    p.add_argument("--min-delay-ms", type=float, default=4.0)
    p.add_argument("--max-delay-ms", type=float, default=20.0)
    p.add_argument("--noise", type=float, default=0.15, help="--synthetic: log-normal sigma of durations")
    p.add_argument("--hiccup-prob", type=float, default=0.03, help="--synthetic: chance of a 1.5-3x stretch")
    p.add_argument("--rank-bias", type=float, default=0.03, help="--synthetic: sigma of a per-rank speed factor")
    p.add_argument("--link-delay-mode", choices=("transfer", "before_wait"), default="transfer",
                   help="--synthetic: a slow wire, or the engine's CPU injection (receiver sleeps before waiting)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per training job")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.runs < 1 or args.min_factor < 1.0 or args.max_factor < args.min_factor:
        print("error: need --runs >= 1 and 1 <= --min-factor <= --max-factor", file=sys.stderr)
        return 2
    try:
        layout = ParallelLayout(args.nproc, args.tp, args.pp)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    plan = plan_runs(args.runs, args.seed, layout, args.min_factor, args.max_factor,
                     args.min_delay_ms, args.max_delay_ms)
    results = []
    for run in plan:
        res = (execute_synthetic_run(run, args, layout) if args.synthetic
               else execute_real_run(run, args, out / "runs"))
        results.append(res)
        verdict = res.error or ", ".join(f"{s['cause']}@{s['link'] or s['rank']}" for s in res.suspects) or "nobody"
        print(f"run {run.index:3d} {run.kind:12s} rank={run.rank:2d} dst={run.dst:2d} "
              f"x{run.factor} +{run.delay_ms}ms -> {verdict} ({res.seconds:.1f}s)", flush=True)
    scores = compute_scores(results)
    failed = sum(1 for r in results if r.error)
    print(render_scores(scores, failed))
    save_json_atomic(out / "scan_eval.json", {
        "mode": "synthetic" if args.synthetic else "training", "layout": layout.describe(),
        "args": vars(args), "scores": scores,
        "runs": [{**asdict(r.run), "suspects": r.suspects, "seconds": round(r.seconds, 3), "error": r.error}
                 for r in results]})
    print(f"wrote {out / 'scan_eval.json'}")
    return 1 if failed == len(results) else 0


if __name__ == "__main__":
    sys.exit(main())
