"""Checks and deadlock simulation of MegaFBD action lists (a sibling of pipeline.validate).

validate_fbd_plan(plan) runs, in order:
  1. per-rank checks: no action twice; every action after what it consumes (F after RA and RW,
     R after RI, B after R and RG, sends after the compute producing them, the trainer's
     collectives after every backward, SW(i) after the metrics of i-1); every compute action
     covers each microbatch of its iteration;
  2. FIFO matching of P2P messages: for each directed pair A->B the k-th message A sends to
     B is the k-th message B receives from A, and both name the same (kind, iteration,
     microbatch);
  3. collective matching: the members of a group enter the same sequence of collectives;
  4. deadlock freedom under the strictest rendezvous model: each rank runs its list in
     order, a P2P action completes once every partner action is posted (reached by its
     rank), a collective once every member has reached it. The runtimes post P2P
     asynchronously and wait lazily, so they never block where this model does not.

Errors are one line: "rank R, action I <action>: ...".
"""

from __future__ import annotations

from megatronapp.fbd.plan import COMPUTE_OPS, RECV_OPS, SEND_OPS, SEND_TO_RECV, FbdAction, Op


class PlanError(ValueError):
    """An FBD plan violates a rule; the message names the rank and action."""


def _fail(rank: int, index: int, action: FbdAction | None, message: str) -> PlanError:
    where = f"action {index} {action}" if action is not None else "end of list"
    return PlanError(f"rank {rank}, {where}: {message}")


# op -> what must run earlier on the same rank, when the rank has it at all:
# "mb": same iteration and microbatch, "iter": the iteration-level action, "all": every
# microbatch of the iteration, "prev": the iteration-level action of the previous iteration.
_REQUIRES = {
    Op.FORWARD: ((Op.RECV_ACT, "mb"), (Op.RECV_WEIGHTS, "iter")),
    Op.SEND_INPUT: ((Op.RECV_ACT, "mb"),),
    Op.SEND_ACT: ((Op.FORWARD, "mb"),),
    Op.SEND_LOSSES: ((Op.FORWARD, "all"),),
    Op.RECOMPUTE: ((Op.RECV_INPUT, "mb"),),
    Op.BACKWARD: ((Op.RECOMPUTE, "mb"), (Op.RECV_GRAD, "mb")),
    Op.SEND_GRAD: ((Op.BACKWARD, "mb"),),
    Op.REDUCE_GRADS: ((Op.BACKWARD, "all"),),
    Op.GRAD_NORM: ((Op.REDUCE_GRADS, "iter"),),
    Op.METRICS: ((Op.GRAD_NORM, "iter"), (Op.RECV_LOSSES, "iter")),
    Op.SEND_WEIGHTS: ((Op.METRICS, "prev"),),
}


def _key(a: FbdAction) -> tuple[Op, int, int]:
    return a.op, a.iteration, a.microbatch


def _check_rank(rank: int, actions: list[FbdAction], num_microbatches: int) -> None:
    index = {}
    for i, a in enumerate(actions):
        if _key(a) in index:
            raise _fail(rank, i, a, f"appears twice (first at action {index[_key(a)]})")
        index[_key(a)] = i
    for i, a in enumerate(actions):
        for op, scope in _REQUIRES.get(a.op, ()):
            if scope == "all":
                needed = [(op, a.iteration, m) for m in range(num_microbatches)]
            else:
                it = a.iteration - 1 if scope == "prev" else a.iteration
                needed = [(op, it, a.microbatch if scope == "mb" else -1)]
            for key in needed:
                if index.get(key, -1) > i:
                    raise _fail(rank, i, a, f"runs before {key[0].value}(i{key[1]},m{key[2]}) that it consumes")
    for op in COMPUTE_OPS:
        for it in sorted({a.iteration for a in actions if a.op is op}):
            missing = [m for m in range(num_microbatches) if (op, it, m) not in index]
            if missing:
                raise _fail(
                    rank, len(actions), None, f"{op.value} of iteration {it} never runs microbatch {missing[0]}"
                )


