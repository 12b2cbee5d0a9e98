"""The forward worker: runs its pipeline stage without autograd, streams stage inputs to
its backward twins, and takes versioned weights from them before every iteration."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatronapp import spans
from megatronapp.config import JobConfig
from megatronapp.engine.checkpoint import find_latest, load_checkpoint_file
from megatronapp.engine.checkpoint_files import read_checkpoint_meta
from megatronapp.engine.hooks import NULL_TRACER
from megatronapp.engine.mixed_precision import params_dtype
from megatronapp.fbd.config import FbdConfig, FbdInjection
from megatronapp.fbd.groups import RoleGroups
from megatronapp.fbd.links import LinkDevices, PostedRecv, RoleFaults, RoleWaits, receive_expected
from megatronapp.fbd.plan import FbdAction, Op, compute_forward_actions
from megatronapp.fbd.reshard import (
    compute_weight_pieces,
    full_param_specs,
    unpack_weights,
    weight_message_dtype,
    weight_message_shape,
)
from megatronapp.model.gpt import ChunkOptions, TPContext, build_model_chunks
from megatronapp.model.gpt_step import GPTPipelineModel
from megatronapp.p2p.message import empty_message, pack_message
from megatronapp.p2p.outbox import Outbox, Send
from megatronapp.parallel.random import build_rng_tracker
from megatronapp.pipeline.contract import MicrobatchContext


@dataclass
class _Iteration:
    index: int
    tokens: list  # this DP rank's microbatches (B, S + 1)
    inputs: dict = field(default_factory=dict)  # m -> stage input activation
    outputs: dict = field(default_factory=dict)  # m -> stage output activation
    losses: list = field(default_factory=list)  # last stage: per-microbatch loss


def build_forward_model(job: JobConfig, fbd: FbdConfig, groups: RoleGroups, device) -> GPTPipelineModel:
    """The forward worker's stage as a pipeline model (pipeline.contract), TF-way parallel.

    Same parameter init, keyed hidden dropout and forward_step as the backward workers. With
    TF = TP it also uses sequence parallelism when they do, and draws attention dropout from
    the same tracked stream (seeded by (tp, pp) and consumed in the same microbatch order),
    so its stage outputs are bit-identical to their recompute.
    """
    lay, c, t = groups.layout, groups.coords, job.train
    sp = t.sequence_parallel and lay.forward_tp_size == lay.tp_size
    tp = TPContext(groups.parallel.tp, lay.forward_tp_size, c.tp, sp)
    options = ChunkOptions(rng_tracker=build_rng_tracker(t.seed, c.tp, c.pp, device))
    chunks = build_model_chunks(
        job.model,
        pp_rank=c.pp,
        pp_size=lay.pp_size,
        num_chunks=1,
        tp=tp,
        seed=t.seed,
        device=device,
        options=options,
        stage_layers=job.layout.stage_layers,
    )
    for chunk in chunks:  # the backward workers' params dtype (bf16/fp16 as Megatron, else fp32)
        chunk.requires_grad_(False).to(params_dtype(job.precision))
    return GPTPipelineModel(
        chunks,
        job.model,
        seed=t.seed,
        dp_rank=c.dp,
        num_microbatches=job.num_microbatches,
        tp_size=lay.forward_tp_size,
        tp_rank=c.tp,
        sequence_parallel=sp,
        attention_backend=t.attention_backend,
    )


class ForwardWorker:
    """One forward worker (RoleLayout coords (tf, dp, pp)); executes compute_forward_actions."""

    role = "forward"

    def __init__(
        self,
        job: JobConfig,
        fbd: FbdConfig,
        groups: RoleGroups,
        device: torch.device,
        data,
        *,
        links: LinkDevices,
        tracer=NULL_TRACER,
        injection: FbdInjection = FbdInjection(),
    ):
        lay, c = groups.layout, groups.coords
        self.job, self.fbd, self.groups, self.device, self.data = job, fbd, groups, device, data
        self.links, self.tracer = links, tracer  # links(peer): device of that link's tensors
        self.model = build_forward_model(job, fbd, groups, device)
        (self.chunk,) = self.model.chunks
        self.rng_tracker = self.chunk.options.rng_tracker
        self.chunk.tracer = None if tracer is NULL_TRACER else tracer
        specs = full_param_specs(self.chunk, lay.forward_tp_size)
        self.weight_pieces = {
            src: compute_weight_pieces(specs, lay.tp_size, lay.role_of(src).tp, lay.forward_tp_size, c.tp)
            for src in lay.weight_sources(c.tp, c.dp, c.pp)
        }
        # backward TP ranks take sequence slices when they use sequence parallelism and we do not
        self.slice_for_targets = job.train.sequence_parallel and not self.model.seq_shards > 1
        self.waits = RoleWaits()
        self.injection = injection
        self.faults = RoleFaults(
            groups.rank, self.role, injection.crash, injection.delay_ms(self.role), injection.delay_seed
        )
        self.hand_off = Outbox(window=fbd.max_ahead)  # stage inputs to backward workers
        self.downstream = Outbox(window=fbd.max_ahead)  # stage outputs to the next forward stage
        self.iteration = 0

    def load(self, load_dir: str) -> None:
        """Resume from a checkpoint written by backward workers (of this or any layout): the
        iteration, the data position and, when it maps 1:1, the twin's attention-dropout
        stream. The weights themselves arrive with the first publication."""
        folder = find_latest(load_dir)
        meta = read_checkpoint_meta(folder)
        lay = self.groups.layout
        twin = lay.twin_of(self.groups.rank)
        same_world = meta["layout"]["world_size"] == lay.num_backward
        state = load_checkpoint_file(folder, f"rank{twin if same_world else 0:05d}.pt")
        self.data.load_state_dict(state["data"])  # the data position is global: any rank's file serves
        if same_world and lay.forward_tp_size == lay.tp_size and "tracker" in state["rng"]:
            self.rng_tracker.set_states(state["rng"]["tracker"])
        self.iteration = int(meta["iteration"])

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
        lay = self.groups.layout
        for a in compute_forward_actions(lay, self.groups.rank, it.index, self.job.num_microbatches):
            with self.tracer.context(chunk=0, microbatch=a.microbatch):
                self._HANDLERS[a.op](self, a, it)
        self.tracer.step_end(it.index)
        self.iteration += 1

    def _recv_weights(self, a: FbdAction, it: _Iteration) -> None:
        dtype = weight_message_dtype(self.chunk)
        posted = {
            src: PostedRecv(empty_message(weight_message_shape(self.chunk, pcs), dtype, self.links(src)), src)
            for src, pcs in self.weight_pieces.items()
        }
        with self.waits.on_other_role(self.tracer, spans.WAIT_WEIGHTS):
            messages = {src: p.wait() for src, p in posted.items()}
        for src, message in messages.items():  # a forward worker never runs iteration i with other weights
            unpack_weights(self.chunk, self.weight_pieces[src], message.to(self.device), it.index, src)

    def _recv_act(self, a: FbdAction, it: _Iteration) -> None:
        (src,) = a.peers
        spec = self.model.input_spec(0, it.tokens[a.microbatch])
        tags = (it.index, a.microbatch)
        it.inputs[a.microbatch] = receive_expected(self.links, src, spec, tags, "activation", self.device)

    def _send_input(self, a: FbdAction, it: _Iteration) -> None:
        x = it.inputs[a.microbatch]
        waiting = lambda: self.waits.on_other_role(self.tracer, spans.WAIT_BACKWARD)
        tags = (it.index, a.microbatch)
        if not self.slice_for_targets:
            self.hand_off.post(self._framed(tags, x, a.peers), waiting)
            return
        lay, shard = self.groups.layout, x.shape[1] // self.groups.layout.tp_size
        pieces = [(x[:, t * shard : (t + 1) * shard], target) for target in a.peers for t in [lay.role_of(target).tp]]
        self.hand_off.post(
            [Send(pack_message(piece, tags, self.links(target)), target) for piece, target in pieces], waiting
        )

    def _forward(self, a: FbdAction, it: _Iteration) -> None:
        tokens = it.tokens[a.microbatch]
        first, last = self.chunk.has_embedding, self.chunk.has_head
        x = None if first else it.inputs.pop(a.microbatch)
        ctx = MicrobatchContext(it.index, a.microbatch, 0, first, last)
        if self.injection.free_forward:  # upper-bound benchmark: backward workers never wait on compute
            if last:
                it.losses.append(torch.zeros((), device=self.device))
            else:
                spec = self.model.output_spec(0, tokens)
                it.outputs[a.microbatch] = torch.zeros(spec.shape, dtype=spec.dtype, device=self.device)
            return
        self.faults.before_compute()
        with torch.no_grad(), self.tracer.span(spans.FORWARD):
            out, loss_fn = self.model.forward_step(0, x, tokens, ctx)
            if last:
                out = loss_fn(out)
        if last:
            it.losses.append(out.float())
        else:
            it.outputs[a.microbatch] = out

    def _send_act(self, a: FbdAction, it: _Iteration) -> None:
        self.downstream.post(self._framed((it.index, a.microbatch), it.outputs.pop(a.microbatch), a.peers))

    def _send_losses(self, a: FbdAction, it: _Iteration) -> None:
        self.hand_off.post(
            self._framed((it.index,), torch.stack(it.losses), a.peers),
            lambda: self.waits.on_other_role(self.tracer, spans.WAIT_BACKWARD),
        )

    def _framed(self, ids: tuple, x: torch.Tensor, peers) -> list[Send]:
        return self.links.packed_sends(x, ids, peers)

    _HANDLERS = {
        Op.RECV_WEIGHTS: _recv_weights,
        Op.RECV_ACT: _recv_act,
        Op.SEND_INPUT: _send_input,
        Op.FORWARD: _forward,
        Op.SEND_ACT: _send_act,
        Op.SEND_LOSSES: _send_losses,
    }
