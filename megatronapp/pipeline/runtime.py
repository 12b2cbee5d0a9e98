"""Executes a validated PipelineSchedule on one rank: compute, asynchronous P2P, DP overlap.

The model is reached only through the contract in pipeline/contract.py (forward_step and
tensor specs), so any network pipelines, not only the GPT.

The runtime makes no decisions: the schedule says what to run and in which order. How the
step's messages travel is pipeline/transport.py: each maximal run of communication actions is
posted as one `batch_isend_irecv`, or (recv_ahead, gloo only) every receive is posted ahead of
the schedule's RECV action (a bounded number in flight) and sends are non-blocking isends. Either way a
received tensor is waited for only right before the compute that consumes it, and sends are
completed at the end of the step. Each message is a packed frame (p2p/message.py) with ids
(0 forward / 1 backward, the virtual stage that consumes it, microbatch), checked on arrival
against what the schedule expects.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from megatronapp import spans
from megatronapp.p2p.outbox import host_has_spare_core_per_rank
from megatronapp.parallel.groups import ParallelGroups
from megatronapp.parallel.wgrad_defer import WeightGradQueue
from megatronapp.pipeline.actions import Action, ActionKind, PipelineSchedule, comm_batches, virtual_stage
from megatronapp.pipeline.compute_timer import ComputeTimer
from megatronapp.pipeline.contract import MicrobatchContext, PipelineModel
from megatronapp.pipeline.transport import AheadTransport, BatchedTransport, resolve_recv_ahead

_SPLIT_KINDS = (ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)


class NullInjector:
    """Fault-injection hooks; the real one lives in the engine (megatronapp.injection.inject)."""

    def compute(self, key=None):
        """Context around one compute task; `key` names its kind (e.g. (FORWARD, chunk)), so a
        GPU injector can estimate each kind's device time apart."""
        return contextlib.nullcontext()

    def before_recv_wait(self, src_global: int, work) -> None:
        pass

    def set_iteration(self, iteration: int) -> None:
        pass


@dataclass
class _StepState:
    microbatches: list
    iteration: int
    inputs: dict = field(default_factory=dict)  # (c, m) -> input activation (requires grad)
    outputs: dict = field(default_factory=dict)  # (c, m) -> output activation or scaled loss
    to_send: dict = field(default_factory=dict)  # (kind, c, m) -> tensor to send
    transport: object = None  # this step's messages (pipeline/transport.py)
    backwards_done: dict = field(default_factory=dict)  # chunk -> count
    losses: list = field(default_factory=list)


