"""Streaming merge speed and memory on one core, for two trace lengths.

    python benchmarks/scan_merge_scale.py --events 10000000 --repeats 3 --out /tmp/merge_scale.json
    # against another source tree (e.g. `git worktree add /tmp/base main`), interleaved:
    python benchmarks/scan_merge_scale.py --events 4000000 --repeats 4 --baseline /tmp/base

A simulated TP2xPP4xDP8 job (64 ranks, 8 microbatches, ~5,000 events per iteration) is
written per rank through format.TraceWriter (tests/support/scan_simulation.write_repeated_job: one
record batch and calibration row per 100 iterations, as the tracer's timed flushes give),
once with --events/4 and once with --events events. Each merge runs in a fresh child process
pinned to one core (taskset when present; numpy/Arrow single-threaded), which reports its CPU
and wall time and its peak RSS (resource.getrusage). Repeats are interleaved across the two
lengths (and, with --baseline, across the two trees, in alternating order); median and
(min, max) are printed, and with --baseline the ratio of median CPU times (baseline / this
tree). CPU time is user + system; system time is mostly the kernel taking the ~280 bytes of
JSON per event into the page cache and varies with the machine's state, so user time is
reported on its own too. Memory is bounded if the peak RSS does not grow with the length.
Output goes to a temporary directory and is deleted after each run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the trace simulator lives with the tests

_CHILD = """
import json, os, resource, sys, time
import pyarrow as pa
pa.set_cpu_count(1); pa.set_io_thread_count(1)
try:
    from megatronapp.scan.merge.merge import merge_traces
except ImportError:  # a baseline tree from before scan/ was split into record/, merge/, analyze/
    from megatronapp.scan.merge import merge_traces
r0, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
s = merge_traces(sys.argv[1], sys.argv[2])
r1, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - wall
user, system = r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime
source = os.path.dirname(os.path.dirname(sys.modules["megatronapp"].__file__))
print(json.dumps({"events": s.events, "source": source, "cpu_s": user + system, "user_s": user, "sys_s": system,
                  "wall_s": wall, "flows": s.flows,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "peak_window_rows": s.peak_window_rows, "out_bytes": os.path.getsize(sys.argv[2])}))
"""


def run_merge(trace_dir: Path, out: Path, source: Path = ROOT) -> dict:
    """One merge by the code of `source` in a fresh single-threaded child, pinned to one core
    where taskset exists."""
    env = {**os.environ, "PYTHONPATH": str(source), "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []
    done = subprocess.run(
        [*pin, sys.executable, "-c", _CHILD, str(trace_dir), str(out)],
        env=env,
        cwd=source,
        capture_output=True,
        text=True,
        check=True,
    )  # cwd: "-c" puts it first on sys.path
    out.unlink(missing_ok=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if Path(result["source"]).resolve() != Path(source).resolve():
        raise RuntimeError(f"the merge ran {result['source']}'s code, not {source}'s")
    return result


def summarize(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize_runs(runs: list[dict]) -> dict:
    out = {key: summarize([x[key] for x in runs]) for key in ("cpu_s", "user_s", "sys_s", "peak_rss_mb")}
    out["events_per_s_cpu"] = summarize([x["events"] / x["cpu_s"] for x in runs])
    out["events_per_s_user"] = summarize([x["events"] / x["user_s"] for x in runs])
    out["events_per_s_wall"] = summarize([x["events"] / x["wall_s"] for x in runs])
    out["peak_window_rows"] = runs[0]["peak_window_rows"]
    out["json_bytes_per_event"] = runs[0]["out_bytes"] / runs[0]["events"]
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--events", type=int, default=10_000_000, help="events of the long trace (short: a quarter)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--baseline", type=Path, default=None, help="another source tree to interleave with this one")
    return p


def main() -> None:
    from scan_simulation import SimulatedJob, write_repeated_job

    parser = build_parser()
    args = parser.parse_args()
    scan_dir = (args.baseline or ROOT) / "megatronapp" / "scan"
    if args.baseline is not None and not any((scan_dir / p).is_file() for p in ("merge/merge.py", "merge.py")):
        parser.error(f"--baseline {args.baseline}: no megatronapp/scan/merge/merge.py there")
    sources = {"this": ROOT, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    job = SimulatedJob(tp_size=2, pp_size=4, dp_size=8, num_microbatches=8, seed=5)
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="scan_merge_scale.") as tmp:
        dirs = {}
        for label, events in (("short", args.events // 4), ("long", args.events)):
            per_iteration = write_repeated_job(job, Path(tmp) / "probe", 1)
            shutil.rmtree(Path(tmp) / "probe")
            d = Path(tmp) / label
            d.mkdir()
            t0 = time.perf_counter()
            written = write_repeated_job(job, d, max(1, events // per_iteration), iterations_per_batch=100)
            size = sum(p.stat().st_size for p in d.glob("rank*.mscan"))
            results[label] = {
                "events": written,
                "ranks": job.world_size,
                "trace_bytes_per_event": size / written,
                "write_s": time.perf_counter() - t0,
                "runs": {name: [] for name in sources},
            }
            dirs[label] = d
        for k in range(args.repeats):  # interleaved: lengths, and trees in alternating order
            for label, d in dirs.items():
                for name in list(sources) if k % 2 == 0 else list(sources)[::-1]:
                    results[label]["runs"][name].append(run_merge(d, Path(tmp) / "timeline.json", sources[name]))
    for r in results.values():
        r.update({name: summarize_runs(runs) for name, runs in r.pop("runs").items()})
        if args.baseline:
            r["cpu_time_ratio"] = r["baseline"]["cpu_s"]["median"] / r["this"]["cpu_s"]["median"]
            r["user_time_ratio"] = r["baseline"]["user_s"]["median"] / r["this"]["user_s"]["median"]
    print(json.dumps(results, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
