"""MegaScan tracer and torch.distributed instrumentation (one process; multi-rank runs are
in test_scan_merge.py)."""

from __future__ import annotations

import os
import time
import tracemalloc
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from megatronapp.scan.record.format import load_rank_trace
from megatronapp.scan.record.instrument import (
    TracedWork,
    install_distributed_instrumentation,
    uninstall_distributed_instrumentation,
)
from megatronapp.scan.record.tracer import NOOP_SPAN, TraceConfig, Tracer

META = {
    "rank": 0,
    "world_size": 1,
    "coords": {"tp": 0, "dp": 0, "pp": 0},
    "layout": {"tp_size": 1, "pp_size": 1, "dp_size": 1, "virtual_pp_size": 1},
    "run_id": "t",
}


def rows_of(tracer: Tracer) -> list[dict]:
    return load_rank_trace(tracer.path).events.to_pylist()


def wait_for_rows(tracer: Tracer, done, timeout: float = 5.0) -> list[dict]:
    """Rows of a tracer's still-open file once `done(rows)` holds (the writer is a thread)."""
    deadline = time.monotonic() + timeout
    while True:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an open stream has no end-of-stream marker yet
            rows = rows_of(tracer)
        if done(rows) or time.monotonic() > deadline:
            return rows
        time.sleep(0.01)


def run_iterations(tracer: Tracer, iterations, body) -> None:
    for it in iterations:
        tracer.step_begin(it)
        body(tracer, it)
        tracer.step_end(it)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"interval": 0}, "interval must be >= 1"),
        ({"interval": 4, "continuous_iterations": 5}, "continuous_iterations must be in 1..interval"),
        ({"continuous_iterations": 0}, "continuous_iterations"),
        ({"granularity": "layers"}, "granularity must be one of"),
        ({"enabled": True, "trace_dir": ""}, "trace_dir is empty"),
    ],
)
def test_config_rejects_unusable_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TraceConfig(**kwargs)


@pytest.mark.parametrize("interval, k", [(1, 1), (5, 2), (4, 4), (10, 3)])
def test_should_trace_takes_k_consecutive_iterations_every_interval(interval, k):
    config = TraceConfig(enabled=True, trace_dir="x", interval=interval, continuous_iterations=k)
    windows = {start + j for start in range(interval, 60, interval) for j in range(k)}
    assert {i for i in range(60) if config.should_trace(i)} == {i for i in windows if i < 60}
    assert not TraceConfig(interval=interval, continuous_iterations=k).should_trace(interval)


def test_disabled_tracer_is_inert_and_writes_nothing(tmp_path):
    tracer = Tracer(TraceConfig(enabled=False, trace_dir=str(tmp_path)), META)
    tracer.step_begin(100)
    assert tracer.span("forward", chunk=1) is NOOP_SPAN
    assert tracer.context(microbatch=2) is NOOP_SPAN and tracer.layer_span("mlp", 3) is NOOP_SPAN
    assert tracer.record_comm("all_reduce", group="g", seq=0) is NOOP_SPAN
    tracer.step_end(100)
    tracer.close()
    assert list(tmp_path.iterdir()) == []
    original = dist.all_reduce
    assert install_distributed_instrumentation(tracer) is None and dist.all_reduce is original


def test_untraced_iteration_spans_are_one_shared_object_and_retain_nothing(tmp_path):
    tracer = Tracer(TraceConfig(enabled=True, trace_dir=str(tmp_path), interval=1000), META)
    tracer.step_begin(3)  # not traced
    assert tracer.span("forward") is tracer.span("backward", chunk=1) is NOOP_SPAN

    def loop(n: int) -> None:
        for _ in range(n):
            with tracer.span("forward"):
                pass

    loop(2_000)  # one-time interpreter caches are not the tracer's
    wait_for_rows(tracer, lambda rows: len(rows) == 1)  # the writer thread is idle again
    tracemalloc.start()
    try:
        loop(20_000)
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    tracer.step_end(3)
    tracer.close()
    # 20k spans: a per-span record of even 8 bytes would show up as >= 160 kB.
    assert current < 1024 and peak < 16_384, (current, peak)
    assert [r["cat"] for r in rows_of(tracer)] == ["calib"]


