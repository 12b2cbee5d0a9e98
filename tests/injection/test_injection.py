"""Fault injection: specs (flags and environment), intermittent slowdowns, and a slow link that
delays arrival only (2 gloo ranks, traced and untraced)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megatronapp.injection.inject import (
    FaultInjector,
    FaultPlan,
    FaultSpecError,
    LinkDelay,
    Slowdown,
    fault_env,
    fault_plan_from_env,
    parse_fault_plan,
)
from megatronapp.pipeline.runtime import NullInjector

DELAY_MS = 60


def test_specs_parse_with_optional_fields_and_from_the_environment():
    plan = parse_fault_plan(["1:2", "3:1.5:4"], ["0:1:20", "2:3:30:5"])
    assert plan.slowdowns == {1: Slowdown(2.0, 1), 3: Slowdown(1.5, 4)}
    assert plan.link_delays == {(0, 1): LinkDelay(20.0), (2, 3): LinkDelay(30.0, 5.0)}
    assert fault_plan_from_env(fault_env(["1:2", "3:1.5:4"], ["0:1:20", "2:3:30:5"])) == plan
    assert fault_plan_from_env({}).empty
    assert FaultPlan({0: 2.0}, {(0, 1): 5}).slowdowns[0] == Slowdown(2.0)


@pytest.mark.parametrize(
    "slow, links, message",
    [
        (["1"], [], "RANK:FACTOR[:EVERY]"),
        (["1:2:3:4"], [], "RANK:FACTOR[:EVERY]"),
        ([], ["0:1"], "SRC:DST:MS[:JITTER]"),
        ([], ["0:1:x"], "SRC:DST:MS[:JITTER]"),
    ],
)
def test_bad_specs_are_one_line_errors(slow, links, message):
    with pytest.raises(FaultSpecError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_fault_plan(slow, links)


@pytest.mark.parametrize(
    "slow, links, message",
    [
        (["4:2"], [], "outside world size 4"),
        (["1:0.5"], [], "factor must be >= 1"),
        (["1:2:0"], [], "EVERY must be >= 1"),
        ([], ["1:1:5"], "not a link"),
        ([], ["0:1:5:9"], "0 <= JITTER <= MS"),
    ],
)
def test_plans_are_checked_against_the_world(slow, links, message):
    with pytest.raises(FaultSpecError, match=message):
        parse_fault_plan(slow, links).check(4)


def _compute(injector: FaultInjector) -> None:
    with injector.compute():
        # This thread's CPU, as the injector measures it: other threads left by earlier tests
        # (gloo workers, a trace writer) would make process time run ahead of it.
        end = time.thread_time() + 0.01
        while time.thread_time() < end:  # 10 ms of this thread's CPU work
            pass


def test_intermittent_slowdown_applies_every_nth_iteration_only(monkeypatch):
    stalls, slept = {}, []
    monkeypatch.setattr("megatronapp.injection.inject.time.sleep", slept.append)
    for rank in (0, 1):
        injector = FaultInjector(parse_fault_plan(["0:3:2"], []), rank=rank, device=torch.device("cpu"))
        for it in range(4):
            injector.set_iteration(it)
            before = len(slept)
            _compute(injector)
            if len(slept) > before:
                stalls[(rank, it)] = slept[-1]
    assert sorted(stalls) == [(0, 0), (0, 2)]  # rank 0, iterations 0 and 2 only
    assert all(0.02 <= s < 0.2 for s in stalls.values())  # (3 - 1) x >= 10 ms of CPU time


class _IterationRecorder(NullInjector):
    """Records which iteration the injector believed it was in at every compute span."""

    def __init__(self):
        self.iteration, self.seen = None, []

    def set_iteration(self, iteration: int) -> None:
        self.iteration = iteration

    def compute(self, key=None):
        self.seen.append(self.iteration)
        return super().compute()


def test_the_runtime_tells_the_injector_each_iteration_even_between_log_steps():
    """An intermittent slowdown must know the iteration at every step, not only when metrics
    reach on_step (every log_interval steps): otherwise '1 in 3' slows every iteration."""
    from engine_jobs import RandomTokenBatches, make_job

    from megatronapp.engine.trainer import Trainer
    from megatronapp.parallel.groups import build_process_groups

    job = make_job(1, global_batch=2, micro_batch=1, iters=4, num_layers=2, log_interval=4)
    recorder = _IterationRecorder()
    trainer = Trainer(
        job, build_process_groups(job.layout, 0), torch.device("cpu"), RandomTokenBatches(job, 0), injector=recorder
    )
    trainer.train()
    assert recorder.seen == [it for it in range(4) for _ in range(4)]  # 2 microbatches x (forward, backward)


def test_slowdown_stretches_by_the_calling_threads_cpu_not_the_processs(monkeypatch):
    """Other threads' CPU (gloo workers, the trace writer) must not inflate the factor: a Python
    thread spinning alongside takes about half the GIL, doubling process time, not the stall."""
    slept = []
    monkeypatch.setattr("megatronapp.injection.inject.time.sleep", slept.append)
    stop = threading.Event()
    spinner = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)], daemon=True)
    injector = FaultInjector(parse_fault_plan(["0:2"], []), rank=0, device=torch.device("cpu"))
    spinner.start()
    try:
        with injector.compute():
            end = time.thread_time() + 0.05
            while time.thread_time() < end:  # 50 ms of this thread's CPU
                pass
    finally:
        stop.set()
        spinner.join()
    assert 0.05 <= slept[0] < 0.07  # (2 - 1) x 50 ms, not ~100 ms of process time


# -- a slow link between two real ranks ------------------------------------------------------------
def slow_link_job(rank: int, world_size: int, traced: bool, trace_dir: str) -> dict:
    """Rank 1 posts each recv early; rank 0 sends 4 messages 100 ms apart (more than the delay:
    gloo, like NCCL, completes a send only once its recv is posted). Returns timings."""
    import torch.distributed as dist

    from megatronapp.injection.link_delay import install_link_delays
    from megatronapp.scan.record.instrument import install_distributed_instrumentation
    from megatronapp.scan.record.tracer import TraceConfig, Tracer

    delays = install_link_delays(parse_fault_plan([], [f"0:1:{DELAY_MS}"]), rank)  # before tracing
    meta = {
        "rank": rank,
        "world_size": 2,
        "coords": {"tp": 0, "dp": 0, "pp": rank},
        "layout": {"tp_size": 1, "pp_size": 2, "dp_size": 1},
        "run_id": "t",
    }
    tracer = Tracer(TraceConfig(enabled=traced, trace_dir=trace_dir, interval=1), meta)
    instrumentation = install_distributed_instrumentation(tracer)
    out = {"send_s": [], "sent_at": [], "done_at": []}
    dist.barrier()
    for it in range(1, 5):
        tracer.step_begin(it)
        if rank == 0:
            time.sleep(0.1)
            t0 = time.monotonic()
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(8), 1)]):
                work.wait()
            out["send_s"].append(time.monotonic() - t0)
            out["sent_at"].append(t0)
        else:
            buf = torch.zeros(8)
            works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, 0)])
            for work in works:
                work.wait()
            out["done_at"].append(time.monotonic())
            assert buf.sum().item() == 8
        tracer.step_end(it)
    if instrumentation:
        instrumentation.uninstall()
    tracer.close()
    if delays:
        delays.uninstall()
    return out


@pytest.mark.parametrize("traced", [False, True])
def test_slow_link_delays_arrival_not_the_sender(cluster, tmp_path, traced):
    sender, receiver = cluster.run(slow_link_job, 2, traced, str(tmp_path))
    assert max(sender["send_s"]) < DELAY_MS / 1000 / 2  # the sender is never held up
    # one host: time.monotonic is one clock for both processes
    lateness = [done - sent for sent, done in zip(sender["sent_at"], receiver["done_at"])]
    assert min(lateness) >= DELAY_MS / 1000 * 0.95, lateness
    assert max(lateness) < DELAY_MS / 1000 + 0.5
    if traced:
        from megatronapp.scan.record.format import load_trace_dir

        rows = {t.rank: [r for r in t.events.to_pylist() if r["cat"] == "comm"] for t in load_trace_dir(tmp_path)}
        sends = [r["end_ns"] - r["start_ns"] for r in rows[0] if r["op"] == "send"]
        recvs = [r["end_ns"] - r["start_ns"] for r in rows[1] if r["op"] == "recv"]
        assert len(sends) == len(recvs) == 4
        assert max(sends) < DELAY_MS * 1e6 / 2 and min(recvs) >= DELAY_MS * 1e6 * 0.95


def test_no_detector_input_comes_from_an_injector():
    """The compute timer has no hook an injector could feed; it sees a slow span only because the
    span really took longer (a sleep here, a CPU quota in the fault lab); detection modules do not
    import the injectors at all."""
    import ast
    from pathlib import Path

    from megatronapp.pipeline.compute_timer import ComputeTimer
    from megatronapp.pipeline.runtime import StageCompute

    assert not [name for name in dir(ComputeTimer) if "stall" in name.lower()]
    injector = FaultInjector(parse_fault_plan(["0:2"], []), rank=0, device=torch.device("cpu"))
    stage = StageCompute(None, 0, 1, 1, 1, torch.device("cpu"), injector)
    timer = stage.compute_timer
    assert not [k for k, v in vars(injector).items() if v is timer or getattr(v, "__self__", None) is timer]

    timer = ComputeTimer(torch.device("cpu"))
    with timer.measure():
        time.sleep(0.02)  # a span that burns no CPU of its own: a throttled rank looks like this
    assert timer.take() >= 0.02

    analyze = Path(__file__).resolve().parents[2] / "megatronapp" / "scan" / "analyze"
    for path in analyze.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("megatronapp.injection"), f"{path.name} imports {node.module}"
