"""The forward worker: runs its pipeline stage without autograd, streams stage inputs to
its backward twins, and takes versioned weights from them before every iteration."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatronapp.config import JobConfig
from megatronapp.engine.hooks import NULL_TRACER
from megatronapp.fbd.config import FbdConfig
from megatronapp.fbd.links import Outbox, PostedRecv, RoleFaults, RoleWaits
from megatronapp.fbd.plan import FbdAction, Op, compute_forward_actions
from megatronapp.fbd.reshard import (compute_weight_pieces, frame, full_param_specs, unframe, unpack_weights,
                                     weight_message_numel)
from megatronapp.model.gpt import TPContext, build_model_chunks
from megatronapp.parallel.groups import RoleGroups


@dataclass
class _Iteration:
    index: int
    tokens: list  # this DP rank's microbatches (B, S + 1)
    inputs: dict = field(default_factory=dict)  # m -> stage input activation
    outputs: dict = field(default_factory=dict)  # m -> stage output activation
    losses: list = field(default_factory=list)  # last stage: per-microbatch loss


class ForwardWorker:
    """One forward worker (RoleLayout coords (tf, dp, pp)); executes compute_forward_actions."""

    role = "forward"

    def __init__(self, job: JobConfig, fbd: FbdConfig, groups: RoleGroups, device: torch.device, data, *,
                 link_device: torch.device, tracer=NULL_TRACER):
        lay, c = groups.layout, groups.coords
        self.job, self.fbd, self.groups, self.device, self.data = job, fbd, groups, device, data
        self.link_device, self.tracer = link_device, tracer
        tp = TPContext(groups.parallel.tp, lay.forward_tp_size, c.tp)
        (self.chunk,) = build_model_chunks(job.model, pp_rank=c.pp, pp_size=lay.pp_size, num_chunks=1, tp=tp,
                                           seed=job.train.seed, device=device)
        self.chunk.requires_grad_(False)
        self.chunk.tracer = None if tracer is NULL_TRACER else tracer
        specs = full_param_specs(self.chunk, lay.forward_tp_size)
        self.weight_pieces = {src: compute_weight_pieces(specs, lay.tp_size, lay.role_of(src).tp,
                                                         lay.forward_tp_size, c.tp)
                              for src in lay.weight_sources(c.tp, c.dp, c.pp)}
        m = job.model
        self.act_shape = (job.train.micro_batch_size, m.seq_length, m.hidden_size)
        self.waits = RoleWaits()
        self.faults = RoleFaults(groups.rank, self.role, fbd.crash, fbd.random_delay_ms, fbd.delay_seed)
        self.hand_off = Outbox(window=fbd.max_ahead)  # stage inputs to backward workers
        self.downstream = Outbox(window=fbd.max_ahead)  # stage outputs to the next forward stage
        self.iteration = 0

    def train(self, end_iteration: int) -> None:
        while self.iteration < end_iteration:
            self.run_iteration()
        self.hand_off.drain()
        self.downstream.drain()

    def run_iteration(self) -> None:
        it = _Iteration(self.iteration, None)
        self.faults.before_iteration(it.index)
        self.tracer.step_begin(it.index)
        it.tokens = [mb.to(self.device) for mb in self.data.next_microbatches()]
        lay, c = self.groups.layout, self.groups.coords
        for a in compute_forward_actions(lay, self.groups.rank, it.index, self.job.num_microbatches):
            with self.tracer.context(chunk=0, microbatch=a.microbatch):
                self._HANDLERS[a.op](self, a, it)
        self.tracer.step_end(it.index)
        self.iteration += 1

    def _recv_weights(self, a: FbdAction, it: _Iteration) -> None:
        posted = {src: PostedRecv(weight_message_numel(self.chunk, pcs), src, self.link_device)
                  for src, pcs in self.weight_pieces.items()}
        with self.waits.on_other_role(self.tracer, "wait_weights"):
            messages = {src: p.wait() for src, p in posted.items()}
        for src, message in messages.items():  # a forward worker never runs iteration i with other weights
            unpack_weights(self.chunk, self.weight_pieces[src], message.to(self.device), it.index, src)

    def _recv_act(self, a: FbdAction, it: _Iteration) -> None:
        (src,) = a.peers
        message = PostedRecv(2 + _numel(self.act_shape), src, self.device).wait()
        it.inputs[a.microbatch] = unframe(message, (it.index, a.microbatch), "activation", src).view(self.act_shape)

    def _send_input(self, a: FbdAction, it: _Iteration) -> None:
        message = frame((it.index, a.microbatch), it.inputs[a.microbatch], self.link_device)
        self.hand_off.post(message, a.peers, lambda: self.waits.on_other_role(self.tracer, "wait_backward"))

    def _forward(self, a: FbdAction, it: _Iteration) -> None:
        tokens = it.tokens[a.microbatch]
        first, last = self.chunk.has_embedding, self.chunk.has_head
        x = tokens[:, :-1] if first else it.inputs.pop(a.microbatch)
        self.faults.before_compute()
        with torch.no_grad(), self.tracer.span("forward"):
            out = self.chunk(x, tokens[:, 1:] if last else None)
        if last:
            it.losses.append(out.float())
        else:
            it.outputs[a.microbatch] = out

    def _send_act(self, a: FbdAction, it: _Iteration) -> None:
        message = frame((it.index, a.microbatch), it.outputs.pop(a.microbatch), self.device)
        self.downstream.post(message, a.peers)

    def _send_losses(self, a: FbdAction, it: _Iteration) -> None:
        message = frame((it.index,), torch.stack(it.losses), self.link_device)
        self.hand_off.post(message, a.peers, lambda: self.waits.on_other_role(self.tracer, "wait_backward"))

    _HANDLERS = {Op.RECV_WEIGHTS: _recv_weights, Op.RECV_ACT: _recv_act, Op.SEND_INPUT: _send_input,
                 Op.FORWARD: _forward, Op.SEND_ACT: _send_act, Op.SEND_LOSSES: _send_losses}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