def nested_body(tracer: Tracer, it: int) -> None:
    for mb in range(2):
        with tracer.context(chunk=0, microbatch=mb), tracer.span("forward"):
            with tracer.layer_span("attention", layer=1):
                time.sleep(0.0005)
            tracer.record_comm("all_reduce", group="7:[0,1]", seq=10 * it + mb, bytes=256).finish()
    with tracer.span("optimizer"):
        pass


@pytest.mark.parametrize("granularity", ["base", "full"])
def test_spans_nest_inherit_context_and_follow_granularity(tmp_path, granularity):
    config = TraceConfig(
        enabled=True, trace_dir=str(tmp_path), interval=4, continuous_iterations=2, granularity=granularity
    )
    with Tracer(config, META) as tracer:
        run_iterations(tracer, range(1, 7), nested_body)
    rows = [r for r in rows_of(tracer) if r["cat"] != "calib"]
    assert {r["iteration"] for r in rows} == {4, 5}
    per_iter = 1 + 2 * (2 + (granularity == "full")) + 1  # iteration, 2 x (forward, comm[, attention]), optimizer
    assert len(rows) == 2 * per_iter
    comms = [r for r in rows if r["cat"] == "comm"]
    assert [(r["iteration"], r["microbatch"], r["chunk"], r["seq"]) for r in comms] == [
        (it, mb, 0, 10 * it + mb) for it in (4, 5) for mb in range(2)
    ]
    assert all(r["op"] == "all_reduce" and r["group"] == "7:[0,1]" and r["bytes"] == 256 for r in comms)
    optimizer = [r for r in rows if r["name"] == "optimizer"]
    assert all(r["microbatch"] == -1 and r["chunk"] == -1 for r in optimizer)  # context was left
    layers = [r for r in rows if r["name"] == "attention"]
    assert len(layers) == (4 if granularity == "full" else 0) and all(r["layer"] == 1 for r in layers)
    steps = {r["iteration"]: r for r in rows if r["cat"] == "step"}
    for r in rows:
        assert r["end_ns"] >= r["start_ns"]
        step = steps[r["iteration"]]
        assert step["start_ns"] <= r["start_ns"] and r["end_ns"] <= step["end_ns"]


def test_adjacent_layer_spans_share_a_mark_and_keep_their_attributes(tmp_path):
    config = TraceConfig(enabled=True, trace_dir=str(tmp_path), interval=1, granularity="full")

    def body(tracer: Tracer, it: int) -> None:
        with tracer.context(chunk=1, microbatch=it):
            with tracer.layer_span("attention", 3) as attention:
                time.sleep(0.001)
            with tracer.layer_span("mlp", 3, after=attention):
                time.sleep(0.001)
            with tracer.layer_span("mlp", 4, after=stale[0] if stale else None, op="x"):
                pass
            stale[:] = [attention]

    stale: list = []
    with Tracer(config, META) as tracer:
        run_iterations(tracer, range(1, 3), body)
    rows = [r for r in rows_of(tracer) if r["cat"] == "compute"]
    assert [(r["name"], r["layer"], r["chunk"], r["microbatch"], r["op"]) for r in rows] == [
        ("attention", 3, 1, 1, ""),
        ("mlp", 3, 1, 1, ""),
        ("mlp", 4, 1, 1, "x"),
        ("attention", 3, 1, 2, ""),
        ("mlp", 3, 1, 2, ""),
        ("mlp", 4, 1, 2, "x"),
    ]
    for it in (0, 3):
        attention, mlp, other = rows[it : it + 3]
        assert mlp["start_ns"] == attention["end_ns"]  # the shared mark
        assert mlp["end_ns"] - mlp["start_ns"] >= 1_000_000
        # `after` from another iteration (iteration 2's layer 4) or none: a mark of its own
        assert other["start_ns"] >= mlp["end_ns"]


def test_cuda_clock_pools_a_shared_mark_once():
    from types import SimpleNamespace

    from megatronapp.scan.record.clocks import CudaClock

    a, b = object(), object()
    clock = SimpleNamespace(_pool=[])
    CudaClock.release(clock, [a, b, b, a])  # records (a, b), (b, a): two spans sharing both ends
    assert clock._pool == [a, b]


