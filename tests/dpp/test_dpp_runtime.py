"""MegaDPP's dynamic runtime on real gloo ranks: same losses and gradients as one process and
as static interleaved 1F1B, for every traversal and several caps; the cap holds; random
delays never deadlock (hard timeouts); TP ranks agree; static breadth-first (looped-bfs) matches too."""

from __future__ import annotations

import contextlib
import functools
import random
import time

import pytest
import torch
from engine_jobs import RandomTokenBatches, assemble_full_grads, full_grads, make_job

from megatronapp.dpp.config import DppConfig
from megatronapp.dpp.job_hooks import build_dynamic_runtime_factory
from megatronapp.dpp.policies import TRAVERSALS
from megatronapp.dpp.scheduler import compute_default_caps
from megatronapp.engine.trainer import Trainer
from megatronapp.parallel.groups import build_process_groups
from megatronapp.pipeline.runtime import NullInjector


class RandomDelays(NullInjector):
    """Injector: every compute and every receive waits a random 0..max_ms first (seeded per rank)."""

    def __init__(self, seed: int, max_ms: float):
        self.rng, self.max_s = random.Random(seed), max_ms / 1000.0

    @contextlib.contextmanager
    def compute(self, key=None):
        time.sleep(self.rng.uniform(0.0, self.max_s))
        yield

    def before_recv_wait(self, src_global: int, work) -> None:
        time.sleep(random.uniform(0.0, self.max_s))  # receiver threads: any draw is fine


def train_variants(
    rank: int, world: int, layout: tuple, variants: list, iters: int = 2, delay_ms: float = 0.0
) -> list[dict]:
    """Train each variant (schedule, traversal, cap) `iters` steps; losses, first-step grads, counters.

    layout = (TP, PP, V, M, layers); a variant's options: "off" (sends on the compute thread),
    "separate" (payloads on a group per direction and decisions on a gloo TP copy, as on CUDA)."""
    tp, pp, vpp, m, num_layers = layout
    out = []
    for k, (schedule, traversal, cap, *opts) in enumerate(variants):
        dp = world // (tp * pp)
        job = make_job(world, tp, pp, vpp, schedule, global_batch=m * dp, iters=iters, num_layers=num_layers)
        groups = build_process_groups(job.layout, rank)
        factory = None
        if schedule == "dynamic":
            cfg = DppConfig(traversal, cap, send_thread="off" if "off" in opts else "on")
            factory = functools.partial(build_dynamic_runtime_factory(cfg, job), separate_channels="separate" in opts)
        injector = RandomDelays(1000 * k + rank, delay_ms) if delay_ms else None
        trainer = Trainer(
            job,
            groups,
            torch.device("cpu"),
            RandomTokenBatches(job, groups.dp_rank),
            injector=injector,
            runtime_factory=factory,
        )
        losses, grads = [], None
        for step in range(iters):
            losses.append(trainer.train_step().loss)
            if step == 0:
                grads = full_grads(trainer) if groups.dp_rank == 0 else {}
        counters = getattr(trainer.runtime, "counters", None)
        channels = getattr(trainer.runtime, "channels", None)
        out.append(
            {
                "losses": losses,
                "grads": grads,
                "cap": getattr(trainer.runtime, "cap", None),
                "peak": counters.peak_activations if counters else None,
                "decision_ns": counters.decision_ns if counters else [],
                "payload_pairs": sorted(channels.payload_groups) if channels else None,
            }
        )
        if channels is not None:
            trainer.runtime.close()
            assert not channels.owned
    return out


def _reference(m: int, num_layers: int, iters: int = 2) -> dict:
    torch.set_num_threads(1)
    return train_variants(0, 1, (1, 1, 1, m, num_layers), [("1f1b", None, None)], iters)[0]


