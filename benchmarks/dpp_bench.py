"""MegaDPP benchmark: static 1F1B / interleaved / breadth-first vs dynamic, with and without jitter.

Every run (a *cell*: one scenario, one variant) is a real `megatronapp train` job (gloo, CPU,
one thread per rank; or `--device cuda`, one GPU per rank over NCCL, where a host has them). By default all cells run in one launched set of ranks, one job after the
other (`run_rank` of the checked run, its injection config's `keep_process_group` set: fresh groups, trainer, data and injections per
cell, the process group and the imported torch kept), which cuts a cell from ~28 s (8 processes
starting torch) to a few seconds on the 16-core host; --isolated starts a fresh
`megatronapp train` per cell instead. Cells run interleaved within each repeat (shuffled per repeat with
--seed), so slow drifts of the host hit all variants alike; per cell the median step time
after --warmup iterations is kept. Each cell's result is appended to OUT/dpp_bench.jsonl
(flushed) the moment it is measured, with a progress line, so an interrupted run keeps what
it measured; --budget-s stops starting cells that would not finish in time. The summary
(also OUT/dpp_bench.json) gives, per scenario and variant, the median over repeats, the
spread (min..max), iterations/s relative to static interleaved, and per pipeline rank the
peak in-flight activation sets the schedule allows (static: its own peak, simulated;
dynamic: its cap, which the runtime never exceeds) and what they hold: layer inputs and the
activation memory of Korthikanti et al.'s formula for those layers (an estimate).

Scenarios, by pipeline stage of replica 0 (megatronapp/dpp/sim/scenarios.py, shared with the
simulator study), translated to global ranks for the layout; on the default PP4 x DP2:
  balanced  no injection
  jitter1   --inject-jitter 4:1.5           pp 2, each task up to 1.5x
  jitter2   --inject-jitter 2:1.5:1 --inject-jitter 4:1.5:2   pp 1 and pp 2, independently (they alternate)
  link      --inject-link-delay 2:4:5       pp1 -> pp2 delayed 5 ms
(on PP8: --inject-jitter 2:1.5; 1:1.5:1 and 2:1.5:2; --inject-link-delay 1:2:5).

    python benchmarks/dpp_bench.py --out runs/dpp_bench --budget-s 500  # 8 ranks, 16-core host, < 9 min
    python benchmarks/dpp_bench.py --pp 8 --microbatches 16 --num-layers 16 --out runs/dpp_pp8  # PP8 V2 M16
    python benchmarks/dpp_bench.py --smoke --out /tmp/dpp_smoke         # tiny, a couple of minutes

The variants, a cell's flags, the plan, the records and their statistics are
megatronapp/dpp/sim/bench_cells.py; this script launches the jobs.

--trace-cells adds one traced pass of every cell after the repeats (OUT/traces/SCENARIO__VARIANT,
not in the statistics); benchmarks/dpp_trace_gap.py OUT then splits each variant's measured
iteration into what its traced task times, waits and host gaps explain, against the simulator.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

from torch_zb_cell import UNSUPPORTED, run_torch_zb_cell

from megatronapp.dpp.sim.bench_cells import (
    TORCH_ZB,
    TRACED_REPEAT,
    VARIANTS,
    CellGrid,
    append_record,
    build_plan,
    compute_summary,
    compute_train_argv,
    make_record,
    run_cells,
)
from megatronapp.dpp.sim.scenarios import SCENARIOS, compute_scenario_flags


def grid_of(a) -> CellGrid:
    """The cells' shared job from the parsed flags."""
    return CellGrid(
        nproc=a.nproc,
        pp=a.pp,
        vpp=a.vpp,
        microbatches=a.microbatches,
        num_layers=a.num_layers,
        hidden_size=a.hidden_size,
        heads=a.heads,
        seq_length=a.seq_length,
        iters=a.iters,
        device=a.device,
        seed=a.seed,
        simulate_scenarios=not a.smoke,
        scenario_flags=a.scenario_flags,
    )


def trace_dir_of(a, scenario: str, variant: str) -> Path:
    return Path(a.out) / "traces" / f"{scenario}__{variant}"


