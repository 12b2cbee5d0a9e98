"""Held-out evaluation of MegaScan's detector: generate faulty runs from a seed, tune on one split,
score on another, report rates with 95% Wilson intervals.

    # 1. design runs (the only ones thresholds are tuned on), then tune
    python benchmarks/scan_eval.py run   --split design  --runs-per-kind 30 --clean-runs 50 --out out/scan_eval
    python benchmarks/scan_eval.py tune  --out out/scan_eval                       # writes tuned.json
    # 2. fresh held-out runs, scored with the tuned thresholds
    python benchmarks/scan_eval.py run   --split heldout --runs-per-kind 30 --clean-runs 50 --out out/scan_eval
    python benchmarks/scan_eval.py score --split heldout --out out/scan_eval       # scores-heldout.json

Kinds: none, compute (constant slowdown 1.2-2x), intermittent (the same every 2-4 iterations),
link (2-50 ms arrival delay on a pipeline link), two_faults (a slowdown and a link at once).
Sources, drawn per run: real engine jobs on TP/PP/DP layouts (`megatronapp train --trace`) and
the plain DDP example under `megatronapp trace run`; `--synthetic` replaces both with the trace
simulator (tests/scan_simulation.py), for a quick smoke. Each run leaves OUT/SPLIT/NAME/trace and
result.json; `run` skips runs whose result.json exists, so it resumes after an interruption and
a larger --runs-per-kind only adds runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the trace simulator lives with the tests
sys.path.insert(0, str(Path(__file__).resolve().parent))

from scan_eval_core import (  # noqa: E402
    FAULT_KINDS,
    Fault,
    Scenario,
    compute_scores,
    plan_scenarios,
    select_thresholds,
    threshold_grid,
)

from megatronapp.scan.align import align_traces  # noqa: E402
from megatronapp.scan.detect import DetectConfig, detect  # noqa: E402
from megatronapp.scan.format import load_trace_dir  # noqa: E402

ITERS = 12  # analysed: 1..11 (0 is warm-up), so a 1-in-4 slowdown hits >= 2 iterations


def save_json_atomic(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=2)
    os.replace(tmp, path)


def _fault_flags(f: Fault) -> list[str]:
    flags = []
    if f.factor > 1.0:
        flags += ["--inject-slowdown", f"{f.rank}:{f.factor}:{f.every}"]
    if f.link is not None:
        flags += ["--inject-link-delay", f"{f.link[0]}:{f.link[1]}:{f.delay_ms}"]
    return flags


def build_command(sc: Scenario, trace_dir: Path) -> list[str]:
    """The CLI invocation that produces the scenario's trace directory."""
    cli = [sys.executable, "-m", "megatronapp.cli.main"]
    if sc.source == "ddp":
        return cli + ["trace", "run", "--nproc-per-node", str(sc.nproc), "--trace-dir", str(trace_dir),
                      *_fault_flags(sc.fault), "--", str(ROOT / "examples" / "ddp_train.py"), "--steps", str(ITERS)]
    return cli + ["train", "--nproc-per-node", str(sc.nproc), "--tensor-model-parallel-size", str(sc.tp),
                  "--pipeline-model-parallel-size", str(sc.pp), "--model", "tiny", "--train-iters", str(ITERS),
                  "--global-batch-size", "16", "--micro-batch-size", "2", "--seed", str(sc.seed % 10_000),
                  "--trace", "--trace-dir", str(trace_dir), "--device", "cpu", *_fault_flags(sc.fault)]


def _simulate(sc: Scenario, trace_dir: Path) -> None:
    from scan_simulation import SimulatedJob, simulate_job_traces

    from megatronapp.scan.format import TraceWriter, trace_file_name

    f = sc.fault
    job = SimulatedJob(tp_size=sc.tp, pp_size=sc.pp, dp_size=sc.nproc // (sc.tp * sc.pp), iterations=ITERS,
                       noise=0.15, hiccup_prob=0.03, rank_bias=0.03, seed=sc.seed,
                       slow_rank=f.rank if f.factor > 1 else None, slow_factor=f.factor, slow_every=f.every,
                       slow_link=f.link, link_delay_ns=int(f.delay_ms * 1e6))
    trace_dir.mkdir(parents=True, exist_ok=True)
    for t in simulate_job_traces(job):
        with TraceWriter(trace_dir / trace_file_name(t.rank), t.meta) as w:
            w.append(t.events.combine_chunks().to_batches()[0])


def detect_dir(trace_dir: Path, configs: list[DetectConfig]) -> list[list[dict]]:
    """Suspects (JSON form) per config; the traces are loaded and aligned once."""
    aligned, _ = align_traces(load_trace_dir(trace_dir))
    out = []
    for config in configs:
        report = detect(aligned, config=config)
        out.append([{"rank": s.rank, "cause": s.cause, "link": list(s.link) if s.link else None,
                     "confidence": s.confidence} for s in report.suspects])
    return out


