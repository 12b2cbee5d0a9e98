"""Validation and unit-time simulation of pipeline schedules (semantics: see actions.py).

validate_schedule runs, in order:
  1. per-rank checks: ids in range; every (chunk, microbatch) forwarded once and backwarded
     once, either whole (B) or split (I, then its W: W after its I, and every W in the list,
     i.e. before the step's optimizer update, which follows the list); backward after its own
     forward; each comm action's peer holds the adjacent virtual
     stage; each compute that needs a remote input has a prior matching recv; each needed
     send exists and comes after the compute that produces it;
  2. FIFO matching: for each directed pair A->B the sequence of sends on A equals, message by
     message, the sequence of recvs on B from A;
  3. deadlock freedom, by simulating a conservative rendezvous model: each rank runs its list
     in order; a comm batch (maximal run of comm actions) is posted when its rank reaches it
     and completes once every op in it has its partner op posted on the peer; compute needs
     nothing else. A send therefore blocks until the matching recv is posted, which is the
     strictest thing NCCL may do, so a schedule passing here cannot hang on NCCL either.

The same simulation gives a unit-time timeline (forward 1 tick, backward 2 = I 1 + W 1, comm 0) used for
bubble fractions and the ASCII rendering. Every error is one line starting with
"pp rank R, action I <action>: ..." so it can be found in a printed schedule.
"""

from __future__ import annotations

from megatronapp.pipeline.actions import (
    Action,
    ActionKind,
    PipelineSchedule,
    comm_batches,
    stage_location,
    virtual_stage,
)

FORWARD_TICKS = 1
BACKWARD_TICKS = 2  # backward costs about twice the forward (grads w.r.t. inputs and weights)
SPLIT_TICKS = 1  # I and W each cost about one forward (Qi et al.'s zero-bubble cost model)

_F, _B = ActionKind.FORWARD, ActionKind.BACKWARD
_I, _W = ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT
_SF, _SB = ActionKind.SEND_FORWARD, ActionKind.SEND_BACKWARD
_RF, _RB = ActionKind.RECV_FORWARD, ActionKind.RECV_BACKWARD
# For each comm kind: which compute it belongs to and which way along the virtual stages its
# peer lies (+1: next stage, -1: previous stage).
_COMM_STEP = {_SF: (_F, +1), _RF: (_F, -1), _SB: (_B, -1), _RB: (_B, +1)}


class ScheduleError(ValueError):
    """A schedule violates a rule; the message names the pipeline rank and action."""


def compute_action_ticks(action: Action) -> int:
    """Unit-time duration of an action: forward 1, backward 2 (I 1, W 1), communication 0."""
    if action.kind is _F:
        return FORWARD_TICKS
    if action.kind in (_I, _W):
        return SPLIT_TICKS
    return BACKWARD_TICKS if action.kind is _B else 0


def _fail(rank: int, index: int | str, action: Action | None, message: str) -> ScheduleError:
    where = f"action {index} {action}" if action is not None else str(index)
    return ScheduleError(f"pp rank {rank}, {where}: {message}")


def _check_header(schedule: PipelineSchedule) -> None:
    p, v, m = schedule.pp_size, schedule.num_chunks, schedule.num_microbatches
    if min(p, v, m) < 1:
        raise ScheduleError(f"pp_size, num_chunks, num_microbatches must be >= 1, got {p}, {v}, {m}")
    if len(schedule.actions) != p:
        raise ScheduleError(f"schedule has {len(schedule.actions)} rank lists but pp_size={p}")


def _check_ids_and_peer(schedule: PipelineSchedule, rank: int, i: int, a: Action) -> None:
    p, v = schedule.pp_size, schedule.num_chunks
    if not (0 <= a.chunk < v and 0 <= a.microbatch < schedule.num_microbatches):
        raise _fail(rank, i, a, f"chunk must be in [0, {v}) and microbatch in [0, {schedule.num_microbatches})")
    if not a.kind.is_comm:
        if a.peer is not None:
            raise _fail(rank, i, a, "a compute action takes no peer")
        return
    target = virtual_stage(a.chunk, rank, p) + _COMM_STEP[a.kind][1]
    if not 0 <= target < p * v:
        raise _fail(rank, i, a, f"virtual stage {target} does not exist (stages are 0..{p * v - 1})")
    expected = stage_location(target, p)[0]
    if expected == rank:
        raise _fail(rank, i, a, f"virtual stage {target} is local to this rank; no communication is needed")
    if a.peer != expected:
        raise _fail(rank, i, a, f"peer must be rank {expected}, which holds virtual stage {target}")


