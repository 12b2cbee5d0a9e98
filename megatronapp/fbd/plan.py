"""MegaFBD action lists: what every forward and backward worker does in one iteration, as data.

Vocabulary (peers and group members are global ranks; see fbd.layout.RoleLayout):

    forward worker (tf, dp, pp)              backward worker (tp, dp, pp)
    RW  recv weights of version i            SW  send (publish) weights of version i
    RA  recv stage input from pp-1           RI  recv stage input from the forward twin
    SI  send stage input to backward twins   R   recompute the stage with autograd (TP group)
    F   forward without autograd (TF group)  RG  recv grad of the stage output from pp+1
    SA  send stage output to pp+1            B   backward (TP group)
    SL  send this iteration's losses         SG  send grad of the stage input to pp-1
                                             RL  recv the forward losses (last stage)
                                             DP / MP / MET  grad reduction over DP, grad norm
                                             over TP x PP, metrics over all backward ranks

Iteration i on a backward worker: SW(i), RI of the first N microbatches (N = --fbd-max-ahead),
then per microbatch m: R(m), RG(m), B(m), SG(m), RI(m + N); then RL, DP, MP and, at the
iterations where the trainer resolves metrics (every log interval and the last), MET: the
last three are the engine trainer's collectives, issued in this order after the microbatches.
On a forward worker: RW(i), then per microbatch RA(m), SI(m), F(m), SA(m); then SL.

Why this cannot deadlock without a central controller: every action list is a pure function
of (layout, rank, iteration, num_microbatches, N), computed identically by every process, so
the k-th message on each directed pair and the k-th collective on each group name the same
thing on both sides by construction (validate.validate_fbd_plan checks it, FIFO per pair and
per group). Dependencies point one way inside an iteration: forward workers depend only on
earlier forward stages and on weights published at the start of the iteration; backward
workers depend on their forward twin (stage input) and on later backward stages (grads); the
only backward -> forward edge is SW(i) -> RW(i), which the backward side issues first. The
validator simulates the strictest rendezvous semantics (every send and recv blocks until its
partner is posted, collectives until every member arrives) over consecutive iterations; the
runtimes only ever wait less than that (posting is asynchronous, waits are lazy).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from megatronapp.fbd.layout import RoleLayout


class Op(str, Enum):
    RECV_WEIGHTS = "RW"
    RECV_ACT = "RA"
    SEND_INPUT = "SI"
    FORWARD = "F"
    SEND_ACT = "SA"
    SEND_LOSSES = "SL"
    SEND_WEIGHTS = "SW"
    RECV_INPUT = "RI"
    RECOMPUTE = "R"
    RECV_GRAD = "RG"
    BACKWARD = "B"
    SEND_GRAD = "SG"
    RECV_LOSSES = "RL"
    REDUCE_GRADS = "DP"
    GRAD_NORM = "MP"
    METRICS = "MET"


SEND_TO_RECV = {
    Op.SEND_WEIGHTS: Op.RECV_WEIGHTS,
    Op.SEND_ACT: Op.RECV_ACT,
    Op.SEND_INPUT: Op.RECV_INPUT,
    Op.SEND_LOSSES: Op.RECV_LOSSES,
    Op.SEND_GRAD: Op.RECV_GRAD,
}
RECV_OPS = frozenset(SEND_TO_RECV.values())
SEND_OPS = frozenset(SEND_TO_RECV)
COMPUTE_OPS = frozenset({Op.FORWARD, Op.RECOMPUTE, Op.BACKWARD})


@dataclass(frozen=True)
class FbdAction:
    op: Op
    iteration: int
    microbatch: int = -1  # -1: the action concerns the whole iteration
    peers: tuple[int, ...] = ()  # send: destinations, recv: sources (one message per peer)
    group: tuple[int, ...] = ()  # members of the collective it enters (compute: its TP group)

    @property
    def is_p2p(self) -> bool:
        return self.op in SEND_OPS or self.op in RECV_OPS

    @property
    def is_collective(self) -> bool:
        return len(self.group) > 1

    def __str__(self) -> str:
        mb = f",m{self.microbatch}" if self.microbatch >= 0 else ""
        peers = f"{'->' if self.op in SEND_OPS else '<-'}{list(self.peers)}" if self.peers else ""
        return f"{self.op.value}(i{self.iteration}{mb}){peers}"


def _tp_members(layout: RoleLayout, rank: int) -> tuple[int, ...]:
    c = layout.role_of(rank)
    if c.is_forward:
        return tuple(layout.forward_rank(t, c.dp, c.pp) for t in range(layout.forward_tp_size))
    return tuple(layout.backward_rank(t, c.dp, c.pp) for t in range(layout.tp_size))


def compute_forward_actions(layout: RoleLayout, rank: int, iteration: int, num_microbatches: int) -> list[FbdAction]:
    """One iteration of forward worker `rank` (module docstring)."""
    c, last = layout.role_of(rank), layout.pp_size - 1
    tp = _tp_members(layout, rank)
    targets = tuple(layout.input_targets(c.tp, c.dp, c.pp))
    acts = [FbdAction(Op.RECV_WEIGHTS, iteration, peers=tuple(layout.weight_sources(c.tp, c.dp, c.pp)))]
    for m in range(num_microbatches):
        if c.pp > 0:
            acts.append(FbdAction(Op.RECV_ACT, iteration, m, peers=(layout.forward_rank(c.tp, c.dp, c.pp - 1),)))
            if targets:
                acts.append(FbdAction(Op.SEND_INPUT, iteration, m, peers=targets))
        acts.append(FbdAction(Op.FORWARD, iteration, m, group=tp))
        if c.pp < last:
            acts.append(FbdAction(Op.SEND_ACT, iteration, m, peers=(layout.forward_rank(c.tp, c.dp, c.pp + 1),)))
    if c.pp == last and targets:
        acts.append(FbdAction(Op.SEND_LOSSES, iteration, peers=targets))
    return acts


def compute_backward_actions(
    layout: RoleLayout, rank: int, iteration: int, num_microbatches: int, max_ahead: int, metrics: bool = True
) -> list[FbdAction]:
    """One iteration of backward worker `rank` (module docstring)."""
    c, last, bwd = layout.role_of(rank), layout.pp_size - 1, layout.backward
    tp = _tp_members(layout, rank)
    source = (layout.input_source(c.tp, c.dp, c.pp),)

    def recv_input(m: int) -> list[FbdAction]:
        return [FbdAction(Op.RECV_INPUT, iteration, m, peers=source)] if c.pp > 0 and m < num_microbatches else []

    acts = [FbdAction(Op.SEND_WEIGHTS, iteration, peers=tuple(layout.weight_targets(c.tp, c.dp, c.pp)))]
    for m in range(min(max_ahead, num_microbatches)):
        acts += recv_input(m)
    for m in range(num_microbatches):
        acts.append(FbdAction(Op.RECOMPUTE, iteration, m, group=tp))
        if c.pp < last:
            acts.append(FbdAction(Op.RECV_GRAD, iteration, m, peers=(bwd.rank_of(c.tp, c.dp, c.pp + 1),)))
        acts.append(FbdAction(Op.BACKWARD, iteration, m, group=tp))
        if c.pp > 0:
            acts.append(FbdAction(Op.SEND_GRAD, iteration, m, peers=(bwd.rank_of(c.tp, c.dp, c.pp - 1),)))
        acts += recv_input(m + max_ahead)
    if c.pp == last:
        acts.append(FbdAction(Op.RECV_LOSSES, iteration, peers=source))
    dp = tuple(bwd.rank_of(c.tp, d, c.pp) for d in range(layout.dp_size))
    mp = tuple(sorted(bwd.rank_of(t, c.dp, p) for p in range(layout.pp_size) for t in range(layout.tp_size)))
    acts += [FbdAction(Op.REDUCE_GRADS, iteration, group=dp), FbdAction(Op.GRAD_NORM, iteration, group=mp)]
    if metrics:
        acts.append(FbdAction(Op.METRICS, iteration, group=tuple(range(layout.num_backward))))
    return acts


def build_fbd_plan(
    layout: RoleLayout, num_microbatches: int, max_ahead: int, iterations: range, log_interval: int = 1
) -> dict[int, list[FbdAction]]:
    """Every rank's actions over consecutive iterations (the input of validate_fbd_plan)."""
    if num_microbatches < 1 or max_ahead < 1 or log_interval < 1:
        raise ValueError(
            f"num_microbatches, max_ahead and log_interval must be >= 1, "
            f"got {num_microbatches}, {max_ahead}, {log_interval}"
        )

    def rank_actions(rank: int, i: int) -> list[FbdAction]:
        if layout.role_of(rank).is_forward:
            return compute_forward_actions(layout, rank, i, num_microbatches)
        metrics = (i + 1) % log_interval == 0 or i == iterations[-1]
        return compute_backward_actions(layout, rank, i, num_microbatches, max_ahead, metrics)

    return {r: [a for i in iterations for a in rank_actions(r, i)] for r in range(layout.world_size)}