def _match_p2p(plan: dict[int, list[FbdAction]]) -> dict[tuple[int, int], list[tuple[int, int]]]:
    sends: dict[tuple[int, int], list[int]] = {}
    recvs: dict[tuple[int, int], list[int]] = {}
    for rank, actions in plan.items():
        for i, a in enumerate(actions):
            for peer in a.peers:
                if peer not in plan or peer == rank:
                    raise _fail(rank, i, a, f"peer {peer} is not another rank of the job")
                if a.op in SEND_OPS:
                    sends.setdefault((rank, peer), []).append(i)
                elif a.op in RECV_OPS:
                    recvs.setdefault((peer, rank), []).append(i)
    partners: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for src, dst in sorted(set(sends) | set(recvs)):
        s_idx, r_idx = sends.get((src, dst), []), recvs.get((src, dst), [])
        for k, (si, ri) in enumerate(zip(s_idx, r_idx)):
            s, r = plan[src][si], plan[dst][ri]
            if (SEND_TO_RECV[s.op], s.iteration, s.microbatch) != _key(r):
                raise _fail(src, si, s, f"FIFO mismatch: message #{k} to rank {dst} is received as action {ri} {r}")
            partners.setdefault((src, si), []).append((dst, ri))
            partners.setdefault((dst, ri), []).append((src, si))
        if len(s_idx) != len(r_idx):
            k = min(len(s_idx), len(r_idx))
            rank, i = (src, s_idx[k]) if len(s_idx) > k else (dst, r_idx[k])
            raise _fail(rank, i, plan[rank][i], f"unmatched: message #{k} on pair {src}->{dst}, the other side has {k}")
    return partners


def _match_collectives(plan: dict[int, list[FbdAction]]) -> dict[tuple[int, int], list[tuple[int, int]]]:
    entries: dict[tuple[int, ...], dict[int, list[int]]] = {}
    for rank, actions in plan.items():
        for i, a in enumerate(actions):
            if a.is_collective:
                if rank not in a.group:
                    raise _fail(rank, i, a, f"enters a collective of group {list(a.group)} it is not a member of")
                entries.setdefault(a.group, {}).setdefault(rank, []).append(i)
    partners: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for group, by_rank in entries.items():
        first = group[0]
        for member in group:
            mine, ref = by_rank.get(member, []), by_rank.get(first, [])
            for k in range(max(len(mine), len(ref))):
                if k >= len(mine) or k >= len(ref) or _key(plan[member][mine[k]]) != _key(plan[first][ref[k]]):
                    rank, i = (member, mine[k]) if k < len(mine) else (first, ref[k])
                    raise _fail(
                        rank,
                        i,
                        plan[rank][i],
                        f"collective #{k} of group {list(group)} differs between ranks {first} and {member}",
                    )
        for k in range(len(by_rank[first])):
            members = [(m, by_rank[m][k]) for m in group]
            for m, i in members:
                partners[(m, i)] = [x for x in members if x[0] != m]
    return partners


def _simulate(plan: dict[int, list[FbdAction]], partners: dict[tuple[int, int], list[tuple[int, int]]]) -> None:
    pos = dict.fromkeys(plan, 0)
    progress = True
    while progress:
        progress = False
        for rank, actions in plan.items():
            while pos[rank] < len(actions):
                if any(pos[peer] < pi for peer, pi in partners.get((rank, pos[rank]), ())):
                    break
                pos[rank] += 1
                progress = True
    stuck = [r for r in plan if pos[r] < len(plan[r])]
    if stuck:
        rank = stuck[0]
        i = pos[rank]
        peer, pi = next((p, j) for p, j in partners[(rank, i)] if pos[p] < j)
        others = ", ".join(f"rank {r} at {plan[r][pos[r]]}" for r in stuck[1:])
        raise _fail(
            rank,
            i,
            plan[rank][i],
            f"deadlock: waits for rank {peer} to reach action {pi} {plan[peer][pi]}"
            + (f"; also stuck: {others}" if others else ""),
        )


def validate_fbd_plan(plan: dict[int, list[FbdAction]]) -> None:
    """Raise PlanError (one line) unless the plan is consistent and deadlock-free (module docstring)."""
    num_microbatches = 1 + max((a.microbatch for actions in plan.values() for a in actions), default=0)
    for rank, actions in plan.items():
        _check_rank(rank, actions, num_microbatches)
    partners = _match_p2p(plan)
    for key, value in _match_collectives(plan).items():
        partners.setdefault(key, []).extend(value)
    _simulate(plan, partners)