def _local_input(a: Action, rank: int, p: int, v: int) -> Action | None:
    """What a compute action consumes: a recv on this rank, a local compute (pp_size 1) or None."""
    if a.kind is _W:  # its operands come from its own I (checked in _check_order)
        return None
    vstage = virtual_stage(a.chunk, rank, p)
    step = -1 if a.kind is _F else +1
    if not 0 <= vstage + step < p * v:
        return None
    if p == 1:  # the neighbouring stage's compute of the same kind (a B or an I there)
        return Action(a.kind, a.chunk + step, a.microbatch)
    return Action(_RF if a.kind is _F else _RB, a.chunk, a.microbatch, peer=stage_location(vstage + step, p)[0])


def _check_order(schedule: PipelineSchedule, rank: int, i: int, a: Action, seen: dict[Action, int]) -> None:
    p, v = schedule.pp_size, schedule.num_chunks
    key = Action(a.kind, a.chunk, a.microbatch)  # peer-free key: duplicates to other peers count
    if key in seen:
        raise _fail(rank, i, a, f"appears twice (first at action {seen[key]})")
    if a.kind.is_backward and Action(_F, a.chunk, a.microbatch) not in seen:
        raise _fail(rank, i, a, "backward before its own forward")
    if a.kind.is_backward and Action(_I if a.kind is _B else _B, a.chunk, a.microbatch) in seen:
        raise _fail(rank, i, a, "its backward already ran (a microbatch's backward is B, or I then W)")
    if a.kind is _W and Action(_I, a.chunk, a.microbatch) not in seen:
        raise _fail(rank, i, a, "W before its I (the weight gradients need I's output gradient)")
    if a.kind.is_comm:
        producer, _ = _COMM_STEP[a.kind]
        producers = (_B, _I) if producer is _B else (producer,)
        if a.kind in (_SF, _SB) and not any(Action(k, a.chunk, a.microbatch) in seen for k in producers):
            raise _fail(rank, i, a, f"sent before the {producer.name} that produces it")
    else:
        needed = _local_input(a, rank, p, v)
        kinds = (_B, _I) if needed is not None and needed.kind.is_backward else (needed and needed.kind,)
        if needed is not None and not any(Action(k, needed.chunk, needed.microbatch) in seen for k in kinds):
            raise _fail(rank, i, a, f"its input {needed} is not posted/run before it on this rank")
    seen[key] = i


def _check_completeness(schedule: PipelineSchedule, rank: int, seen: dict[Action, int]) -> None:
    p, v = schedule.pp_size, schedule.num_chunks
    actions = schedule.actions[rank]
    for c in range(v):
        for m in range(schedule.num_microbatches):
            backward = _I if Action(_I, c, m) in seen else _B
            for kind in (_F, backward):
                if Action(kind, c, m) not in seen:
                    raise _fail(rank, "end of list", None, f"{Action(kind, c, m)} never runs")
            if backward is _I and Action(_W, c, m) not in seen:
                raise _fail(
                    rank,
                    "end of list",
                    None,
                    f"{Action(_W, c, m)} never runs before the optimizer step "
                    f"(its weight gradients would miss the update)",
                )
            if p == 1:
                continue
            for kind, send, step in ((_F, _SF, +1), (backward, _SB, -1)):
                if 0 <= virtual_stage(c, rank, p) + step < p * v and Action(send, c, m) not in seen:
                    i = seen[Action(kind, c, m)]
                    raise _fail(rank, i, actions[i], f"its output is never sent (no {send.value} after it)")


def _check_rank(schedule: PipelineSchedule, rank: int) -> None:
    seen: dict[Action, int] = {}
    for i, a in enumerate(schedule.actions[rank]):
        _check_ids_and_peer(schedule, rank, i, a)
        _check_order(schedule, rank, i, a, seen)
    _check_completeness(schedule, rank, seen)