def test_writer_converts_a_shared_mark_once():
    from megatronapp.scan.record.trace_writer import ATTR_DEFAULTS, build_window_batch

    class CountingClock:  # as CudaClock: markers are objects, converting one is a driver call
        def __init__(self):
            self.calls, self.ns = [], {}

        def to_ns(self, marker):
            self.calls.append(marker)
            return self.ns.setdefault(marker, 1000 * (len(self.ns) + 1))

        def release(self, markers):
            pass

    a, b, c = object(), object(), object()
    records = [
        ("attention", "compute", a, b, 1, ATTR_DEFAULTS, -1, None),
        ("mlp", "compute", b, c, 1, ATTR_DEFAULTS, -1, None),
    ]
    clock = CountingClock()
    batch = build_window_batch(records, clock, []).to_pydict()
    assert clock.calls == [a, b, c]  # b once, although two spans hold it
    assert batch["start_ns"] == [1000, 2000] and batch["end_ns"] == [2000, 3000]


def test_wait_writer_idle_returns_once_handed_windows_are_on_disk(tmp_path, monkeypatch):
    from megatronapp.scan.record import trace_writer

    config = TraceConfig(enabled=True, trace_dir=str(tmp_path), interval=1, flush_seconds=0.0)
    tracer = Tracer(config, META)
    slow_build = trace_writer.build_window_batch

    def build_slowly(*args):  # a writer well behind the training thread
        time.sleep(0.3)
        return slow_build(*args)

    monkeypatch.setattr(trace_writer, "build_window_batch", build_slowly)
    run_iterations(tracer, range(1, 3), nested_body)  # two windows handed over
    tracer.wait_writer_idle()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # still open: no end-of-stream marker
        rows = rows_of(tracer)
    assert {r["iteration"] for r in rows if r["cat"] != "calib"} == {1, 2}  # no polling needed

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(trace_writer, "build_window_batch", fail)
    run_iterations(tracer, [3], nested_body)
    with pytest.warns(UserWarning, match="disk full"):
        tracer.wait_writer_idle()  # a failed window does not leave it waiting
    with pytest.raises(RuntimeError, match="could not write"):
        tracer.close()


def test_window_is_written_before_close_with_calibration(tmp_path):
    skew = 1_000_000_000_000  # 1000 s, far beyond any real gap between the clocks read
    config = TraceConfig(
        enabled=True,
        trace_dir=str(tmp_path),
        interval=2,
        continuous_iterations=1,
        clock_skew_ns=skew,
        flush_seconds=0.0,
    )
    tracer = Tracer(config, META)
    run_iterations(tracer, range(1, 3), nested_body)  # window [2] ends at step_end(2)
    with pytest.warns(UserWarning, match="end-of-stream"):
        load_rank_trace(tracer.path)  # still open: readable, flagged partial
    rows = wait_for_rows(tracer, lambda rows: any(r["iteration"] == 2 for r in rows))
    assert any(r["iteration"] == 2 for r in rows), "background writer did not flush the window"
    run_iterations(tracer, range(3, 5), nested_body)
    tracer.close()
    rows = rows_of(tracer)
    calib = [r for r in rows if r["cat"] == "calib"]
    assert len(calib) == 1 + 2  # start + one per traced window (iterations 2 and 4)
    now_mono, now_wall = time.monotonic_ns() + skew, time.time_ns() + skew
    for r in calib:
        assert 0 <= now_mono - r["start_ns"] < 60e9 and 0 <= now_wall - r["end_ns"] < 60e9
    spans = [r for r in rows if r["cat"] != "calib"]
    assert all(0 <= now_mono - r["start_ns"] < 60e9 for r in spans)
    assert calib[0]["start_ns"] < min(r["start_ns"] for r in spans)


def test_misuse_is_reported(tmp_path):
    with Tracer(TraceConfig(enabled=True, trace_dir=str(tmp_path), interval=1), META) as tracer:
        tracer.step_begin(1)
        with pytest.raises(TypeError, match="unknown span attributes"):
            tracer.span("forward", micro_batch=1)
        with pytest.raises(ValueError, match="span category"):
            tracer.span("clock", cat="calib")
        with pytest.raises(ValueError, match=r"step_end\(2\)"):
            tracer.step_end(2)
        tracer.step_end(1)
        with tracer.step(2), tracer.span("loss", cat="user"):
            pass
    names = [(r["name"], r["iteration"]) for r in rows_of(tracer) if r["cat"] != "calib"]
    assert sorted(names) == [("iteration", 1), ("iteration", 2), ("loss", 2)]


