"""One evaluation run, start to verdict, and the JSONL file the runs are appended to.

`execute_run` (a worker-process entry point) launches the scenario as a real multi-process CPU
gloo job, each rank one torch thread, under a hard timeout that kills the whole process tree;
then loads, aligns and detects the trace (megatronapp.scan: the same load -> align -> detect as
`trace detect`) with the thresholds under test, the defaults, and, on the design split, every
point of the tuning grid. It returns one JSON-ready record; the caller appends it.

Engine scenarios run `megatronapp train` ranks under torch's standalone launcher directly (what
`megatronapp train --nproc-per-node` runs, without its end-of-run merge and report, which the
evaluation does not read); DDP scenarios run `megatronapp trace run` on examples/ddp_train.py,
unchanged, exactly as a user would.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from megatronapp.faultlab.evaluation.injected import (
    COMPUTE_GRID,
    LINK_GRID,
    Fault,
    Scenario,
    named_causes,
    scenario_from_dict,
)
from megatronapp.launch.local import torchrun_command, trace_run_command

ROOT = Path(__file__).resolve().parents[3]  # the repository: examples/ and tests/ live there
ITERS = 32  # analysed 1..31 (0 is warm-up): an intermittent 1-in-4 slowdown hits 7 of them. Was 16 up to
# heldout2, whose 3 intermittent misses had 3-5 slow iterations each (the protocol from heldout3 on)
# The DDP example at a real step's size: at its toy default a traced CPU forward is ~0.4 ms, mostly hook
# overhead, and a loaded machine's steady skew of ~0.25 ms alone reads as 1.5x (CI stop 18).
DDP_WORK = ("--hidden", "1024", "--batch", "128")
KILL_GRACE_S = 5.0  # after SIGTERM to the launcher, before SIGKILL to every descendant


def _fault_flags(f: Fault) -> list[str]:
    flags = []
    if f.factor > 1.0:
        flags += ["--inject-slowdown", f"{f.rank}:{f.factor}:{f.every}"]
    if f.link is not None:
        flags += ["--inject-link-delay", f"{f.link[0]}:{f.link[1]}:{f.delay_ms}"]
    return flags


def build_command(sc: Scenario, trace_dir: Path) -> list[str]:
    """The command line that produces the scenario's trace directory."""
    if sc.source == "ddp":
        script = [str(ROOT / "examples" / "ddp_train.py"), "--steps", str(ITERS), *DDP_WORK]
        return trace_run_command(sc.nproc, trace_dir, script, _fault_flags(sc.fault))
    return torchrun_command(
        [
            "megatronapp.cli.main",
            "train",
            "--tensor-model-parallel-size",
            str(sc.tp),
            "--pipeline-model-parallel-size",
            str(sc.pp),
            "--model",
            "tiny",
            "--train-iters",
            str(ITERS),
            "--global-batch-size",
            "16",
            "--micro-batch-size",
            "2",
            "--seed",
            str(sc.seed % 10_000),
            "--log-interval",
            str(ITERS),
            "--device",
            "cpu",
            "--trace",
            "--trace-dir",
            str(trace_dir),
            *_fault_flags(sc.fault),
        ],
        sc.nproc,
    )


def child_env(sc: Scenario) -> dict[str, str]:
    """One torch thread per rank, CPU only (the DDP example would take a GPU if it saw one)."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "LOGLEVEL": "ERROR",
        "MEGATRONAPP_RUN_ID": sc.name,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    }


def _descendants(pid: int) -> list[int]:
    """Every live descendant of pid (Linux /proc): the launcher's ranks run in their own sessions."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGTERM the launcher (it stops its ranks), then SIGKILL whatever of its tree is left."""
    tree = _descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    for pid in [proc.pid, *tree, *_descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def run_job(sc: Scenario, trace_dir: Path, timeout_s: float) -> str:
    """Run the scenario's job; '' on success, else a one-line error (exit code or timeout)."""
    trace_dir.mkdir(parents=True, exist_ok=True)
    log = trace_dir.parent / "log.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            build_command(sc, trace_dir), stdout=out, stderr=subprocess.STDOUT, env=child_env(sc), cwd=ROOT
        )
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            return f"timeout after {timeout_s:.0f} s"
    if code != 0:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        return f"exit {code}: {lines[-1][:300] if lines else ''}"
    return ""


def _suspects_json(report) -> list[dict]:
    return [
        {"cause": s.cause, "rank": s.rank, "link": list(s.link) if s.link else None, "confidence": s.confidence}
        for s in report.suspects
    ]