def _message(a: Action, rank: int, p: int) -> tuple[ActionKind, int, int]:
    """(compute kind, receiving virtual stage, microbatch): what a comm action carries."""
    compute, step = _COMM_STEP[a.kind]
    vstage = virtual_stage(a.chunk, rank, p)
    return compute, (vstage + step if a.kind in (_SF, _SB) else vstage), a.microbatch


def _match_fifo(schedule: PipelineSchedule) -> dict[tuple[int, int], tuple[int, int]]:
    """Pair each comm action (rank, index) with its partner (peer, index), k-th send to k-th recv."""
    p = schedule.pp_size
    sends: dict[tuple[int, int], list[int]] = {}
    recvs: dict[tuple[int, int], list[int]] = {}
    for rank, actions in enumerate(schedule.actions):
        for i, a in enumerate(actions):
            if a.kind in (_SF, _SB):
                sends.setdefault((rank, a.peer), []).append(i)
            elif a.kind in (_RF, _RB):
                recvs.setdefault((a.peer, rank), []).append(i)
    partner: dict[tuple[int, int], tuple[int, int]] = {}
    for src, dst in sorted(set(sends) | set(recvs)):
        s_idx, r_idx = sends.get((src, dst), []), recvs.get((src, dst), [])
        for k, (si, ri) in enumerate(zip(s_idx, r_idx)):
            send, recv = schedule.actions[src][si], schedule.actions[dst][ri]
            if _message(send, src, p) != _message(recv, dst, p):
                raise _fail(
                    src,
                    si,
                    send,
                    f"FIFO mismatch: send #{k} to rank {dst} is matched by "
                    f"rank {dst}'s recv #{k} from rank {src}, action {ri} {recv}",
                )
            partner[(src, si)], partner[(dst, ri)] = (dst, ri), (src, si)
        if len(s_idx) != len(r_idx):
            k = min(len(s_idx), len(r_idx))
            rank, i = (src, s_idx[k]) if len(s_idx) > k else (dst, r_idx[k])
            raise _fail(
                rank,
                i,
                schedule.actions[rank][i],
                f"unmatched: it is message #{k} on pair {src}->{dst} and the other side has only {k}",
            )
    return partner


def _segments(actions: tuple[Action, ...]) -> list[tuple[int, int]]:
    """[start, end) ranges in execution order: one per compute action, one per comm batch."""
    batches = dict(comm_batches(actions))
    segs, i = [], 0
    while i < len(actions):
        end = batches.get(i, i + 1)
        segs.append((i, end))
        i = end
    return segs


def _stuck_report(
    schedule: PipelineSchedule,
    segs: list[list[tuple[int, int]]],
    pos: list[int],
    partner: dict[tuple[int, int], tuple[int, int]],
    seg_of: list[dict[int, int]],
) -> ScheduleError:
    """Name every stuck rank, the batch it waits at and one partner op not yet posted."""
    parts = []
    for rank in range(schedule.pp_size):
        if pos[rank] == len(segs[rank]):
            continue
        start, end = segs[rank][pos[rank]]
        waits = [
            (peer, pi) for i in range(start, end) for peer, pi in [partner[(rank, i)]] if pos[peer] < seg_of[peer][pi]
        ]
        peer, pi = waits[0]
        parts.append((rank, start, f"waits for rank {peer} to reach action {pi} {schedule.actions[peer][pi]}"))
    rank, start, first = parts[0]
    others = "; ".join(f"pp rank {r} at action {s} {schedule.actions[r][s]} {w}" for r, s, w in parts[1:])
    return _fail(
        rank, start, schedule.actions[rank][start], f"deadlock: {first}" + (f"; also stuck: {others}" if others else "")
    )