def _check_against(results: list[dict], variants: list, ref: dict) -> None:
    ref_grads = {name: g for name, (g, _, _) in ref["grads"].items()}
    for i, variant in enumerate(variants):
        for rank_results in results:
            torch.testing.assert_close(
                rank_results[i]["losses"],
                ref["losses"],
                rtol=1e-5,
                atol=1e-6,
                msg=lambda msg: f"{variant} losses: {msg}",
            )
            if rank_results[i]["cap"] is not None:  # dynamic: activation sets and pending W together
                assert rank_results[i]["peak"] <= rank_results[i]["cap"], variant
        grads = assemble_full_grads([rank_results[i] for rank_results in results])
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(
                g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=lambda msg: f"{variant} {name}: {msg}"
            )


def test_dynamic_and_breadth_first_match_interleaved_and_one_process(cluster):
    pp, vpp, m = 2, 3, 4
    caps = [vpp, None, vpp * m]  # the minimum, interleaved's default, unbounded
    variants = (
        [("interleaved", None, None), ("looped-bfs", None, None)]
        + [("dynamic", t, c) for t in TRAVERSALS for c in caps if t != "in-order" or c != vpp]
        + [("dynamic", "in-order", None, "off")]
    )  # in-order: >= its peak; last: sends on the compute thread
    results = cluster.run(train_variants, pp, (1, pp, vpp, m, 6), variants)
    _check_against(results, variants, _reference(m, 6))
    for i, (schedule, _, cap, *_) in enumerate(variants):
        for rank, rank_results in enumerate(results):
            r = rank_results[i]
            if schedule == "dynamic":  # the runtime's own counters: never above the cap
                assert r["cap"] == (cap or compute_default_caps(pp, vpp, m)[rank])
                assert r["peak"] <= r["cap"]
    # the minimum cap binds: a rank held exactly V activation sets, never more
    assert max(results[0][2]["peak"], results[1][2]["peak"]) == vpp


def test_dynamic_with_tp_and_dp(cluster):
    variants = [("dynamic", "adaptive", None), ("dynamic", "depth-first", 2), ("dynamic", "in-order", None, "separate")]
    for layout in [(2, 2, 1, 4, 4), (1, 2, 2, 4, 4)]:  # TP2 x PP2 (TP agreement); PP2 x DP2 x V2
        tp, pp, vpp, m, layers = layout
        dp = 4 // (tp * pp)
        results = cluster.run(train_variants, 4, layout, variants)
        _check_against(results, variants, _reference(m * dp, layers))
        # separate channels: each rank holds the payload groups of its own directed pairs only
        for rank, rank_results in enumerate(results):
            assert rank_results[0]["payload_pairs"] == []
            pairs = rank_results[2]["payload_pairs"]
            stride = tp * dp  # ranks per pipeline stage: pp 0 <-> pp 1 of the same (tp, dp)
            peer = rank + stride if rank < stride else rank - stride
            assert pairs == sorted([(rank, peer), (peer, rank)]), (layout, rank, pairs)


DELAY_LAYOUTS = [(2, 1, 2), (2, 3, 5), (3, 2, 7), (4, 2, 4)]  # (PP, V, M)


def _delay_variants(pp: int, vpp: int, m: int, seed: int) -> list:
    rng = random.Random(seed)
    top = max(compute_default_caps(pp, vpp, m))
    variants = [("dynamic", t, None if t == "in-order" else rng.randint(vpp, max(vpp, top))) for t in TRAVERSALS]
    return variants + [("dynamic", "depth-first", rng.randint(vpp, max(vpp, top)), "separate")]  # CUDA's channels


