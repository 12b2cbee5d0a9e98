"""The backward worker: the engine's Trainer (grads, DP reduction, clipping, the only
optimizer, checkpoints) driven by an FBD runtime instead of the pipeline runtime.

Per microbatch it takes the stage input from its forward twin (stage 0 reads its tokens),
recomputes the stage with autograd, runs backward with the output grad from the next
backward stage and sends the input grad to the previous one; so it holds one microbatch's
activations at a time. At the start of iteration i it publishes the weights of version i.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch

from megatronapp import spans
from megatronapp.engine.hooks import NULL_TRACER
from megatronapp.engine.trainer import Trainer
from megatronapp.fbd.config import FbdConfig, FbdInjection
from megatronapp.fbd.groups import RoleGroups
from megatronapp.fbd.links import LinkDevices, PostedRecv, RoleFaults, RoleWaits, receive_expected
from megatronapp.fbd.plan import FbdAction, Op, compute_backward_actions
from megatronapp.fbd.reshard import compute_weight_pieces, full_param_specs, pack_weights
from megatronapp.p2p.message import empty_message, unpack_expected
from megatronapp.p2p.outbox import Outbox, Send
from megatronapp.parallel.groups import ParallelGroups
from megatronapp.pipeline.compute_timer import ComputeTimer
from megatronapp.pipeline.contract import MicrobatchContext

_TRAINER_OPS = (Op.REDUCE_GRADS, Op.GRAD_NORM, Op.METRICS)  # issued by the Trainer after run(), in this order


@dataclass
class _Iteration:
    index: int
    tokens: list
    posted: dict = field(default_factory=dict)  # m -> PostedRecv of the stage input
    inputs: dict = field(default_factory=dict)  # m -> stage input (requires grad)
    outputs: dict = field(default_factory=dict)  # m -> stage output or scaled loss
    grads: dict = field(default_factory=dict)  # m -> grad of the stage output
    losses: list = field(default_factory=list)


class BackwardRuntime:
    """Executes compute_backward_actions up to the trainer's collectives: the Trainer's runtime
    (built through Trainer(runtime_factory=...): the engine's runtime arguments plus FBD's settings)."""

    def __init__(
        self,
        model,
        groups: ParallelGroups,
        *,
        device,
        tracer,
        reducer,
        injector,
        grad_scale_func=None,
        fbd: FbdConfig,
        roles: RoleGroups,
        links: LinkDevices,
        num_microbatches: int,
        injection: FbdInjection = FbdInjection(),
        split_backward: bool = False,
    ):
        if split_backward:  # refused before launch (fbd.config.validate_fbd_job)
            raise ValueError("forward-backward disaggregation runs the whole backward, not I and W tasks")
        lay, c = roles.layout, roles.coords
        self.model, self.reducer, self.fbd, self.roles = model, reducer, fbd, roles
        self.grad_scale_func = grad_scale_func  # fp16 loss scaling, applied before backward
        self.device, self.tracer, self.links = device, tracer, links  # links(peer): that link's tensor device
        (self.chunk,) = model.chunks
        self.num_microbatches = num_microbatches
        specs = full_param_specs(self.chunk, lay.tp_size)
        self.weight_pieces = {
            dst: compute_weight_pieces(specs, lay.tp_size, c.tp, lay.forward_tp_size, lay.role_of(dst).tp)
            for dst in lay.weight_targets(c.tp, c.dp, c.pp)
        }
        self.compute_timer = ComputeTimer(device)
        self.injector = injector
        self.waits = RoleWaits()
        self.faults = RoleFaults(
            roles.rank, "backward", injection.crash, injection.delay_ms("backward"), injection.delay_seed
        )
        self.loss_gap = 0.0  # max |forward loss - recomputed loss| seen (last stage, logging)

    def _compute(self):
        return self.injector.compute() if self.injector is not None else contextlib.nullcontext()

    def run(self, microbatches: list[torch.Tensor], iteration: int = 0) -> torch.Tensor | None:
        """Forward (recompute) + backward of every microbatch; summed 1/M-scaled loss on the last stage."""
        it = _Iteration(iteration, microbatches)
        if self.injector is not None:
            self.injector.set_iteration(iteration)  # as PipelineRuntime.run: intermittent slowdowns
        self.faults.before_iteration(it.index)
        self.outbox = Outbox()
        actions = compute_backward_actions(
            self.roles.layout, self.roles.rank, it.index, self.num_microbatches, self.fbd.max_ahead
        )
        for a in actions:
            if a.op in _TRAINER_OPS:
                break
            with self.tracer.context(chunk=0, microbatch=a.microbatch):
                self._HANDLERS[a.op](self, a, it)
        self.outbox.drain()
        return torch.stack(it.losses).sum() if it.losses else None

    def _send_weights(self, a: FbdAction, it: _Iteration) -> None:
        self.reducer.wait_param_gather()  # distributed optimizer: the step's all-gather may be in flight
        self.outbox.post(
            [
                Send(pack_weights(self.chunk, pieces, it.index, self.links(dst)), dst)
                for dst, pieces in self.weight_pieces.items()
            ]
        )

    def _recv_input(self, a: FbdAction, it: _Iteration) -> None:
        (src,) = a.peers
        spec = self.model.input_spec(0, it.tokens[a.microbatch])
        it.posted[a.microbatch] = PostedRecv(empty_message(spec.shape, spec.dtype, self.links(src)), src)

    def _recompute(self, a: FbdAction, it: _Iteration) -> None:
        m, tokens = a.microbatch, it.tokens[a.microbatch]
        first, last = self.chunk.has_embedding, self.chunk.has_head
        x = None
        if not first:
            posted, spec = it.posted.pop(m), self.model.input_spec(0, tokens)
            with self.waits.on_other_role(self.tracer, spans.WAIT_FORWARD):
                message = posted.wait()
            x = unpack_expected(message, spec.shape, spec.dtype, (it.index, m), "stage input", posted.source)
            x = x.to(self.device).requires_grad_(True)
            it.inputs[m] = x
        ctx = MicrobatchContext(it.index, m, 0, first, last)
        self.faults.before_compute()
        with self.tracer.span(spans.FORWARD), self.compute_timer.measure(), self._compute():
            out, loss_fn = self.model.forward_step(0, x, tokens, ctx)
            if last:
                out = loss_fn(out) / self.num_microbatches
        if last:
            it.losses.append(out.detach())
        it.outputs[m] = out

    def _recv_grad(self, a: FbdAction, it: _Iteration) -> None:
        (src,) = a.peers
        spec = self.model.output_spec(0, it.tokens[a.microbatch])
        tags = (it.index, a.microbatch)
        it.grads[a.microbatch] = receive_expected(self.links, src, spec, tags, "output grad", self.device)

    def _backward(self, a: FbdAction, it: _Iteration) -> None:
        m = a.microbatch
        if m == self.num_microbatches - 1:
            self.reducer.mark_final_microbatch(0)
        self.faults.before_compute()
        out, grad = it.outputs.pop(m), it.grads.pop(m, None)
        if grad is None and self.grad_scale_func is not None:
            out = self.grad_scale_func(out)
        with self.tracer.span(spans.BACKWARD), self.compute_timer.measure(), self._compute():
            torch.autograd.backward(out, grad)

    def _send_grad(self, a: FbdAction, it: _Iteration) -> None:
        x = it.inputs.pop(a.microbatch)
        self.outbox.post(self.links.packed_sends(x.grad, (it.index, a.microbatch), a.peers))

    def _recv_losses(self, a: FbdAction, it: _Iteration) -> None:
        (src,) = a.peers
        posted = PostedRecv(empty_message((self.num_microbatches,), torch.float32, self.links(src)), src)
        with self.waits.on_other_role(self.tracer, spans.WAIT_FORWARD):
            message = posted.wait()
        forward = unpack_expected(
            message, (self.num_microbatches,), torch.float32, (it.index,), "forward losses", src
        ).to(self.device)
        recomputed = torch.stack(it.losses) * self.num_microbatches
        self.loss_gap = max(self.loss_gap, float((forward - recomputed).abs().max()))

    _HANDLERS = {
        Op.SEND_WEIGHTS: _send_weights,
        Op.RECV_INPUT: _recv_input,
        Op.RECOMPUTE: _recompute,
        Op.RECV_GRAD: _recv_grad,
        Op.BACKWARD: _backward,
        Op.SEND_GRAD: _send_grad,
        Op.RECV_LOSSES: _recv_losses,
    }


class BackwardWorker:
    """One backward worker: the engine's Trainer, executing steps through a BackwardRuntime."""

    role = "backward"

    def __init__(
        self,
        job,
        fbd: FbdConfig,
        groups: RoleGroups,
        device: torch.device,
        data,
        *,
        links: LinkDevices,
        tracer=NULL_TRACER,
        injector=None,
        injection: FbdInjection = FbdInjection(),
    ):
        factory = functools.partial(
            BackwardRuntime,
            fbd=fbd,
            roles=groups,
            links=links,
            num_microbatches=job.num_microbatches,
            injection=injection,
        )
        self.trainer = Trainer(
            job, groups.parallel, device, data, tracer=tracer, injector=injector, runtime_factory=factory
        )
        self.runtime = self.trainer.runtime

    @property
    def waits(self) -> RoleWaits:
        return self.runtime.waits
