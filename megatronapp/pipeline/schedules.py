"""Pure builders of pipeline schedules (vocabulary and semantics: see actions.py).

Every builder decides only the *compute order* of each pipeline rank (which FORWARD /
BACKWARD runs when) and hands it to `build_schedule_from_compute_order`, which places the
communication (comm_placement.py: eager sends, lazy FIFO-respecting recvs, recvs hoisted
only where the rendezvous model would otherwise deadlock). So a new schedule (zero-bubble,
DFS/BFS, ...) only has to say what each rank computes.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatronapp.pipeline.actions import Action, ActionKind, PipelineSchedule
from megatronapp.pipeline.comm_placement import ComputeStep, compute_step_actions, place_communication
from megatronapp.pipeline.zero_bubble import compute_zero_bubble_orders

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "looped-bfs", "zb-h1", "interleaved-zb")


def _check_sizes(pp_size: int, num_chunks: int, num_microbatches: int) -> None:
    if pp_size < 1:
        raise ValueError(f"pp_size must be >= 1, got {pp_size}")
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")


def _check_compute_orders(
    pp_size: int, num_chunks: int, num_microbatches: int, compute_orders: Sequence[Sequence[ComputeStep]]
) -> None:
    if len(compute_orders) != pp_size:
        raise ValueError(f"compute_orders has {len(compute_orders)} rank lists, expected pp_size={pp_size}")
    for rank, order in enumerate(compute_orders):
        for i, a in enumerate(a for step in order for a in compute_step_actions(step)):
            if a.kind.is_comm:
                raise ValueError(f"pp rank {rank}, action {i} {a}: compute_orders may only hold FORWARD/BACKWARD")
            if not (0 <= a.chunk < num_chunks and 0 <= a.microbatch < num_microbatches):
                raise ValueError(
                    f"pp rank {rank}, action {i} {a}: chunk must be in [0, {num_chunks}) "
                    f"and microbatch in [0, {num_microbatches})"
                )


def build_schedule_from_compute_order(
    pp_size: int,
    num_chunks: int,
    num_microbatches: int,
    compute_orders: Sequence[Sequence[ComputeStep]],
    name: str = "custom",
) -> PipelineSchedule:
    """Insert sends/recvs into per-rank FORWARD/BACKWARD orders (rules: comm_placement.py).

    compute_orders[p] lists rank p's compute actions (local chunk ids) in order; an element
    may also be a tuple of compute actions, a *step* run back to back whose comm is batched
    before/after it (Megatron's interleaved steady state is (F, B) steps). Raises ValueError if an
    order holds comm actions or out-of-range ids, a needed input is never produced, a
    produced message is never consumed, or the orders are cyclic. For pp_size 1 no comm is
    added. Completeness is the validator's job (validate.validate_schedule).
    """
    _check_sizes(pp_size, num_chunks, num_microbatches)
    _check_compute_orders(pp_size, num_chunks, num_microbatches, compute_orders)
    return PipelineSchedule(
        pp_size=pp_size,
        num_chunks=num_chunks,
        num_microbatches=num_microbatches,
        actions=place_communication(pp_size, num_chunks, compute_orders),
        name=name,
    )


def _forward(chunk: int, microbatch: int) -> Action:
    return Action(ActionKind.FORWARD, chunk, microbatch)


def _backward(chunk: int, microbatch: int) -> Action:
    return Action(ActionKind.BACKWARD, chunk, microbatch)


def build_gpipe_schedule(pp_size: int, num_microbatches: int) -> PipelineSchedule:
    """GPipe: every rank runs all forwards (microbatch order), then all backwards (same order).

    Peak activation memory is all M microbatches on every rank.
    """
    _check_sizes(pp_size, 1, num_microbatches)
    order = [_forward(0, m) for m in range(num_microbatches)] + [_backward(0, m) for m in range(num_microbatches)]
    return build_schedule_from_compute_order(pp_size, 1, num_microbatches, [order] * pp_size, "gpipe")


def compute_1f1b_order(pp_size: int, pp_rank: int, num_microbatches: int) -> list[Action]:
    """Megatron's non-interleaved 1F1B compute order for one rank.

    Warmup: min(pp_size - pp_rank - 1, M) forwards; steady: one forward then one backward
    until every forward is done; cooldown: the remaining backwards. At most
    min(pp_size - pp_rank, M) microbatches hold activations at once.
    """
    warmup = min(pp_size - pp_rank - 1, num_microbatches)
    order = [_forward(0, m) for m in range(warmup)]
    for i in range(num_microbatches - warmup):
        order += [_forward(0, warmup + i), _backward(0, i)]
    order += [_backward(0, m) for m in range(num_microbatches - warmup, num_microbatches)]
    return order


def build_1f1b_schedule(pp_size: int, num_microbatches: int) -> PipelineSchedule:
    """Megatron's non-interleaved one-forward-one-backward schedule (see compute_1f1b_order)."""
    _check_sizes(pp_size, 1, num_microbatches)
    orders = [compute_1f1b_order(pp_size, p, num_microbatches) for p in range(pp_size)]
    return build_schedule_from_compute_order(pp_size, 1, num_microbatches, orders, "1f1b")


def compute_interleaved_steps(pp_size: int, pp_rank: int, num_chunks: int, num_microbatches: int) -> list[ComputeStep]:
    """Megatron-Core's interleaved 1F1B compute order for one rank (M % P == 0 assumed).

    Virtual step k runs microbatches in groups of P per chunk: forward step k is chunk
    (k // P) % V, microbatch (k // (P*V)) * P + k % P; backward step k is the same microbatch
    on chunk V-1-(k // P) % V. Warmup = min(2*(P-p-1) + (V-1)*P, M*V) forwards, then 1F/1B
    alternate until the forwards run out, then the remaining backwards. Each steady-state
    (F, B) pair is one step, so its comm is one batch as in Megatron-Core (this is what keeps
    the schedule deadlock-free with blocking sends; see comm_placement.py).
    """
    p_size, v, total = pp_size, num_chunks, num_microbatches * num_chunks

    def step(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // p_size) % v
        microbatch = (k // (p_size * v)) * p_size + k % p_size
        return (chunk if forward else v - 1 - chunk), microbatch

    warmup = min(2 * (pp_size - pp_rank - 1) + (num_chunks - 1) * pp_size, total)
    order: list[ComputeStep] = [_forward(*step(k, True)) for k in range(warmup)]
    for i in range(total - warmup):
        order.append((_forward(*step(warmup + i, True)), _backward(*step(i, False))))
    order += [_backward(*step(k, False)) for k in range(total - warmup, total)]
    return order


def build_interleaved_1f1b_schedule(pp_size: int, num_chunks: int, num_microbatches: int) -> PipelineSchedule:
    """Megatron-Core's interleaved 1F1B (virtual pipeline) schedule; see compute_interleaved_steps.

    Requires num_microbatches % pp_size == 0 (Megatron's microbatch groups are P wide).
    """
    _check_sizes(pp_size, num_chunks, num_microbatches)
    if num_microbatches % pp_size:
        raise ValueError(
            f"interleaved schedule needs num_microbatches ({num_microbatches}) divisible by pp_size ({pp_size})"
        )
    orders = [compute_interleaved_steps(pp_size, p, num_chunks, num_microbatches) for p in range(pp_size)]
    return build_schedule_from_compute_order(pp_size, num_chunks, num_microbatches, orders, "interleaved")


def compute_breadth_first_order(num_chunks: int, num_microbatches: int) -> list[Action]:
    """Looped BFS (breadth-first pipeline): every microbatch through chunk 0, then chunk 1, ...;
    then the backwards from the last chunk down, microbatches in order within a chunk.

    The same order on every rank. Peak activation memory is all V*M (chunk, microbatch) sets.
    """
    forwards = [_forward(c, m) for c in range(num_chunks) for m in range(num_microbatches)]
    return forwards + [_backward(c, m) for c in reversed(range(num_chunks)) for m in range(num_microbatches)]


def build_breadth_first_schedule(pp_size: int, num_chunks: int, num_microbatches: int) -> PipelineSchedule:
    """Static looped BFS (see compute_breadth_first_order); any V >= 1 and M >= 1."""
    _check_sizes(pp_size, num_chunks, num_microbatches)
    order = compute_breadth_first_order(num_chunks, num_microbatches)
    return build_schedule_from_compute_order(pp_size, num_chunks, num_microbatches, [order] * pp_size, "looped-bfs")


def build_zb_h1_schedule(pp_size: int, num_microbatches: int) -> PipelineSchedule:
    """ZB-H1 (Qi et al.): 1F1B's forwards and input gradients, W in the bubbles, 1F1B's memory
    (pipeline/zero_bubble.py)."""
    _check_sizes(pp_size, 1, num_microbatches)
    base = [compute_1f1b_order(pp_size, p, num_microbatches) for p in range(pp_size)]
    orders = compute_zero_bubble_orders(base, pp_size, 1)
    return build_schedule_from_compute_order(pp_size, 1, num_microbatches, orders, "zb-h1")


def build_interleaved_zero_bubble_schedule(pp_size: int, num_chunks: int, num_microbatches: int) -> PipelineSchedule:
    """Interleaved 1F1B with I/W split and W in the bubbles, at interleaved 1F1B's memory
    (pipeline/zero_bubble.py). Requires num_microbatches % pp_size == 0, as interleaved."""
    _check_sizes(pp_size, num_chunks, num_microbatches)
    if num_microbatches % pp_size:
        raise ValueError(
            f"interleaved-zb schedule needs num_microbatches ({num_microbatches}) divisible by pp_size ({pp_size})"
        )
    base = [compute_interleaved_steps(pp_size, p, num_chunks, num_microbatches) for p in range(pp_size)]
    orders = compute_zero_bubble_orders(base, pp_size, num_chunks)
    return build_schedule_from_compute_order(pp_size, num_chunks, num_microbatches, orders, "interleaved-zb")


def schedule_has_weight_tasks(schedule: PipelineSchedule) -> bool:
    """Whether the schedule splits backward into I and W actions (the model must defer W)."""
    return any(
        a.kind in (ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)
        for actions in schedule.actions
        for a in actions
    )


def build_schedule(name: str, pp_size: int, num_chunks: int, num_microbatches: int) -> PipelineSchedule:
    """Build a schedule by name: "gpipe" | "1f1b" | "zb-h1" (num_chunks must be 1) | "interleaved" |
    "interleaved-zb" | "looped-bfs"."""
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}")
    if name == "interleaved":
        return build_interleaved_1f1b_schedule(pp_size, num_chunks, num_microbatches)
    if name == "interleaved-zb":
        return build_interleaved_zero_bubble_schedule(pp_size, num_chunks, num_microbatches)
    if name == "looped-bfs":
        return build_breadth_first_schedule(pp_size, num_chunks, num_microbatches)
    if num_chunks != 1:
        raise ValueError(
            f"schedule {name!r} runs one model chunk per rank, got num_chunks={num_chunks}; "
            f"use 'interleaved' for virtual pipeline stages"
        )
    if name == "gpipe":
        return build_gpipe_schedule(pp_size, num_microbatches)
    if name == "zb-h1":
        return build_zb_h1_schedule(pp_size, num_microbatches)
    return build_1f1b_schedule(pp_size, num_microbatches)