@pytest.mark.parametrize("pp,vpp,m", DELAY_LAYOUTS)
def test_random_delays_never_deadlock(cluster, pp, vpp, m):
    variants = _delay_variants(pp, vpp, m, seed=pp * 100 + vpp * 10 + m)
    results = cluster.run(train_variants, pp, (1, pp, vpp, m, pp * vpp), variants, 1, 3.0, timeout=240)
    _check_against(results, variants, _reference(m, pp * vpp, iters=1))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_random_delays_never_deadlock_sweep(cluster, seed):
    rng = random.Random(seed)
    pp, vpp = rng.randint(2, 4), rng.randint(1, 3)
    m = rng.randint(pp, 4 * pp)
    variants = _delay_variants(pp, vpp, m, seed)
    results = cluster.run(train_variants, pp, (1, pp, vpp, m, pp * vpp), variants, 1, 2.0, timeout=400)
    _check_against(results, variants, _reference(m, pp * vpp, iters=1))


def _receive_over_slow_link(rank: int, world: int, delay_ms: float, known_spec: bool) -> dict | None:
    """Rank 0 sends RECV_AHEAD messages back to back over a link delayed by `delay_ms`; rank 1
    receives them with a PeerReceiver that knows the messages' spec or must read headers first."""
    import queue

    import torch.distributed as dist

    from megatronapp.dpp.tasks import forward_task
    from megatronapp.dpp.transport import RECV_AHEAD, PeerReceiver, send_task_message
    from megatronapp.injection.inject import FaultPlan
    from megatronapp.injection.link_delay import install_link_delays
    from megatronapp.p2p.outbox import Outbox

    delays = install_link_delays(FaultPlan(link_delays={(0, 1): delay_ms}), rank)
    shape = torch.Size((3, 5))
    try:
        dist.barrier()
        if rank == 0:
            outbox = Outbox()
            for m in range(RECV_AHEAD):
                send_task_message(outbox, 1, forward_task(0, m), torch.full(shape, float(m)))
            outbox.drain()
            dist.barrier()
            return None
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        began = time.monotonic()
        receiver = PeerReceiver(
            0, RECV_AHEAD, inbox, torch.device("cpu"), spec=(shape, torch.float32) if known_spec else None
        )
        receiver.start()
        got = [inbox.get(timeout=60) for _ in range(RECV_AHEAD)]
        elapsed = time.monotonic() - began
        receiver.join()
        dist.barrier()
        return {"elapsed_s": elapsed, "got": [(t.microbatch, x.tolist()) for t, x, _ in got]}
    finally:
        if delays is not None:
            delays.uninstall()


def test_a_slow_link_delays_each_message_once_when_receives_are_posted_ahead(cluster):
    """With the spec known, header and payload receives are posted together and several
    messages ahead, so a link's latency is paid once per message and messages overlap on it;
    reading the header first pays it twice per message, one message at a time."""
    delay_s = 0.15
    ahead = cluster.run(_receive_over_slow_link, 2, delay_s * 1000, True)[1]
    header_first = cluster.run(_receive_over_slow_link, 2, delay_s * 1000, False)[1]
    for result in (ahead, header_first):
        assert [(m, x) for m, x in result["got"]] == [(m, [[float(m)] * 5] * 3) for m in range(len(result["got"]))]
    n = len(ahead["got"])
    assert ahead["elapsed_s"] < 1.6 * delay_s
    assert header_first["elapsed_s"] > 2 * n * delay_s * 0.9


def _receive_with_wrong_spec(rank: int, world: int) -> str | None:
    import queue

    import torch.distributed as dist

    from megatronapp.dpp.tasks import forward_task
    from megatronapp.dpp.transport import PeerReceiver, send_task_message
    from megatronapp.p2p.outbox import Outbox

    if rank == 0:
        outbox = Outbox()
        send_task_message(outbox, 1, forward_task(1, 0), torch.zeros(3, 5))
        outbox.drain()
        dist.barrier()
        return None
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    receiver = PeerReceiver(0, 1, inbox, torch.device("cpu"), spec=(torch.Size((5, 3)), torch.float32))
    receiver.start()
    task, error, _ = inbox.get(timeout=60)
    receiver.join()
    dist.barrier()
    assert task is None
    return str(error)