@pytest.fixture
def gloo_world_of_one(tmp_path):
    store = dist.FileStore(os.path.join(tmp_path, "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    uninstall_distributed_instrumentation()
    dist.destroy_process_group()


def test_instrumentation_counts_always_records_when_traced(tmp_path, gloo_world_of_one):
    config = TraceConfig(enabled=True, trace_dir=str(tmp_path), interval=2, continuous_iterations=1)
    tracer = Tracer(config, META)
    originals = {name: getattr(dist, name) for name in ("all_reduce", "isend", "batch_isend_irecv")}
    instrumentation = install_distributed_instrumentation(tracer)
    with pytest.raises(RuntimeError, match="already installed"):
        install_distributed_instrumentation(tracer)
    assert dist.all_reduce is c10d.all_reduce and dist.all_reduce is not originals["all_reduce"]
    works = {}

    def body(tracer: Tracer, it: int) -> None:
        dist.all_reduce(torch.ones(8))  # 32 bytes
        out = torch.zeros(4)
        gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather_single(out, torch.ones(4))
        work = dist.all_reduce(torch.ones(2), async_op=True)
        works[it] = work
        time.sleep(0.05)
        work.wait()
        dist.barrier()

    run_iterations(tracer, range(1, 3), body)
    instrumentation.uninstall()
    tracer.close()
    assert all(getattr(dist, n) is f and getattr(c10d, n) is f for n, f in originals.items())
    assert not isinstance(works[1], TracedWork) and isinstance(works[2], TracedWork)
    comms = [r for r in rows_of(tracer) if r["cat"] == "comm"]
    assert [r["op"] for r in comms] == ["all_reduce", "all_gather", "all_reduce", "barrier"]
    # 4 collectives per iteration on the world group; iteration 1 was counted, not recorded.
    assert [r["seq"] for r in comms] == [4, 5, 6, 7]
    assert {r["group"] for r in comms} == {"0:[0]"} and all(r["iteration"] == 2 for r in comms)
    assert [r["bytes"] for r in comms[:3]] == [32, 16, 8]
    async_span = comms[2]
    assert async_span["end_ns"] - async_span["start_ns"] >= 50_000_000  # ended at wait(), not at issue


def test_module_level_uninstall_restores_torch(tmp_path, gloo_world_of_one):
    original = c10d.barrier
    tracer = Tracer(TraceConfig(enabled=True, trace_dir=str(tmp_path)), META)
    install_distributed_instrumentation(tracer)
    assert c10d.barrier is not original
    assert uninstall_distributed_instrumentation() is True
    assert c10d.barrier is original and dist.barrier is original
    assert uninstall_distributed_instrumentation() is False
    tracer.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_spans_use_events_on_one_device_timeline(tmp_path):
    config = TraceConfig(enabled=True, trace_dir=str(tmp_path), interval=1, continuous_iterations=1)
    a = torch.randn(2048, 2048, device="cuda")

    def body(tracer: Tracer, it: int) -> None:
        with tracer.span("forward"):
            for layer in range(3):
                with tracer.layer_span("mlp", layer=layer):
                    a @ a

    with Tracer(config, {**META, "device": "gpu"}, device="cuda") as tracer:
        assert tracer.meta["clock"] == "cuda"
        run_iterations(tracer, range(1, 4), body)
    rows = [r for r in rows_of(tracer) if r["cat"] != "calib"]
    assert len(rows) == 3 * (1 + 1)
    forwards = [r for r in rows if r["name"] == "forward"]
    assert all(r["end_ns"] - r["start_ns"] > 0 for r in forwards)
    starts = [r["start_ns"] for r in forwards]
    assert starts == sorted(starts)


def test_windows_are_batched_until_flush_seconds(tmp_path):
    config = TraceConfig(enabled=True, trace_dir=str(tmp_path), interval=1, flush_seconds=3600.0)
    tracer = Tracer(config, META)
    run_iterations(tracer, range(1, 4), nested_body)
    time.sleep(0.2)
    with pytest.warns(UserWarning, match="end-of-stream"):
        early = load_rank_trace(tracer.path).events.num_rows
    tracer.close()
    assert early <= 1  # at most the start-of-run calibration row
    assert {r["iteration"] for r in rows_of(tracer) if r["cat"] == "step"} == {1, 2, 3}


def test_writer_accounts_each_batch_it_writes(tmp_path):
    config = TraceConfig(enabled=True, trace_dir=str(tmp_path), interval=2, continuous_iterations=1, flush_seconds=0.0)
    tracer = Tracer(config, META)
    run_iterations(tracer, range(1, 7), nested_body)  # windows [2], [4], [6]
    tracer.close()
    spans = [r for r in rows_of(tracer) if r["cat"] != "calib"]
    cost = tracer.writer_cost
    first_window = sum(1 for r in spans if r["iteration"] == 2)
    assert cost.batches == 3 and cost.later_records == len(spans) - first_window
    assert cost.first_batch_s > 0 and cost.later_s > 0
    assert cost.total_s == pytest.approx(cost.first_batch_s + cost.later_s)


def test_traced_work_runs_wait_hooks_after_completion_before_span_end():
    order = []

    class FakeWork:
        def wait(self):
            order.append("transfer")
            return True

    work = TracedWork(FakeWork(), lambda: order.append("span end"))
    work.add_wait_hook(lambda: order.append("hook"))
    assert work.wait() is True
    assert order == ["transfer", "hook", "span end"]


def test_writer_queue_is_bounded_drops_and_counts_without_blocking(tmp_path, monkeypatch):
    """A stalled writer (slow disk): steps go on at full speed, windows past the bound are
    dropped and counted, what was queued is still written at close."""
    import threading

    from megatronapp.scan.record.format import TraceWriter

    release, appended = threading.Event(), []
    original_append = TraceWriter.append

    def stalled_append(self, rows):
        release.wait(timeout=30)  # a training thread blocked on the full queue waits this out
        original_append(self, rows)
        appended.append(len(rows))

    monkeypatch.setattr(TraceWriter, "append", stalled_append)
    config = TraceConfig(enabled=True, trace_dir=str(tmp_path), interval=1, flush_seconds=0.0, max_pending_windows=2)
    tracer = Tracer(config, META)
    run_iterations(tracer, range(1, 9), nested_body)  # 8 windows; the writer holds 1, the queue 2
    assert appended == [], "a full writer queue blocked the training thread until the writer moved"
    release.set()
    with pytest.warns(UserWarning, match=r"dropped \d+ events \(\d+ windows\)"):
        tracer.close()
    steps = {r["iteration"] for r in rows_of(tracer) if r["cat"] == "step"}
    per_window = sum(1 for r in rows_of(tracer) if r["cat"] != "calib") // len(steps)
    assert 1 <= len(steps) <= 3 and tracer.dropped_events == (8 - len(steps)) * per_window
    with pytest.raises(ValueError, match="max_pending_windows"):
        TraceConfig(max_pending_windows=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_marks_follow_the_current_stream(tmp_path):
    """A span opened under a side stream times that stream's work, not the default stream's."""
    config = TraceConfig(enabled=True, trace_dir=str(tmp_path), interval=1, continuous_iterations=1)
    a = torch.randn(4096, 4096, device="cuda")
    side = torch.cuda.Stream()

    def body(tracer: Tracer, it: int) -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), tracer.span("side_work"):
            for _ in range(8):
                a @ a
        torch.cuda.current_stream().wait_stream(side)
        with tracer.span("default_empty"):
            pass

    with Tracer(config, {**META, "device": "gpu"}, device="cuda") as tracer:
        run_iterations(tracer, range(1, 3), body)
    rows = [r for r in rows_of(tracer) if r["cat"] != "calib"]
    side_ns = [r["end_ns"] - r["start_ns"] for r in rows if r["name"] == "side_work"]
    empty_ns = [r["end_ns"] - r["start_ns"] for r in rows if r["name"] == "default_empty"]
    assert len(side_ns) == 2 and min(side_ns) > 1_000_000  # 8 GEMMs of 4096^3: well over 1 ms
    assert max(empty_ns) < min(side_ns) / 10


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_clock_converts_a_mark_the_gpu_has_not_reached(tmp_path):
    """to_ns of a mark still behind queued GPU work waits for it instead of failing, and the
    window's marks come out in the order the GPU passed them."""
    from megatronapp.scan.record.clocks import CudaClock

    clock = CudaClock("cuda", 0)
    a = torch.randn(4096, 4096, device="cuda")
    first = clock.mark()
    for _ in range(16):
        a @ a
    last = clock.mark()
    assert not last.query(), "the GEMMs should still be running"
    later, earlier = clock.to_ns(last), clock.to_ns(first)
    assert later - earlier > 1_000_000
    clock.wait_recorded([first, last])
    assert last.query()