class StageCompute:
    """Forward and backward of one (chunk, microbatch) through the model contract: timed,
    traced and fault-injected. Shared by this runtime and MegaDPP's dynamic runtime."""

    def __init__(
        self,
        model: PipelineModel,
        pp_rank: int,
        pp_size: int,
        num_chunks: int,
        num_microbatches: int,
        device,
        injector=None,
        grad_scale_func=None,
        split_backward: bool = False,
        loss_microbatches: int | None = None,
    ):
        self.model, self.pp_rank, self.pp_size = model, pp_rank, pp_size
        # each microbatch's loss is divided by this many (default: this rank's own count); under an
        # uneven data-parallel split it is the balanced per-replica count, so the DP mean of the
        # replicas' sums stays the global batch's mean whatever a replica runs
        self.loss_microbatches = loss_microbatches or num_microbatches
        # split backward: backward() is B and defers the weight GEMMs here; weight_grad() is W
        self.wgrad_queue = WeightGradQueue() if split_backward else None
        self.grad_scale_func = grad_scale_func  # loss scaling (fp16, Megatron's): applied before backward
        self.num_vstages, self.num_microbatches = pp_size * num_chunks, num_microbatches
        self.injector = injector or NullInjector()
        self.compute_timer = ComputeTimer(device)

    def forward(self, chunk: int, mb_index: int, stage_input, microbatch, iteration: int, tracer) -> torch.Tensor:
        """The chunk's output, or on the last virtual stage its loss / loss_microbatches. A floating
        stage_input is made to require grad (its .grad is what backward sends back)."""
        vs = virtual_stage(chunk, self.pp_rank, self.pp_size)
        is_first, is_last = vs == 0, vs == self.num_vstages - 1
        if stage_input is not None and stage_input.is_floating_point():
            stage_input.requires_grad_(True)
        ctx = MicrobatchContext(iteration, mb_index, chunk, is_first, is_last)
        with tracer.span(spans.FORWARD), self.compute_timer.measure(), self.injector.compute((spans.FORWARD, chunk)):
            out, loss_fn = self.model.forward_step(chunk, stage_input, microbatch, ctx)
            if is_last:
                out = loss_fn(out) / self.loss_microbatches
        return out

    def backward(
        self, output: torch.Tensor, grad: torch.Tensor | None, stage_input, tracer, chunk: int = 0, microbatch: int = 0
    ):
        """Backward of `chunk` from `output` (grad None for the loss); the gradient of stage_input, if any.
        With split backward this is B: the weight GEMMs wait in `wgrad_queue` for weight_grad()."""
        if grad is None and self.grad_scale_func is not None:
            output = self.grad_scale_func(output)
        capture = contextlib.nullcontext() if self.wgrad_queue is None else self.wgrad_queue.capture(chunk, microbatch)
        with tracer.span(spans.BACKWARD), self.compute_timer.measure(), self.injector.compute((spans.BACKWARD, chunk)):
            with capture:
                torch.autograd.backward(output, grad)
        return None if stage_input is None else stage_input.grad

    def weight_grad(self, chunk: int, microbatch: int, tracer, reducer=None, backwards_left: int = 0) -> None:
        """W of (chunk, microbatch): its deferred weight GEMMs into the main grads. When it is the
        chunk's last (no backward of the chunk left, no W of it pending), the reducer counts its
        weights, so their buckets' DP reduction may start (engine/grads.py)."""
        with (
            tracer.span(spans.WEIGHT_GRAD),
            self.compute_timer.measure(),
            self.injector.compute((spans.WEIGHT_GRAD, chunk)),
        ):
            weights = self.wgrad_queue.run(chunk, microbatch)
        last = backwards_left == 0 and not any(c == chunk for c, _ in self.wgrad_queue.pending_keys())
        if reducer is not None and last:
            reducer.weight_grads_done(chunk, weights)