def test_a_message_that_breaks_the_model_spec_is_an_error_naming_both(cluster):
    message = cluster.run(_receive_with_wrong_spec, 2)[1]
    assert message == (
        "rank 0 sent (3, 5) torch.float32 for F(c1,m0), but the model's spec for its messages is (5, 3) torch.float32"
    )


class _SlowWork:
    def wait(self) -> None:
        pass


def test_the_sender_thread_keeps_isends_off_the_compute_thread_in_order(monkeypatch):
    """gloo's isend writes before it returns; with the sender thread a send only queues (every
    send returns while the isends are held back), the isends go out on another thread in send
    order (header then payload, per message), and drain() waits for them."""
    import threading

    import megatronapp.dpp.transport as transport
    from megatronapp.dpp.tasks import forward_task

    issued, release = [], threading.Event()

    def held_isend(tensor, dst, tag, group=None):
        release.wait(timeout=5)  # an isend on the compute thread would hold up send() here
        issued.append((dst, tag, tensor.dtype, threading.get_ident()))
        return _SlowWork()

    monkeypatch.setattr(transport.dist, "isend", held_isend)
    outbox = transport.Outbox(threaded=True)
    for m in range(4):
        transport.send_task_message(outbox, 1 + m % 2, forward_task(0, m), torch.zeros(2, 3))
    assert issued == []  # all four sends returned, none of their isends has gone out
    release.set()
    outbox.drain()
    assert [i[:3] for i in issued] == [
        (1 + m % 2, tag, dtype)
        for m in range(4)
        for tag, dtype in ((transport.HEADER_TAG, torch.int64), (transport.PAYLOAD_TAG, torch.float32))
    ]
    assert threading.get_ident() not in {i[3] for i in issued}
    assert not outbox._thread.is_alive()


def test_a_failed_send_is_raised_and_a_bad_tensor_at_once(monkeypatch):
    import megatronapp.dpp.transport as transport
    from megatronapp.dpp.tasks import forward_task

    def broken_isend(tensor, dst, tag, group=None):
        raise RuntimeError("connection reset by peer")

    monkeypatch.setattr(transport.dist, "isend", broken_isend)
    outbox = transport.Outbox(threaded=True)
    with pytest.raises(ValueError, match="cannot send a 5-dim"):
        transport.send_task_message(outbox, 1, forward_task(0, 0), torch.zeros(1, 1, 1, 1, 1))
    transport.send_task_message(outbox, 1, forward_task(0, 0), torch.zeros(2))
    with pytest.raises(RuntimeError, match="sending failed: connection reset by peer"):
        outbox.drain()


def test_the_send_thread_is_used_where_each_rank_has_a_spare_core():
    from megatronapp.dpp.config import DppConfigError, resolve_send_thread

    assert resolve_send_thread("auto", cores=16, local_ranks=8, threads_per_rank=1)  # the device host
    assert not resolve_send_thread("auto", cores=2, local_ranks=2, threads_per_rank=1)  # the 2-core VM
    assert not resolve_send_thread("auto", cores=16, local_ranks=8, threads_per_rank=2)
    assert resolve_send_thread("on", cores=2, local_ranks=2, threads_per_rank=1)
    assert not resolve_send_thread("off", cores=64, local_ranks=1, threads_per_rank=1)
    with pytest.raises(DppConfigError, match="--dpp-send-thread must be one of auto, on, off"):
        DppConfig(send_thread="yes")