def detect_run(trace_dir: Path, overrides: dict, grid: bool) -> dict:
    """Suspects with `overrides` and with the defaults; with grid, the compute ranks at every
    COMPUTE_GRID point and the links at every LINK_GRID point (injected.tune_on_design)."""
    from megatronapp.scan.analyze.detect import detect
    from megatronapp.scan.analyze.detect_config import DetectConfig
    from megatronapp.scan.analyze.load_align_detect import load_aligned_traces

    aligned, _ = load_aligned_traces(trace_dir)
    out = {
        "suspects": _suspects_json(detect(aligned, config=DetectConfig(**overrides))),
        "default_suspects": _suspects_json(detect(aligned, config=DetectConfig())),
    }
    if grid:
        out["grid_compute"] = [
            sorted(s.rank for s in detect(aligned, config=DetectConfig(**point)).suspects if s.cause == "slow_compute")
            for point in COMPUTE_GRID
        ]
        out["grid_link"] = [
            sorted(
                list(s.link) for s in detect(aligned, config=DetectConfig(**point)).suspects if s.cause == "slow_link"
            )
            for point in LINK_GRID
        ]
    return out


def simulate_run(sc: Scenario, trace_dir: Path) -> str:
    """The trace simulator instead of a job (--synthetic smoke; tests/support/scan_simulation.py)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from scan_simulation import SimulatedJob, simulate_job_traces

    from megatronapp.scan.record.format import TraceWriter, trace_file_name

    f = sc.fault
    job = SimulatedJob(
        tp_size=sc.tp,
        pp_size=sc.pp,
        dp_size=sc.nproc // (sc.tp * sc.pp),
        iterations=ITERS,
        noise=0.15,
        hiccup_prob=0.03,
        rank_bias=0.03,
        seed=sc.seed,
        slow_rank=f.rank if f.factor > 1 else None,
        slow_factor=f.factor,
        slow_every=f.every,
        slow_link=f.link,
        link_delay_ns=int(f.delay_ms * 1e6),
    )
    trace_dir.mkdir(parents=True, exist_ok=True)
    for t in simulate_job_traces(job):
        with TraceWriter(trace_dir / trace_file_name(t.rank), t.meta) as w:
            w.append(t.events.combine_chunks().to_batches()[0])
    return ""


def execute_run(task: dict) -> dict:
    """Worker entry: task = {scenario, work_dir, timeout_s, deadline (time.time() or None),
    overrides, thresholds_file, synthetic, keep_traces}. Returns the run's JSONL record; a run cut
    by the deadline comes back with error 'deadline' and is not recorded (resume redoes it)."""
    sc = scenario_from_dict(task["scenario"])
    run_dir = Path(task["work_dir"]) / sc.name
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    timeout = task["timeout_s"] if task["deadline"] is None else min(task["timeout_s"], task["deadline"] - time.time())
    if timeout <= 0:
        return {"name": sc.name, "error": "deadline"}
    error = simulate_run(sc, run_dir / "trace") if task["synthetic"] else run_job(sc, run_dir / "trace", timeout)
    if error.startswith("timeout") and timeout < task["timeout_s"]:
        error = "deadline"
    t_job = time.perf_counter() - t0
    found = {}
    if not error:
        try:
            found = detect_run(run_dir / "trace", task["overrides"], grid=sc.split == "design")
        except (OSError, ValueError) as exc:
            error = f"detect: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    right = not error and named_causes(found["suspects"]) == sc.truth()
    if right and not task["keep_traces"]:  # wrong verdicts keep their trace, for diagnosis
        shutil.rmtree(run_dir, ignore_errors=True)
    return {
        "name": sc.name,
        "split": sc.split,
        "kind": sc.kind,
        "layout": sc.layout,
        "scenario": asdict(sc),
        "thresholds": task["overrides"],
        "thresholds_file": task["thresholds_file"],
        "error": error,
        "job_seconds": round(t_job, 2),
        "seconds": round(time.perf_counter() - t0, 2),
        "synthetic": task["synthetic"],
        **found,
    }


def append_record(path: Path, record: dict) -> None:
    """Append one line with a single write on an O_APPEND descriptor, then fsync: a run killed
    mid-way leaves at most a truncated last line, which load_records skips."""
    data = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def load_records(path: Path) -> list[dict]:
    """Every complete record of a JSONL results file. A bad line other than a truncated last one
    is an error (ValueError naming the line): results are never silently dropped."""
    text = Path(path).read_text()
    lines = text.split("\n")
    records = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) and not text.endswith("\n"):
                continue  # the run was killed while appending its last line
            raise ValueError(f"{path}:{i}: not a JSON record") from None
    return records