def execute(sc: Scenario, out: Path, synthetic: bool, timeout: int) -> dict:
    """Produce the trace, detect with the default thresholds, write result.json (atomic)."""
    run_dir = out / sc.split / sc.name
    trace_dir, t0, error, suspects = run_dir / "trace", time.perf_counter(), "", []
    try:
        if synthetic:
            _simulate(sc, trace_dir)
        else:
            proc = subprocess.run(build_command(sc, trace_dir), capture_output=True, text=True, timeout=timeout,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
            (run_dir / "log.txt").parent.mkdir(parents=True, exist_ok=True)
            (run_dir / "log.txt").write_text(proc.stdout + proc.stderr)
            if proc.returncode != 0:
                raise RuntimeError(f"exit {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[-1]}")
        suspects = detect_dir(trace_dir, [DetectConfig()])[0]
    except (OSError, ValueError, RuntimeError, subprocess.TimeoutExpired) as exc:
        error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    result = {"scenario": asdict(sc), "suspects": suspects, "error": error,
              "seconds": round(time.perf_counter() - t0, 2), "synthetic": synthetic}
    save_json_atomic(run_dir / "result.json", result)
    return result


def load_results(out: Path, split: str) -> list[tuple[Scenario, Path, dict]]:
    found = []
    for path in sorted((out / split).glob("*/result.json")):
        r = json.loads(path.read_text())
        s, f = r["scenario"], r["scenario"]["fault"]
        fault = Fault(**{**f, "link": tuple(f["link"]) if f["link"] else None})
        found.append((Scenario(**{**s, "fault": fault}), path.parent / "trace", r))
    return found


def cmd_run(args) -> int:
    plan = plan_scenarios(args.split, args.seed, args.runs_per_kind, args.clean_runs)
    todo = [sc for sc in plan if not (Path(args.out) / sc.split / sc.name / "result.json").is_file()]
    print(f"{len(plan)} scenarios in {args.split}, {len(plan) - len(todo)} done already, running {len(todo)}")
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for sc, r in zip(todo, pool.map(lambda s: execute(s, Path(args.out), args.synthetic, args.timeout), todo)):
            verdict = r["error"] or ", ".join(f"{s['cause']}@{s['link'] or s['rank']}" for s in r["suspects"]) or "nobody"
            print(f"{sc.name:28s} {sc.source}:{sc.tp}x{sc.pp}x{sc.nproc} {sc.fault} -> {verdict} ({r['seconds']}s)",
                  flush=True)
    return 0


def cmd_tune(args) -> int:
    runs = [(sc, d) for sc, d, r in load_results(Path(args.out), "design") if not r["error"]]
    if not runs:
        print("error: no design runs to tune on (run --split design first)", file=sys.stderr)
        return 2
    grid = threshold_grid()
    configs = [DetectConfig(**g) for g in grid]
    per_run = [detect_dir(d, configs) for _, d in runs]
    scored = [(g, compute_scores([(sc, per_run[i][k]) for i, (sc, _) in enumerate(runs)])) for k, g in enumerate(grid)]
    best = select_thresholds(scored)
    design_scores = next(s for g, s in scored if g == best)
    save_json_atomic(Path(args.out) / "tuned.json", {"overrides": best, "design_runs": len(runs),
                                                      "design_scores": design_scores})
    print(f"tuned on {len(runs)} design runs: {best} -> {Path(args.out) / 'tuned.json'}")
    return 0


def cmd_score(args) -> int:
    out = Path(args.out)
    tuned = out / "tuned.json"
    overrides = json.loads(tuned.read_text())["overrides"] if tuned.is_file() and not args.default_thresholds else {}
    results = load_results(out, args.split)
    ok = [(sc, d) for sc, d, r in results if not r["error"]]
    scores = compute_scores([(sc, detect_dir(d, [DetectConfig(**overrides)])[0]) for sc, d in ok])
    payload = {"split": args.split, "thresholds": overrides or "defaults", "runs": len(ok),
               "failed": len(results) - len(ok), "scores": scores}
    save_json_atomic(out / f"scores-{args.split}.json", payload)
    print(f"{args.split}: {len(ok)} runs scored ({len(results) - len(ok)} failed), thresholds {overrides or 'default'}")
    print(f"  clean: false alarms {scores['none']['false_alarm_rate']}")
    for kind in FAULT_KINDS:
        s = scores[kind]
        print(f"  {kind:13s} recall {s['recall']}  precision {s['precision']}  root-cause {s['root_cause_accuracy']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="execute the scenarios of a split (resumable)")
    run.add_argument("--split", choices=("design", "heldout"), required=True)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--runs-per-kind", type=int, default=30)
    run.add_argument("--clean-runs", type=int, default=50)
    run.add_argument("--synthetic", action="store_true", help="simulate the jobs (no training)")
    run.add_argument("--jobs", type=int, default=1, help="scenarios run at once (each job uses nproc processes)")
    run.add_argument("--timeout", type=int, default=900, help="seconds per job")
    tune = sub.add_parser("tune", help="choose thresholds on the design split")
    score = sub.add_parser("score", help="score a split with the tuned (or default) thresholds")
    score.add_argument("--split", choices=("design", "heldout"), default="heldout")
    score.add_argument("--default-thresholds", action="store_true")
    for sp in (run, tune, score):
        sp.add_argument("--out", default="out/scan_eval")
    run.set_defaults(func=cmd_run)
    tune.set_defaults(func=cmd_tune)
    score.set_defaults(func=cmd_score)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "run" and (args.runs_per_kind < 0 or args.clean_runs < 0 or args.jobs < 1):
        print("error: --runs-per-kind and --clean-runs must be >= 0, --jobs >= 1", file=sys.stderr)
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