def test_the_outbox_sends_headers_and_payloads_on_their_channels(monkeypatch):
    """Separate channels (channels.py): a header on the host group, a payload on the group of
    its own direction, so a CUDA payload never shares NCCL's stream with the other way."""
    import megatronapp.dpp.transport as transport
    from megatronapp.dpp.channels import Channels
    from megatronapp.dpp.tasks import backward_task

    issued = []
    monkeypatch.setattr(
        transport.dist, "isend", lambda tensor, dst, tag, group=None: issued.append((dst, tag, group)) or _SlowWork()
    )
    channels = Channels(decision_group=None, header_group="hosts", payload_groups={(3, 5): "3->5", (5, 3): "5->3"})
    for threaded in (False, True):
        issued.clear()
        outbox = transport.Outbox(threaded=threaded)
        transport.send_task_message(outbox, 5, backward_task(1, 2), torch.zeros(4), channels, rank=3)
        outbox.drain()
        assert issued == [(5, transport.HEADER_TAG, "hosts"), (5, transport.PAYLOAD_TAG, "3->5")]
    assert transport.route(channels, 5, 3) == ("hosts", "5->3") and transport.route(None, 5, 3) == (None, None)


def _train_with_recorded_order(rank: int, world: int) -> dict:
    """One PP2 V2 M4 step, sender thread on, separate channels, with a HostOrder that logs how
    the runtime uses the stream protocol (dpp/streams.py) that CUDA depends on."""
    import threading

    import megatronapp.dpp.runtime as dpp_runtime
    from megatronapp.dpp.streams import HostOrder

    class RecordingOrder(HostOrder):
        def __init__(self):
            self.lock, self.log, self.marks, self.streams = threading.Lock(), [], 0, []

        def _note(self, *entry):
            with self.lock:
                self.log.append(entry)

        def side_stream(self):
            self._note("side_stream", threading.current_thread().name)
            return super().side_stream()

        def mark(self):
            self.marks += 1
            self._note("mark", self.marks)
            return self.marks

        def after_mark(self, mark):
            self._note("after_mark", mark)

        def complete(self, work, before_wait, src):
            super().complete(work, before_wait, src)
            self._note("complete", src)

        def adopt(self, tensor):
            self._note("adopt", threading.current_thread().name)
            return tensor

        def after_task(self):
            self._note("after_task", threading.current_thread().name)

    order = RecordingOrder()
    original = dpp_runtime.build_order
    dpp_runtime.build_order = lambda device: order
    try:
        train_variants(rank, world, (1, 2, 2, 4, 4), [("dynamic", "depth-first", None, "separate")], iters=1)
    finally:
        dpp_runtime.build_order = original
    return {"log": order.log}


def test_the_runtime_keeps_the_gpu_stream_protocol(cluster):
    """What CUDA correctness rests on, checked on CPU: every threaded send waits on the mark
    made for it, in order, on the sender's side stream; every payload is completed on its
    receiver's side stream and adopted by the compute thread; the host is paced once per task."""
    # per rank: F, I and W (dynamic splits the backward) of 2 chunks x 4; all inputs but tokens and the loss's
    tasks, remote = 3 * 2 * 4, 12
    for rank, result in enumerate(cluster.run(_train_with_recorded_order, 2)):
        log = result["log"]
        kinds = [entry[0] for entry in log]
        assert kinds.count("after_task") == tasks
        assert {name for kind, name in log if kind in ("after_task", "adopt")} == {"MainThread"}
        assert kinds.count("complete") == kinds.count("adopt") == remote
        marks = [m for kind, m in log if kind == "mark"]
        assert marks == [m for kind, m in log if kind == "after_mark"] == list(range(1, remote + 1))
        assert sorted(name for kind, name in log if kind == "side_stream") == ["dpp-recv-" + str(1 - rank), "p2p-send"]


def test_one_process_builds_no_channels_even_where_cuda_would():
    """PP1 (one process, maybe without torch.distributed) has nothing to send: no groups."""
    from megatronapp.parallel.groups import single_process_groups

    job = make_job(1, 1, 1, 1, "dynamic", global_batch=4)
    factory = functools.partial(build_dynamic_runtime_factory(DppConfig(), job), separate_channels=True)
    trainer = Trainer(
        job, single_process_groups(job.layout), torch.device("cpu"), RandomTokenBatches(job, 0), runtime_factory=factory
    )
    assert trainer.runtime.channels.owned == [] and len(trainer.train(2)) == 2
