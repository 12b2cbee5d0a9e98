"""Engine integrity on one GPU, in one command (about 8 minutes on an H200):

    python benchmarks/integrity_bench.py --out $OUT

determinism: two `--deterministic` runs of the 1.4B preset (--bf16 --compile, micro/global batch 4,
  --iters steps) through the CLI; their per-step loss and grad norm compared bit for bit.
spikes: the loss-spike command (bf16, 40 iterations, log interval 10) --spike-runs times with
  --check-for-spiky-loss --check-for-large-grads --rerun-mode validate_results; every flagged
  step with its verdict (transient: the rerun differed; reproducible: it did not).
cost: benchmarks/engine_bench.py's interleaved rounds of --cost-variants (default: engine, i.e. the
  NaN check on, engine_no_checks, engine_checks and engine_deterministic, beside the plain twin;
  about 25 GB of resident state each at 1.4B, so four fit an H200 but not an H100; engine_rerun
  adds the checks before the update and a replay point per step, no state copy), median + spread.
Raw results: OUT/integrity.json, the runs' metrics files and engine_bench's JSON beside it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from megatronapp.engine.integrity import compare_runs, tabulate_flagged

ROOT = Path(__file__).resolve().parents[1]
SPIKE_COMMAND = [
    "--model",
    "1.3b",
    "--bf16",
    "--compile",
    "--micro-batch-size",
    "4",
    "--global-batch-size",
    "4",
    "--make-vocab-size-divisible-by",
    "50304",
]
CHECK_FLAGS = ["--check-for-spiky-loss", "--check-for-large-grads", "--rerun-mode", "validate_results"]


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _train(out: Path, name: str, iters: int, extra: list[str], timeout: float) -> list[dict]:
    metrics = out / f"{name}.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "megatronapp.cli.main",
        "train",
        *SPIKE_COMMAND,
        "--train-iters",
        str(iters),
        "--log-interval",
        "10",
        "--metrics-file",
        str(metrics),
        *extra,
    ]
    print("+", " ".join(cmd[1:]), flush=True)
    done = subprocess.run(cmd, cwd=ROOT, timeout=timeout, capture_output=True, text=True)
    (out / f"{name}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"integrity_bench: {name} failed (exit {done.returncode}); see {out / (name + '.log')}")
    return read_metrics(metrics)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="engine integrity on one GPU: determinism, spikes, cost")
    p.add_argument("--out", required=True, help="folder for the JSON results and the runs' metrics")
    p.add_argument("--only", default="determinism,spikes,cost")
    p.add_argument("--iters", type=int, default=50, help="determinism: steps of each run")
    p.add_argument("--spike-runs", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5, help="cost: interleaved rounds")
    p.add_argument("--cost-variants", default="engine,engine_no_checks,engine_checks,engine_deterministic")
    return p


def main() -> None:
    args = build_parser().parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"args": vars(args)}
    only = args.only.split(",")
    if "determinism" in only:
        a, b = (_train(out, f"deterministic_r{k}", args.iters, ["--deterministic"], 600) for k in (1, 2))
        results["determinism"] = compare_runs(a, b)
        print(json.dumps(results["determinism"]), flush=True)
    if "spikes" in only:
        runs = {
            f"spikes_r{k}": _train(out, f"spikes_r{k}", 40, CHECK_FLAGS, 600) for k in range(1, args.spike_runs + 1)
        }
        results["spikes"] = {
            "flagged": tabulate_flagged(runs),
            "final_loss": {name: rows[-1]["loss"] for name, rows in runs.items()},
        }
        print(json.dumps(results["spikes"], indent=1), flush=True)
    (out / "integrity.json").write_text(json.dumps(results, indent=1))
    if "cost" in only:
        bench = [
            sys.executable,
            str(ROOT / "benchmarks" / "engine_bench.py"),
            "--only",
            "throughput",
            "--variants",
            args.cost_variants,
            "--rounds",
            str(args.rounds),
            "--steps",
            "4",
            "--num-micro",
            "1",
            "--out",
            str(out / "cost.json"),
        ]
        print("+", " ".join(bench[1:]), flush=True)
        subprocess.run(bench, cwd=ROOT, check=True, timeout=900)


if __name__ == "__main__":
    main()