def _train_argv(a, variant: str, scenario: str, metrics: str, repeat: int = 0) -> list[str]:
    """`megatronapp train` arguments of a cell, without the launch: for ranks already running."""
    trace_dir = str(trace_dir_of(a, scenario, variant)) if repeat == TRACED_REPEAT else None
    return compute_train_argv(grid_of(a), variant, scenario, metrics, trace_dir)


def _train_cmd(a, variant: str, scenario: str, metrics: str, repeat: int = 0) -> list[str]:
    """The same cell as its own `megatronapp train` job (--isolated)."""
    return [
        sys.executable,
        "-m",
        "megatronapp.cli.main",
        *_train_argv(a, variant, scenario, metrics, repeat),
        "--nproc-per-node",
        str(a.nproc),
    ]


def run_cells_in_worker(a, plan: list[tuple[int, str, str]]) -> None:
    """Rank body of the persistent mode (under torch.distributed.run): every cell of `plan` in
    order, rank 0 appending each record to OUT/dpp_bench.jsonl when the cell ends."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from megatronapp.cli.main import build_checked_run
    from megatronapp.cli.train import run_rank

    torch.set_num_threads(1)
    if a.device == "cuda":  # as `megatronapp train` places ranks: local rank r on GPU r; host data on gloo
        gpu = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(gpu)
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timedelta(seconds=a.timeout), device_id=gpu)
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=a.timeout))
    rank, t0, slowest = dist.get_rank(), time.time(), 0.0
    log = open(Path(a.out) / "dpp_bench.jsonl", "a") if rank == 0 else None
    try:
        for k, (rep, scenario, variant) in enumerate(plan):
            go = torch.tensor([a.budget_s is None or time.time() - t0 + slowest <= a.budget_s])
            dist.broadcast(go, 0)  # rank 0's clock decides, so every rank stops at the same cell
            if not go.item():
                if rank == 0:
                    print(
                        f"budget: {time.time() - t0:.0f} s used, the next cell may take {slowest:.0f} s: stopping",
                        flush=True,
                    )
                break
            if variant == TORCH_ZB and scenario != "balanced":
                if rank == 0:
                    append_record(log, {"scenario": scenario, "variant": variant, "repeat": rep, "error": UNSUPPORTED})
                continue
            with tempfile.TemporaryDirectory() as tmp:
                metrics, start = os.path.join(tmp, "m.jsonl"), time.time()
                argv = _train_argv(a, variant, scenario, metrics, rep)
                if variant == TORCH_ZB:  # PyTorch's schedule on the same chunks (torch_zb_cell.py)
                    steps = run_torch_zb_cell(argv, a.warmup)
                else:
                    run = build_checked_run(argv)  # as `megatronapp train` would, checked
                    run_rank(replace(run, injection=replace(run.injection, keep_process_group=True)))
                dist.barrier()
                slowest = max(slowest, time.time() - start)
                if rank == 0:
                    if variant != TORCH_ZB:
                        lines = Path(metrics).read_text().splitlines()
                        steps = [json.loads(line)["step_time_s"] for line in lines][a.warmup :]
                    rec = make_record(grid_of(a), scenario, variant, rep, steps, time.time() - start)
                    rec["process"] = process_state()  # rank 0's, after the cell: a leak across cells shows here
                    append_record(log, rec)
                    _progress(k + 1, len(plan), t0, rep, scenario, variant, rec)
    finally:
        if log is not None:
            log.close()
        dist.destroy_process_group()


def _run_echoing_progress(cmd: list[str], env: dict, limit: float, log_path: Path):
    """Run `cmd` with its output in `log_path`, echoing the per-cell progress lines; exit code."""
    with (
        open(log_path, "w") as log,
        subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, start_new_session=True
        ) as proc,
    ):
        # a hung job cannot outlive the budget: kill the launcher and its ranks together
        timer = threading.Timer(limit, lambda: os.killpg(proc.pid, signal.SIGKILL))
        timer.start()
        try:
            for line in proc.stdout:
                log.write(line)
                if line.startswith(("[", "budget:")):
                    print(line, end="", flush=True)
        finally:
            timer.cancel()
        return proc.wait()


def run_persistent(a, plan: list[tuple[int, str, str]]) -> list[dict]:
    """Launch the ranks once for the whole plan; the records they wrote (the job's error as one
    record if it died: the cells it finished stay on disk)."""
    path = Path(a.out) / "dpp_bench.jsonl"
    offset = path.stat().st_size if path.exists() else 0
    plan_file = Path(a.out) / "plan.json"
    plan_file.write_text(json.dumps({"args": vars(a), "plan": plan}))
    root = str(Path(__file__).resolve().parents[1])  # the ranks import this checkout, installed or not
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "LOGLEVEL": "ERROR",
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(a.nproc),
        __file__,
        "--worker",
        str(plan_file),
    ]
    limit = (a.budget_s or a.timeout * len(plan)) + a.timeout
    code = _run_echoing_progress(cmd, env, limit, Path(a.out) / "ranks.log")
    with open(path) as f:
        f.seek(offset)
        records = [json.loads(line) for line in f if line.strip()]
    if code != 0:
        tail = (Path(a.out) / "ranks.log").read_text()[-1500:]
        print(f"the ranks' job ended with {code} after {len(records)} cells; end of {a.out}/ranks.log:\n{tail}")
    return records


def run_once(a, variant: str, scenario: str, repeat: int = 0) -> list[float]:
    """Step seconds of one job after the warm-up iterations."""
    if variant == TORCH_ZB:
        raise RuntimeError("torch-zb runs in the persistent mode only (drop --isolated)")
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        res = subprocess.run(
            _train_cmd(a, variant, scenario, metrics, repeat),
            capture_output=True,
            text=True,
            timeout=a.timeout,
            env=env,
        )
        if res.returncode:
            raise RuntimeError(f"{variant}/{scenario} failed: {res.stderr[-2000:]}")
        steps = [json.loads(line)["step_time_s"] for line in Path(metrics).read_text().splitlines()]
    return steps[a.warmup :]


def process_state() -> dict:
    """Threads (native ones too: gloo's), open file descriptors and resident MiB of this
    process (Linux; {} elsewhere), and the Python objects the garbage collector tracks with its
    full collections so far (more live objects make every full collection slower)."""
    try:
        threads, fds = len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))
        rss_pages = int(Path("/proc/self/statm").read_text().split()[1])
    except OSError:
        return {}
    return {
        "threads": threads,
        "fds": fds,
        "rss_mib": round(rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1),
        "gc_objects": len(gc.get_objects()),
        "gc_full_collections": gc.get_stats()[2]["collections"],
    }


def _progress(done: int, total: int, t0: float, rep: int, scenario: str, variant: str, rec: dict) -> None:
    what = f"{rec['median_s'] * 1e3:.1f} ms/iter" if "median_s" in rec else "FAILED: " + rec["error"][-200:]
    print(
        f"[{done}/{total}] {time.time() - t0:5.0f} s  repeat {rep} {scenario}/{variant}: {what} "
        f"({rec['wall_s']:.0f} s)",
        flush=True,
    )


def print_summary(a, summary: dict) -> None:
    """Per scenario and variant: median over repeats, spread, speed vs interleaved (measured,
    simulated, paired per repeat with its 95 % interval), peak in-flight sets and memory."""
    for scenario in a.scenarios:
        print(f"\n{scenario}: median ms/iteration over repeats (spread), speed vs interleaved")
        for variant in a.variants:
            row = summary.get(f"{scenario}/{variant}")
            if row is None:
                print(f"  {variant:<17} not measured")
                continue
            runs, paired = row["runs_s"], row["paired_speed_vs_interleaved"]
            print(
                f"  {variant:<17} {row['median_s'] * 1e3:8.1f} ms  ({min(runs) * 1e3:.1f}..{max(runs) * 1e3:.1f}, "
                f"n={len(runs)})  x{row['speed_vs_interleaved']:.3f} (simulated "
                f"x{row['simulated_speed_vs_interleaved']:.3f})  peak sets {row['peak_inflight_sets']} x "
                f"{row['layers_per_set']} layer(s), ~{row['activation_MiB_est']} MiB"
            )
            if paired:
                print(
                    f"  {'':<17} paired per repeat x{paired['median']:.3f} "
                    f"[95% CI {paired['ci95'][0]:.3f}, {paired['ci95'][1]:.3f}], n={paired['n']}"
                )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=8)
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: one GPU per rank (NCCL needs distinct GPUs), e.g. PP8 on an 8-GPU host",
    )
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--vpp", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8, help="per DP replica")
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--heads", type=int, default=4, help="the demo preset's; only for the memory estimate")
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    p.add_argument(
        "--variants",
        nargs="+",
        default=["interleaved", "breadth-first", "dynamic-df", "dynamic-inorder", "dynamic-w"],
        choices=list(VARIANTS),
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300, help="per cell")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no cell that would end after this many seconds (by the slowest cell so far)",
    )
    p.add_argument("--smoke", action="store_true", help="2 ranks, tiny model, 1 repeat, balanced + jitter1")
    p.add_argument("--out", default="runs/dpp_bench")
    p.add_argument("--isolated", action="store_true", help="a fresh `megatronapp train` job per cell")
    p.add_argument(
        "--trace-cells",
        action="store_true",
        help="after the repeats, one more pass of every cell with MegaScan tracing, into "
        "OUT/traces/SCENARIO__VARIANT (left out of the statistics; read by dpp_trace_gap.py)",
    )
    return p


def parse_args(argv):
    p = build_parser()
    a = p.parse_args(argv)
    if a.smoke:
        a.nproc, a.pp, a.microbatches, a.num_layers, a.hidden_size, a.seq_length = 2, 2, 4, 4, 64, 32
        a.iters, a.warmup, a.repeats = 5, 2, 1
        a.scenarios = [sc for sc in a.scenarios if sc in ("balanced", "jitter1")] or ["balanced"]
        a.scenario_flags = {"balanced": [], "jitter1": ["--inject-jitter", "1:1.5"]}  # PP2: the last stage
    elif a.pp < 3 and a.scenarios != ["balanced"]:
        p.error("the scenarios perturb pipeline stages 1 and 2: needs --pp >= 3 (or --smoke, or --scenarios balanced)")
    if TORCH_ZB in a.variants and (a.device == "cuda" or a.isolated):
        p.error("torch-zb runs on CPU gloo ranks in the persistent mode (no --device cuda, no --isolated)")
    if a.iters <= a.warmup or a.nproc % a.pp or a.num_layers % (a.pp * a.vpp):
        p.error("needs --iters > --warmup, --nproc divisible by --pp and --num-layers by pp * vpp")
    if not a.smoke:
        a.scenario_flags = {s: compute_scenario_flags(s, a.pp, a.nproc // a.pp) for s in a.scenarios}
    if a.device == "cuda":
        import torch

        if torch.cuda.device_count() < a.nproc:
            p.error(f"--device cuda needs one GPU per rank: {a.nproc} ranks, {torch.cuda.device_count()} GPUs visible")
    return a


def run_isolated(a, plan: list[tuple[int, str, str]]) -> list[dict]:
    """Every cell as its own `megatronapp train` job (--isolated), each record on disk at once."""
    t0 = time.time()

    def measure(rep: int, scenario: str, variant: str) -> dict:
        start = time.time()
        return make_record(grid_of(a), scenario, variant, rep, run_once(a, variant, scenario, rep), time.time() - start)

    with open(Path(a.out) / "dpp_bench.jsonl", "a") as log:
        records = run_cells(
            plan,
            measure,
            log,
            budget_s=a.budget_s,
            clock=time.time,
            on_record=lambda done, rec: _progress(
                done, len(plan), t0, rec["repeat"], rec["scenario"], rec["variant"], rec
            ),
        )
    if len(records) < len(plan):
        print(f"budget: {time.time() - t0:.0f} s used, the next cell would not end in time: stopped", flush=True)
    return records


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:  # one rank of the persistent mode
        spec = json.loads(Path(argv[1]).read_text())
        run_cells_in_worker(argparse.Namespace(**spec["args"]), [tuple(c) for c in spec["plan"]])
        return 0
    a = parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    if a.trace_cells:  # a trace directory holds one cell's ranks, never an older run's
        shutil.rmtree(Path(a.out) / "traces", ignore_errors=True)
    plan = build_plan(a.scenarios, a.variants, a.repeats, a.seed, a.trace_cells)
    records = run_isolated(a, plan) if a.isolated else run_persistent(a, plan)
    results = compute_summary(grid_of(a), a.scenarios, a.variants, records)
    print_summary(a, results)
    path = Path(a.out) / "dpp_bench.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"args": vars(a), "results": results, "records": records}, indent=1))
    os.replace(tmp, path)
    print(f"\nwrote {path} and {path.with_suffix('.jsonl')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
