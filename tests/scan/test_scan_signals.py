"""Measured causes in the recorder: each span's thread CPU time, and on each iteration's span
what the operating system took from the training thread (run-queue delay, involuntary switches,
cgroup CPU throttling). Each test fails without its signal."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from megatronapp.faultlab.cpu import CpuQuota, cgroup_flavour, start_busy_loop, stop_process
from megatronapp.scan.record.format import load_rank_trace
from megatronapp.scan.record.sched import counter_deltas, find_cpu_stat, parse_cpu_stat
from megatronapp.scan.record.tracer import TraceConfig, Tracer

META = {
    "rank": 0,
    "world_size": 1,
    "coords": {"tp": 0, "dp": 0, "pp": 0},
    "layout": {"tp_size": 1, "pp_size": 1, "dp_size": 1, "virtual_pp_size": 1},
    "run_id": "t",
}


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _burn_cpu(seconds: float) -> None:
    """Compute until this thread has had `seconds` of CPU (more wall time if it is descheduled)."""
    end = time.thread_time_ns() + int(seconds * 1e9)
    while time.thread_time_ns() < end:
        pass


def _trace_one_iteration(tmp_path, body) -> dict[str, dict]:
    """Rows by span name of iteration 1 traced around `body(tracer)`."""
    with Tracer(TraceConfig(enabled=True, trace_dir=str(tmp_path)), META) as tracer:
        tracer.step_begin(1)
        body(tracer)
        tracer.step_end(1)
    return {row["name"]: row for row in load_rank_trace(tracer.path).events.to_pylist()}


def test_span_cpu_time_tells_a_wait_from_work(tmp_path):
    measured = {}

    def body(tracer):
        with tracer.span("wait"):
            time.sleep(0.08)
        before = time.thread_time_ns()
        with tracer.span("work"):
            _burn_cpu(0.05)
        measured["work"] = time.thread_time_ns() - before

    rows = _trace_one_iteration(tmp_path, body)
    wait, work = rows["wait"], rows["work"]
    assert wait["cpu_ns"] < 0.2 * (wait["end_ns"] - wait["start_ns"])
    # The work span holds 50 ms of this thread's CPU: all of it is counted, and no more than the
    # wall time (equal on an idle core; less where other processes take turns on it).
    assert 50_000_000 <= work["cpu_ns"] <= min(measured["work"], work["end_ns"] - work["start_ns"])
    assert work["cpu_ns"] > 10 * wait["cpu_ns"]
    assert rows["iteration"]["cpu_ns"] >= work["cpu_ns"]


def test_a_span_closed_by_another_thread_has_unknown_cpu_time(tmp_path):
    import threading

    def body(tracer):
        span = tracer.record_comm("all_reduce", group="g", seq=0)
        closer = threading.Thread(target=span.finish)
        closer.start()
        closer.join()

    assert _trace_one_iteration(tmp_path, body)["all_reduce"]["cpu_ns"] == -1


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity (Linux)")
def test_run_delay_of_a_thread_sharing_its_core_with_a_busy_process(tmp_path):
    core = min(os.sched_getaffinity(0))
    saved = os.sched_getaffinity(0)
    loop = start_busy_loop(core)
    try:
        os.sched_setaffinity(0, {core})  # this thread only: the writer thread keeps its mask
        time.sleep(0.2)  # the loop is spinning by now
        rows = _trace_one_iteration(tmp_path, lambda tracer: _spin(0.3))
    finally:
        os.sched_setaffinity(0, saved)
        stop_process(loop)
    iteration = rows["iteration"]
    # Two runnable threads on one core: the scheduler runs each about half the time.
    assert iteration["run_delay_ns"] > 0.1 * (iteration["end_ns"] - iteration["start_ns"])
    assert iteration["involuntary_switches"] > 0
    assert rows["iteration"]["cpu_ns"] < 0.9 * (iteration["end_ns"] - iteration["start_ns"])


_CHILD = textwrap.dedent(
    """
    import sys, time
    from megatronapp.scan.record.tracer import TraceConfig, Tracer
    meta = {"rank": 0, "world_size": 1, "coords": {"tp": 0, "dp": 0, "pp": 0},
            "layout": {"tp_size": 1, "pp_size": 1, "dp_size": 1, "virtual_pp_size": 1}, "run_id": "t"}
    with Tracer(TraceConfig(enabled=True, trace_dir=sys.argv[1]), meta) as tracer:
        print("ready", flush=True)
        sys.stdin.readline()  # the parent has applied (or not) the quota
        for it in (1, 2):
            tracer.step_begin(it)
            end = time.monotonic() + 0.4
            while time.monotonic() < end:
                pass
            tracer.step_end(it)
    """
)


def _traced_child_iterations(trace_dir, quota_share: float | None) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(trace_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        if quota_share is None:
            child.stdin.write("go\n")
            child.stdin.flush()
            assert child.wait(timeout=60) == 0
        else:
            with CpuQuota(f"signals-{os.getpid()}", [child.pid], quota_share):
                child.stdin.write("go\n")
                child.stdin.flush()
                assert child.wait(timeout=60) == 0
    finally:
        if child.poll() is None:
            child.kill()
    rows = load_rank_trace(trace_dir / "rank00000.mscan").events.to_pylist()
    return [r for r in rows if r["name"] == "iteration"]


@pytest.mark.skipif(cgroup_flavour() is None, reason="needs a writable cgroup with the cpu controller (root)")
def test_cgroup_throttled_time_under_a_cpu_quota_and_none_without(tmp_path):
    throttled = _traced_child_iterations(tmp_path / "quota", quota_share=0.2)
    clean = _traced_child_iterations(tmp_path / "clean", quota_share=None)
    assert len(throttled) == len(clean) == 2
    # 20% of a core: the child runs out of its 20 ms in every 100 ms period and is throttled.
    assert all(r["throttled_ns"] > 0 and r["nr_throttled"] > 0 for r in throttled), throttled
    assert all(r["throttled_ns"] == 0 and r["nr_throttled"] == 0 for r in clean)


def test_find_cpu_stat_of_v1_and_v2_hierarchies(tmp_path):
    v1 = tmp_path / "cpu" / "job"
    v1.mkdir(parents=True)
    (v1 / "cpu.stat").write_text("nr_periods 9\nnr_throttled 4\nthrottled_time 5000\n")
    mountinfo = f"30 25 0:26 / {tmp_path / 'cpu'} rw,relatime shared:9 - cgroup cgroup rw,cpu\n"
    assert find_cpu_stat("4:cpu:/job\n0::/\n", mountinfo) == ("v1", v1 / "cpu.stat")
    v2 = tmp_path / "unified" / "job"
    v2.mkdir(parents=True)
    (v2 / "cpu.stat").write_text("usage_usec 10\nnr_throttled 2\nthrottled_usec 7\n")
    mountinfo = f"30 25 0:26 / {tmp_path / 'unified'} rw,relatime - cgroup2 cgroup2 rw\n"
    assert find_cpu_stat("0::/job\n", mountinfo) == ("v2", v2 / "cpu.stat")
    assert parse_cpu_stat((v2 / "cpu.stat").read_bytes(), "v2") == (7000, 2)
    assert parse_cpu_stat((v1 / "cpu.stat").read_bytes(), "v1") == (5000, 4)
    assert find_cpu_stat("0::/job\n", "") is None


def test_counter_deltas_unknown_across_a_cgroup_move():
    assert counter_deltas((10, 1, 100, 2, 1), (25, 3, 400, 5, 1)) == (15, 2, 300, 3)
    assert counter_deltas((10, 1, 100, 2, 1), (25, 3, 400, 5, 2)) == (15, 2, -1, -1)
    assert counter_deltas((-1, 1, -1, -1, 1), (-1, 3, -1, -1, 1)) == (-1, 2, -1, -1)


def _trace_two_iterations(trace_dir) -> None:
    with Tracer(TraceConfig(enabled=True, trace_dir=str(trace_dir)), META) as tracer:
        for it in (1, 2):
            with tracer.step(it), tracer.span("forward"):
                _burn_cpu(0.005)


def test_merged_timeline_carries_signals_as_args_and_counter_tracks(tmp_path):
    import json

    from megatronapp.scan.merge.merge import merge_traces

    _trace_two_iterations(tmp_path)
    merge_traces(tmp_path, tmp_path / "timeline.json")
    events = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    iterations = [e for e in events if e.get("ph") == "X" and e["name"] == "iteration"]
    assert len(iterations) == 2
    assert all({"cpu_ns", "run_delay_ns", "involuntary_switches"} <= e["args"].keys() for e in iterations)
    forward = next(e for e in events if e.get("ph") == "X" and e["name"] == "forward")
    assert forward["args"]["cpu_ns"] >= 5_000_000 and "run_delay_ns" not in forward["args"]
    counters = [e for e in events if e.get("ph") == "C"]
    assert {e["name"] for e in counters} >= {"run delay ms"} and len(counters) >= 4
    assert all(e["pid"] == 0 and "ms" in e["args"] for e in counters)


def _write_version_1_file(path, meta: dict) -> None:
    """A rank file as the recorder wrote it before the signal columns existed."""
    import json

    import pyarrow as pa

    from megatronapp.scan.record.format import EVENT_SCHEMA, META_FIELD, SIGNAL_COLUMNS, build_event_batch

    old = pa.schema([f for f in EVENT_SCHEMA if f.name not in SIGNAL_COLUMNS])
    old = old.with_metadata({META_FIELD: json.dumps({**meta, "schema_version": 1}).encode()})
    rows = [{"name": "iteration", "cat": "step", "start_ns": 1000, "end_ns": 9000, "iteration": 1}]
    batch = build_event_batch(rows)
    batch = pa.RecordBatch.from_arrays([batch.column(f.name) for f in old], schema=old)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, old) as writer:
        writer.write_batch(batch)


def test_version_1_files_still_load_and_merge(tmp_path):
    from megatronapp.scan.merge.merge import merge_traces
    from megatronapp.scan.record.format import build_rank_meta

    meta = build_rank_meta(
        rank=0, world_size=1, coords=META["coords"], layout=META["layout"], host="h", device="cpu", run_id="t",
        clock="monotonic",
    )  # fmt: skip
    _write_version_1_file(tmp_path / "rank00000.mscan", meta)
    trace = load_rank_trace(tmp_path / "rank00000.mscan")
    assert trace.meta["schema_version"] == 1 and not trace.partial
    row = trace.events.to_pylist()[0]
    assert row["end_ns"] == 9000 and row["cpu_ns"] == row["run_delay_ns"] == row["throttled_ns"] == -1
    summary = merge_traces(tmp_path, tmp_path / "timeline.json")
    assert summary.events == 1