class PipelineRuntime:
    """Runs one optimizer step's forward/backward passes for the chunks of this rank.

    `model` is any pipeline model (see pipeline.contract): the runtime calls its
    forward_step and allocates receive buffers from its tensor specs.
    """

    def __init__(
        self,
        model: PipelineModel,
        groups: ParallelGroups,
        schedule: PipelineSchedule,
        *,
        device,
        tracer,
        reducer=None,
        injector=None,
        grad_scale_func=None,
        split_backward: bool = False,
        loss_microbatches: int | None = None,
        recv_ahead: bool = False,
    ):
        """recv_ahead: receives posted ahead and single isends (pipeline/transport.py; gloo only)."""
        self.model, self.groups, self.schedule = model, groups, schedule
        self.actions = schedule.for_rank(groups.pp_rank)
        self.batch_end = dict(comm_batches(self.actions))
        self.device = device
        self.tracer, self.reducer = tracer, reducer
        self.num_vstages = schedule.pp_size * schedule.num_chunks
        self.stage = StageCompute(
            model,
            groups.pp_rank,
            schedule.pp_size,
            schedule.num_chunks,
            schedule.num_microbatches,
            device,
            injector,
            grad_scale_func,
            split_backward,
            loss_microbatches,
        )
        self.injector, self.compute_timer = self.stage.injector, self.stage.compute_timer
        spare_core = host_has_spare_core_per_rank(groups.layout.world_size, torch.get_num_threads())
        self.recv_ahead = resolve_recv_ahead(recv_ahead, torch.device(device).type)
        # gloo's isend writes in the calling thread: a sender thread pays where a core is free for it
        self.send_thread = self.recv_ahead and spare_core
        self.peak_recvs_posted = 0  # most receives in flight at once, over the steps run
        if not split_backward and any(a.kind in _SPLIT_KINDS for a in self.actions):
            raise ValueError(
                f"schedule {schedule.name!r} has I/W actions but the model runs its backward "
                f"whole (split_backward is off)"
            )

    def _vstage(self, chunk: int) -> int:
        return virtual_stage(chunk, self.groups.pp_rank, self.schedule.pp_size)

    def run(self, microbatches: list, iteration: int = 0) -> torch.Tensor | None:
        """Forward+backward over all microbatches; returns the summed (1/M-scaled) loss on the last stage."""
        if len(microbatches) != self.schedule.num_microbatches:
            raise ValueError(f"schedule expects {self.schedule.num_microbatches} microbatches, got {len(microbatches)}")
        st = _StepState(microbatches=microbatches, iteration=iteration)
        self.injector.set_iteration(iteration)  # intermittent faults: on_step may run only every log_interval
        if self.recv_ahead:
            st.transport = AheadTransport(self, microbatches, st.to_send, self.send_thread)
        else:
            st.transport = BatchedTransport(self, microbatches, st.to_send)
        try:
            self._run_actions(st)
        finally:
            st.transport.close()  # a sender thread ends with the step, on every path
        st.transport.finish()
        self.peak_recvs_posted = max(self.peak_recvs_posted, st.transport.peak_posted)
        if st.inputs or st.outputs or st.to_send:
            raise RuntimeError("pipeline step ended with unconsumed tensors: schedule and runtime disagree")
        if self.stage.wgrad_queue is not None and self.stage.wgrad_queue.pending_keys():
            raise RuntimeError("pipeline step ended with W work pending: the optimizer would miss weight grads")
        return torch.stack(st.losses).sum() if st.losses else None

    def _run_actions(self, st: _StepState) -> None:
        i = 0
        while i < len(self.actions):
            if i in self.batch_end:
                st.transport.post_batch(self.actions[i : self.batch_end[i]])
                i = self.batch_end[i]
                continue
            action = self.actions[i]
            with self.tracer.context(chunk=action.chunk, microbatch=action.microbatch):
                if action.kind is ActionKind.FORWARD:
                    self._forward(action, st)
                elif action.kind is ActionKind.BACKWARD_WEIGHT:
                    self._weight_grad(action.chunk, action.microbatch, st)
                else:
                    self._backward(action, st)
            i += 1

    # -- compute -------------------------------------------------------------------------
    def _wait_recv(self, key, st: _StepState) -> torch.Tensor:
        return st.transport.receive(key)

    def _forward(self, a: Action, st: _StepState) -> None:
        vs = self._vstage(a.chunk)
        is_first, is_last = vs == 0, vs == self.num_vstages - 1
        x = None if is_first else self._wait_recv((ActionKind.RECV_FORWARD, a.chunk, a.microbatch), st)
        out = self.stage.forward(a.chunk, a.microbatch, x, st.microbatches[a.microbatch], st.iteration, self.tracer)
        if x is not None and x.is_floating_point():
            st.inputs[(a.chunk, a.microbatch)] = x
        if is_last:
            st.losses.append(out.detach())
        else:
            st.to_send[(ActionKind.SEND_FORWARD, a.chunk, a.microbatch)] = out.detach()
        st.outputs[(a.chunk, a.microbatch)] = out

    def _backward(self, a: Action, st: _StepState) -> None:
        vs = self._vstage(a.chunk)
        done = st.backwards_done.get(a.chunk, 0)
        if self.reducer is not None and done == self.schedule.num_microbatches - 1:
            self.reducer.mark_final_microbatch(a.chunk)
        st.backwards_done[a.chunk] = done + 1
        out = st.outputs.pop((a.chunk, a.microbatch))
        grad = None
        if vs != self.num_vstages - 1:
            grad = self._wait_recv((ActionKind.RECV_BACKWARD, a.chunk, a.microbatch), st)
        x = st.inputs.pop((a.chunk, a.microbatch)) if vs != 0 else None
        x_grad = self.stage.backward(out, grad, x, self.tracer, a.chunk, a.microbatch)
        if vs != 0:
            st.to_send[(ActionKind.SEND_BACKWARD, a.chunk, a.microbatch)] = x_grad
        if a.kind is ActionKind.BACKWARD and self.stage.wgrad_queue is not None:  # whole backward = I then W
            self._weight_grad(a.chunk, a.microbatch, st)

    def _weight_grad(self, chunk: int, microbatch: int, st: _StepState) -> None:
        left = self.schedule.num_microbatches - st.backwards_done.get(chunk, 0)
        self.stage.weight_grad(chunk, microbatch, self.tracer, self.reducer, left)
