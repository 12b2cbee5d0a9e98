"""Executes one rank's part of a step with decisions made at run time (no schedule, no coordinator).

Per step: a `RankScheduler` (scheduler.py) holds the ready set; receiver threads
(transport.py) post the receives for each peer's next messages ahead and deliver (task,
tensor) pairs identified by their header. The loop: drain arrived messages into the
scheduler (never blocking), decide, run the task through the shared `StageCompute`
(pipeline/runtime.py: the model contract, timers, fault injection, tracing), send its output
asynchronously. Only when nothing is ready does the rank block, on its inbox.

Tensor-parallel ranks of one stage must run the same task sequence (their TP collectives
pair up): TP rank 0 decides and broadcasts the task over the TP group (3 int64s); the
others wait until that task's input has arrived and run it. DP replicas decide alone.

DP gradient reduction: with one chunk, the last backward of the chunk launches the bucket
all-reduces (overlapped, as in the static runtime). With several chunks, replicas finish
their chunks in different orders, and collectives must be issued in one order on every
member, so the reduction is left to the end of the step (GradReducer.finish).

On CUDA the same loop runs with NCCL payloads on a two-rank group per direction and host
data on gloo (channels.py), and events where the CPU needs none (streams.py): a send waits
for its producer only, a message counts as arrived once it is on the GPU, and the host
enqueues at most one task beyond the one the GPU is running, so decisions stay current.
"""

from __future__ import annotations

import collections
import os
import queue
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatronapp.dpp.channels import build_channels
from megatronapp.dpp.config import DppConfig, resolve_send_thread
from megatronapp.dpp.policies import build_policy
from megatronapp.dpp.scheduler import Decision, RankScheduler, compute_default_caps
from megatronapp.dpp.streams import build_order
from megatronapp.dpp.tasks import BACKWARD, FORWARD, WEIGHT_GRAD, remote_inputs
from megatronapp.dpp.transport import send_task_message, start_receivers
from megatronapp.p2p.outbox import Outbox
from megatronapp.parallel.groups import ParallelGroups
from megatronapp.pipeline.actions import Action, virtual_stage
from megatronapp.pipeline.runtime import StageCompute

_WIRE_KINDS = (FORWARD, BACKWARD, WEIGHT_GRAD)  # a decision's kind as TP rank 0 broadcasts it
INBOX_TIMEOUT_S = 600.0  # a message this late means a peer died: fail instead of hanging


@dataclass
class RuntimeCounters:
    """What the runtime observed, for tests and reports (all steps so far)."""

    peak_activations: int = 0
    peak_microbatches: int = 0
    peak_held: int = 0  # activation sets + pending W + received inputs not yet forwarded (scheduler.held)
    peak_w_bytes: int = 0  # operands held by pending W tasks (split backward)
    decisions: int = 0
    wait_fraction: float = 0.0  # the scheduler's recent waiting share, kept from step to step
    decision_ns: list = field(default_factory=list)  # drain + decide, per decision (last 10k)
    tasks: list = field(default_factory=list)  # the last step's decisions, in order


@dataclass
class _Step:
    microbatches: list
    iteration: int
    inputs: dict = field(default_factory=dict)  # (c, m) -> received activation (requires grad)
    grads: dict = field(default_factory=dict)  # (c, m) -> received output gradient
    outputs: dict = field(default_factory=dict)  # (c, m) -> output or scaled loss
    losses: list = field(default_factory=list)
    backwards_done: int = 0