def _run_rendezvous(schedule: PipelineSchedule, partner: dict[tuple[int, int], tuple[int, int]]) -> list[list[int]]:
    """Simulate the rendezvous model (module docstring); return each action's start tick."""
    p = schedule.pp_size
    segs = [_segments(actions) for actions in schedule.actions]
    seg_of = [{i: s for s, (start, end) in enumerate(rank_segs) for i in range(start, end)} for rank_segs in segs]
    pos, clock = [0] * p, [0] * p
    posted_at = [[0] * len(rank_segs) for rank_segs in segs]
    ticks = [[0] * len(actions) for actions in schedule.actions]
    progress = True
    while progress:
        progress = False
        for rank in range(p):
            actions = schedule.actions[rank]
            while pos[rank] < len(segs[rank]):
                start, end = segs[rank][pos[rank]]
                posted_at[rank][pos[rank]] = clock[rank]  # posting is idempotent while it waits
                if actions[start].kind.is_comm:
                    partners = [partner[(rank, i)] for i in range(start, end)]
                    if any(pos[peer] < seg_of[peer][pi] for peer, pi in partners):
                        break  # some partner op is not posted yet
                    clock[rank] = max([clock[rank]] + [posted_at[peer][seg_of[peer][pi]] for peer, pi in partners])
                    ticks[rank][start:end] = [clock[rank]] * (end - start)
                else:
                    ticks[rank][start] = clock[rank]
                    clock[rank] += compute_action_ticks(actions[start])
                pos[rank] += 1
                progress = True
    if any(pos[r] < len(segs[r]) for r in range(p)):
        raise _stuck_report(schedule, segs, pos, partner, seg_of)
    return ticks


def _validate_and_simulate(schedule: PipelineSchedule) -> list[list[int]]:
    _check_header(schedule)
    for rank in range(schedule.pp_size):
        _check_rank(schedule, rank)
    return _run_rendezvous(schedule, _match_fifo(schedule))


def validate_schedule(schedule: PipelineSchedule) -> None:
    """Raise ScheduleError (one line, naming rank and action) unless the schedule is complete,
    FIFO-consistent and deadlock-free under the rendezvous model (module docstring)."""
    _validate_and_simulate(schedule)


def simulate_schedule(schedule: PipelineSchedule) -> list[list[int]]:
    """Validate, then return start_ticks[rank][action_index] of the unit-time timeline.

    Compute starts when its rank is free (forward 1 tick, backward 2); a comm action's tick is
    when its batch completes (comm itself takes 0), i.e. once every partner op is posted.
    """
    return _validate_and_simulate(schedule)


def compute_bubble_fraction(schedule: PipelineSchedule) -> float:
    """Idle fraction of the unit-time timeline: 1 - busy ticks / (pp_size * makespan)."""
    ticks = simulate_schedule(schedule)
    makespan = max(
        t + compute_action_ticks(a)
        for rank_ticks, actions in zip(ticks, schedule.actions)
        for t, a in zip(rank_ticks, actions)
    )
    busy = sum(compute_action_ticks(a) for actions in schedule.actions for a in actions)
    return 1.0 - busy / (schedule.pp_size * makespan)


def render_schedule(schedule: PipelineSchedule) -> str:
    """ASCII timeline, one row per rank, one cell per tick: F3 / B3 (chunk:mb with chunks > 1), '.' idle."""
    ticks = simulate_schedule(schedule)
    label = (
        (lambda a: f"{a.kind.value}{a.microbatch}")
        if schedule.num_chunks == 1
        else (lambda a: f"{a.kind.value}{a.chunk}:{a.microbatch}")
    )
    rows = []
    for rank, actions in enumerate(schedule.actions):
        cells: dict[int, str] = {}
        for t, a in zip(ticks[rank], actions):
            for dt in range(compute_action_ticks(a)):
                cells[t + dt] = label(a)
        rows.append(cells)
    makespan = max((max(cells) + 1 for cells in rows if cells), default=0)
    width = max((len(s) for cells in rows for s in cells.values()), default=1)
    header = (
        f"{schedule.name}: pp={schedule.pp_size} chunks={schedule.num_chunks} "
        f"microbatches={schedule.num_microbatches} ticks={makespan}"
    )
    lines = [header] + [
        f"rank {r:>2} | " + " ".join(cells.get(t, ".").ljust(width) for t in range(makespan)).rstrip()
        for r, cells in enumerate(rows)
    ]
    return "\n".join(lines)