class DynamicPipelineRuntime:
    """Same interface as PipelineRuntime (run, compute_timer, tracer), decisions at run time;
    `close()` removes the groups it built. Construct it on every rank (it may build groups).

    separate_channels: payloads on a group per direction, decisions on gloo (channels.py);
    None: on CUDA, where NCCL needs them. Tests turn it on over gloo."""

    def __init__(
        self,
        model,
        groups: ParallelGroups,
        config: DppConfig,
        *,
        num_chunks: int,
        num_microbatches: int,
        device,
        tracer,
        reducer=None,
        injector=None,
        grad_scale_func=None,
        separate_channels: bool | None = None,
        split_backward: bool = False,
        loss_microbatches: int | None = None,
    ):
        lay = groups.layout
        self.model, self.groups, self.config, self.device = model, groups, config, device
        self.pp_size, self.num_chunks, self.num_microbatches = lay.pp_size, num_chunks, num_microbatches
        self.tracer, self.reducer = tracer, reducer
        default = compute_default_caps(lay.pp_size, num_chunks, num_microbatches)[groups.pp_rank]
        self.cap = config.max_inflight or default
        self.stage = StageCompute(
            model,
            groups.pp_rank,
            lay.pp_size,
            num_chunks,
            num_microbatches,
            device,
            injector,
            grad_scale_func,
            split_backward,
            loss_microbatches,
        )
        self.injector, self.compute_timer = self.stage.injector, self.stage.compute_timer
        self.policy = build_policy(config.traversal, groups.pp_rank, lay.pp_size, num_chunks, num_microbatches)
        # (task, global source rank) of every input another rank sends this one in a step
        self.remote_inputs = [
            (task, groups.pp_ranks[p])
            for task, p in remote_inputs(groups.pp_rank, lay.pp_size, num_chunks, num_microbatches)
        ]
        self.recv_counts = collections.Counter(src for _, src in self.remote_inputs)
        self.tp_root = lay.rank_of(0, groups.dp_rank, groups.pp_rank)
        separate = device.type == "cuda" if separate_channels is None else separate_channels
        self.channels = build_channels(
            groups, num_chunks, separate=separate, payload_backend="nccl" if device.type == "cuda" else "gloo"
        )
        self.order = build_order(device)
        self.counters = RuntimeCounters()
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", lay.world_size))  # torchrun's; else one host
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.send_thread = resolve_send_thread(config.send_thread, cores, local_ranks, torch.get_num_threads())

    def run(self, microbatches: list, iteration: int = 0) -> torch.Tensor | None:
        """Forward+backward of every microbatch; the summed 1/M-scaled loss on the last stage."""
        if len(microbatches) != self.num_microbatches:
            raise ValueError(f"dynamic runtime expects {self.num_microbatches} microbatches, got {len(microbatches)}")
        sched = RankScheduler(
            self.groups.pp_rank,
            self.pp_size,
            self.num_chunks,
            self.num_microbatches,
            self.cap,
            self.policy,
            split_backward=self.stage.wgrad_queue is not None,
        )
        self.injector.set_iteration(iteration)  # as PipelineRuntime.run
        sched.wait_fraction = self.counters.wait_fraction  # adaptive's observation carries across steps
        inbox, threads = start_receivers(
            self.recv_counts,
            self.device,
            self.injector.before_recv_wait,
            self._message_specs(microbatches),
            self.channels,
            self.groups.rank,
            self.order,
        )
        outbox = Outbox(threaded=self.send_thread, order=self.order)
        st = _Step(microbatches, iteration)
        self.counters.tasks = []
        try:
            while not sched.done:  # on an error the daemon receiver threads are left behind, not joined
                decision, waited = self._next_decision(sched, inbox, st)
                busy = self._run_task(decision, sched, st, outbox)
                sched.observe(busy, waited)
        finally:
            outbox.close()  # the sender thread ends with the step, on every path
        for t in threads:  # every expected message was consumed, so they have ended
            t.join()
        outbox.drain()
        c = self.counters
        c.wait_fraction = sched.wait_fraction
        c.peak_activations = max(c.peak_activations, sched.counter.peak_activations)
        c.peak_microbatches = max(c.peak_microbatches, sched.counter.peak_microbatches)
        c.peak_held = max(c.peak_held, sched.peak_held)
        if self.stage.wgrad_queue is not None:
            c.peak_w_bytes = max(c.peak_w_bytes, self.stage.wgrad_queue.peak_bytes)
        if st.inputs or st.grads or st.outputs:
            raise RuntimeError("dynamic pipeline step ended with unconsumed tensors")
        return torch.stack(st.losses).sum() if st.losses else None

    def close(self) -> None:
        self.channels.destroy()

    def _message_specs(self, microbatches: list) -> dict[int, tuple[torch.Size, torch.dtype]]:
        """Per source global rank whose messages this step all have one spec (from the model:
        input_spec for activations, output_spec for gradients): that spec, so its receives
        can be posted ahead (transport.py)."""
        found: dict[int, set] = {}
        for task, src in self.remote_inputs:
            mb = microbatches[task.microbatch]
            spec = (
                self.model.input_spec(task.chunk, mb)
                if task.kind is FORWARD
                else self.model.output_spec(task.chunk, mb)
            )
            found.setdefault(src, set()).add((torch.Size(spec.shape), spec.dtype))
        return {src: next(iter(specs)) for src, specs in found.items() if len(specs) == 1}

    # -- decisions -------------------------------------------------------------------------
    def _drain(self, sched: RankScheduler, inbox: queue.SimpleQueue, st: _Step, block: bool) -> float:
        """Move arrived messages into the scheduler; with block, wait for at least one. Seconds waited."""
        waited = 0.0
        while True:
            try:
                if block:
                    t0 = time.perf_counter()
                    item = inbox.get(timeout=INBOX_TIMEOUT_S)
                    waited += time.perf_counter() - t0
                    block = False
                else:
                    item = inbox.get_nowait()
            except queue.Empty:
                if block:
                    raise RuntimeError(
                        f"pp rank {self.groups.pp_rank}: no message for {INBOX_TIMEOUT_S:.0f} s "
                        f"with {sched.remaining} tasks left"
                    ) from None
                return waited
            task, tensor, src = item
            if task is None:
                raise RuntimeError(f"receiving from rank {src} failed") from tensor
            tensor = self.order.adopt(tensor)  # CUDA: the compute stream now uses the receiver's buffer
            (st.inputs if task.kind is FORWARD else st.grads)[(task.chunk, task.microbatch)] = tensor
            sched.add_input(task)

    def _next_decision(self, sched: RankScheduler, inbox, st: _Step) -> tuple[Decision, float]:
        """This rank's next task (TP rank 0's choice on every TP rank) and the seconds waited for it."""
        waited, follower = 0.0, self.groups.tp is not None and self.groups.rank != self.tp_root
        while True:
            t0 = time.perf_counter_ns()
            self._drain(sched, inbox, st, block=False)
            decision = None if follower else sched.decide()
            if decision is not None or follower:
                self._record_cost(time.perf_counter_ns() - t0)
                break
            waited += self._drain(sched, inbox, st, block=True)
        if self.groups.tp is not None:
            decision, extra = self._agree(decision, sched, inbox, st)
            waited += extra
        return decision, waited

    def _agree(self, decision: Decision | None, sched, inbox, st) -> tuple[Decision, float]:
        """Broadcast TP rank 0's task; followers wait for its input (lockstep with rank 0 anyway)."""
        wire = torch.zeros(3, dtype=torch.int64)
        if decision is not None:
            t = decision.task
            wire[:] = torch.tensor([_WIRE_KINDS.index(t.kind), t.chunk, t.microbatch])
        dist.broadcast(wire, src=self.tp_root, group=self.channels.decision_group)  # gloo: host data
        if decision is not None:
            return decision, 0.0
        kind, chunk, mb = wire.tolist()
        task, waited = Action(_WIRE_KINDS[kind], chunk, mb), 0.0
        while task not in sched.available and task not in sched.pending_w:
            waited += self._drain(sched, inbox, st, block=True)
        return Decision(task, "tp-follow", (task,), sched.counter.activations), waited

    def _record_cost(self, ns: int) -> None:
        c = self.counters
        c.decisions += 1
        if len(c.decision_ns) < 10_000:
            c.decision_ns.append(ns)

    # -- compute ---------------------------------------------------------------------------
    def _run_task(self, decision: Decision, sched: RankScheduler, st: _Step, outbox: Outbox) -> float:
        task = decision.task
        sched.start(task)
        self.counters.tasks.append(decision)
        t0 = time.perf_counter()
        # The decision rides on the compute span as its "op" argument (policy, in-flight, ready set).
        op = decision.describe() if self.tracer.enabled else ""
        with self.tracer.context(chunk=task.chunk, microbatch=task.microbatch, op=op):
            if task.kind is WEIGHT_GRAD:
                out = self._weight_grad(task, st)
            else:
                out = self._forward(task, st) if task.kind is FORWARD else self._backward(task, st)
        busy = time.perf_counter() - t0
        consumer = sched.finish(task)
        if consumer is not None:
            send_task_message(
                outbox, self.groups.pp_ranks[consumer[0]], consumer[1], out, self.channels, self.groups.rank
            )
        t1 = time.perf_counter()
        self.order.after_task()  # CUDA: until the GPU is at most one task behind; that wait is its compute
        return busy + time.perf_counter() - t1

    def _forward(self, task: Action, st: _Step) -> torch.Tensor | None:
        key = (task.chunk, task.microbatch)
        x = st.inputs.get(key)
        out = self.stage.forward(
            task.chunk, task.microbatch, x, st.microbatches[task.microbatch], st.iteration, self.tracer
        )
        if x is None or not x.is_floating_point():
            st.inputs.pop(key, None)
        st.outputs[key] = out
        if virtual_stage(task.chunk, self.groups.pp_rank, self.pp_size) == self.pp_size * self.num_chunks - 1:
            st.losses.append(out.detach())
            return None
        return out.detach()

    def _backward(self, task: Action, st: _Step) -> torch.Tensor | None:
        key = (task.chunk, task.microbatch)
        if self.reducer is not None and self.num_chunks == 1 and st.backwards_done == self.num_microbatches - 1:
            self.reducer.mark_final_microbatch(0)
        st.backwards_done += 1
        return self.stage.backward(
            st.outputs.pop(key),
            st.grads.pop(key, None),
            st.inputs.pop(key, None),
            self.tracer,
            task.chunk,
            task.microbatch,
        )

    def _weight_grad(self, task: Action, st: _Step) -> None:
        # with one chunk the last W may start its buckets' DP reduction (module doc: with several,
        # replicas finish chunks in different orders, so the reduction waits for the step's end)
        reducer = self.reducer if self.num_chunks == 1 else None
        self.stage.weight_grad(
            task.chunk, task.microbatch, self.tracer, reducer, self.num_microbatches - st.backwards_done
        )
