"""Pipeline schedule builders (schedules.py, comm_placement.py) and the validator (validate.py)."""

from __future__ import annotations

import random
import time

import pytest

from megatronapp.pipeline.actions import (
    Action,
    ActionKind,
    PipelineSchedule,
    comm_batches,
    stage_location,
    virtual_stage,
)
from megatronapp.pipeline.schedules import (
    build_1f1b_schedule,
    build_gpipe_schedule,
    build_interleaved_1f1b_schedule,
    build_schedule,
    build_schedule_from_compute_order,
    compute_interleaved_steps,
)
from megatronapp.pipeline.validate import (
    ScheduleError,
    compute_action_ticks,
    compute_bubble_fraction,
    render_schedule,
    simulate_schedule,
    validate_schedule,
)

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
SF, SB, RF, RB = ActionKind.SEND_FORWARD, ActionKind.SEND_BACKWARD, ActionKind.RECV_FORWARD, ActionKind.RECV_BACKWARD


def _legal_shapes():
    for pp in range(1, 9):
        for m in range(1, 17):
            yield "gpipe", pp, 1, m
            yield "1f1b", pp, 1, m
            if m % pp == 0:
                for v in range(1, 5):
                    yield "interleaved", pp, v, m


def _computes(actions):
    return [a for a in actions if not a.kind.is_comm]


def _with_rank(schedule: PipelineSchedule, rank: int, actions) -> PipelineSchedule:
    lists = list(schedule.actions)
    lists[rank] = tuple(actions)
    return PipelineSchedule(schedule.pp_size, schedule.num_chunks, schedule.num_microbatches, tuple(lists))


def _assert_points_at(err: ScheduleError, schedule: PipelineSchedule, rank: int, index: int) -> None:
    assert str(err).startswith(f"pp rank {rank}, action {index} {schedule.actions[rank][index]}:"), str(err)
    assert "\n" not in str(err)


# ---------------------------------------------------------------- builders


def test_every_builder_validates_over_many_shapes():
    count = 0
    for name, pp, v, m in _legal_shapes():
        schedule = build_schedule(name, pp, v, m)
        assert (schedule.pp_size, schedule.num_chunks, schedule.num_microbatches) == (pp, v, m)
        validate_schedule(schedule)
        count += 1
    assert count > 300


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 3)])
def test_pp1_has_no_communication(name, v):
    schedule = build_schedule(name, 1, v, 4)
    assert not any(a.kind.is_comm for a in schedule.actions[0])
    assert len(schedule.actions[0]) == 2 * v * 4


@pytest.mark.parametrize(
    "call",
    [
        lambda: build_gpipe_schedule(0, 4),
        lambda: build_1f1b_schedule(2, 0),
        lambda: build_interleaved_1f1b_schedule(2, 0, 4),
        lambda: build_interleaved_1f1b_schedule(4, 2, 6),  # M not a multiple of P
        lambda: build_schedule("zero-bubble", 2, 1, 4),
        lambda: build_schedule("1f1b", 2, 2, 4),  # 1F1B has one chunk per rank
        lambda: build_schedule_from_compute_order(2, 1, 1, [[Action(F, 0, 0)]], "short"),  # one rank list
        lambda: build_schedule_from_compute_order(1, 1, 1, [[Action(SF, 0, 0, peer=0)]]),
        lambda: build_schedule_from_compute_order(1, 1, 1, [[Action(F, 0, 5)]]),
        # rank 1 consumes microbatch 0 that rank 0 never produces
        lambda: build_schedule_from_compute_order(2, 1, 2, [[Action(F, 0, 1)], [Action(F, 0, 0)]]),
    ],
)
def test_impossible_inputs_raise_one_line_value_error(call):
    with pytest.raises(ValueError) as info:
        call()
    assert "\n" not in str(info.value)


def _peak_outstanding(actions) -> int:
    live = peak = 0
    for a in _computes(actions):
        live += 1 if a.kind is F else -1
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("pp,m", [(4, 8), (4, 2), (8, 3), (3, 16), (1, 5)])
def test_peak_activation_memory(pp, m):
    one_f_one_b, gpipe = build_1f1b_schedule(pp, m), build_gpipe_schedule(pp, m)
    for rank in range(pp):
        assert _peak_outstanding(one_f_one_b.actions[rank]) == min(pp - rank, m)
        assert _peak_outstanding(gpipe.actions[rank]) == m


def test_1f1b_middle_rank_steady_state_is_megatrons_pattern():
    schedule = build_1f1b_schedule(4, 8)
    actions = schedule.actions[1]  # warmup is 4-1-1 = 2, so steady state pairs F(i+2) with B(i)
    i, j = 1, 3
    expected = [
        Action(F, 0, j),
        Action(SF, 0, j, peer=2),
        Action(RB, 0, i, peer=2),
        Action(B, 0, i),
        Action(SB, 0, i, peer=0),
        Action(RF, 0, j + 1, peer=0),
        Action(F, 0, j + 1),
    ]
    start = actions.index(expected[0])
    assert list(actions[start : start + len(expected)]) == expected
    assert (start + 1, start + 3) in comm_batches(actions)
    assert (start + 4, start + 6) in comm_batches(actions)


def _c(kind, chunk, mb):
    return Action(kind, chunk, mb)


def test_interleaved_order_matches_hand_derivation():
    # P=2, V=2, M=4. Forward step k -> chunk (k//2)%2, mb (k//4)*2 + k%2; backward -> chunk 1 - that.
    # Rank 0 warmup = min(2*1 + 1*2, 8) = 4, rank 1 warmup = min(0 + 2, 8) = 2.
    f_steps = [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
    b_steps = [(1, 0), (1, 1), (0, 0), (0, 1), (1, 2), (1, 3), (0, 2), (0, 3)]
    assert f_steps == [((k // 2) % 2, (k // 4) * 2 + k % 2) for k in range(8)]
    rank0 = (
        [_c(F, 0, 0), _c(F, 0, 1), _c(F, 1, 0), _c(F, 1, 1)]
        + [_c(F, 0, 2), _c(B, 1, 0), _c(F, 0, 3), _c(B, 1, 1), _c(F, 1, 2), _c(B, 0, 0), _c(F, 1, 3), _c(B, 0, 1)]
        + [_c(B, 1, 2), _c(B, 1, 3), _c(B, 0, 2), _c(B, 0, 3)]
    )
    rank1 = (
        [_c(F, 0, 0), _c(F, 0, 1)]
        + [
            _c(F, 1, 0),
            _c(B, 1, 0),
            _c(F, 1, 1),
            _c(B, 1, 1),
            _c(F, 0, 2),
            _c(B, 0, 0),
            _c(F, 0, 3),
            _c(B, 0, 1),
            _c(F, 1, 2),
            _c(B, 1, 2),
            _c(F, 1, 3),
            _c(B, 1, 3),
        ]
        + [_c(B, 0, 2), _c(B, 0, 3)]
    )
    assert [(a.chunk, a.microbatch) for a in rank1 if a.kind is B] == b_steps
    schedule = build_interleaved_1f1b_schedule(2, 2, 4)
    assert _computes(schedule.actions[0]) == rank0
    assert _computes(schedule.actions[1]) == rank1


@pytest.mark.parametrize("pp,v,m", [(2, 2, 4), (4, 2, 8), (4, 3, 4), (8, 2, 16), (3, 4, 6), (4, 1, 8)])
def test_interleaved_warmup_length(pp, v, m):
    schedule = build_interleaved_1f1b_schedule(pp, v, m)
    for rank in range(pp):
        kinds = [a.kind for a in _computes(schedule.actions[rank])]
        leading = kinds.index(B)
        warmup = min(2 * (pp - rank - 1) + (v - 1) * pp, v * m)
        assert leading == (warmup + 1 if warmup < v * m else v * m)


def test_interleaved_steady_state_batches_like_megatron_core():
    # Rank 1 of P=4, V=2 holds stages 1 and 5: every compute both receives and sends.
    pp, v, m, rank = 4, 2, 8, 1
    actions = build_interleaved_1f1b_schedule(pp, v, m).actions[rank]
    steps = compute_interleaved_steps(pp, rank, v, m)
    pairs = [s for s in steps if isinstance(s, tuple)]
    assert pairs
    for (f, b), (next_f, next_b) in zip(pairs, pairs[1:]):
        at = actions.index(b)
        assert actions[at - 1] == f  # F and B back to back, no comm between them
        end = next(e for s, e in comm_batches(actions) if s == at + 1)
        got = {(a.kind, a.chunk, a.microbatch) for a in actions[at + 1 : end]}
        assert got == {
            (SF, f.chunk, f.microbatch),
            (SB, b.chunk, b.microbatch),
            (RF, next_f.chunk, next_f.microbatch),
            (RB, next_b.chunk, next_b.microbatch),
        }


def test_bubble_fractions_match_theory():
    for pp, m in [(2, 4), (4, 8), (4, 16), (8, 8), (3, 5)]:
        expected = (pp - 1) / (m + pp - 1)
        assert compute_bubble_fraction(build_gpipe_schedule(pp, m)) == pytest.approx(expected)
        assert compute_bubble_fraction(build_1f1b_schedule(pp, m)) == pytest.approx(expected)
    for pp, v, m in [(2, 2, 4), (4, 2, 8), (4, 4, 8), (8, 2, 16)]:
        interleaved = compute_bubble_fraction(build_interleaved_1f1b_schedule(pp, v, m))
        assert interleaved == pytest.approx((pp - 1) / (v * m + pp - 1))
        assert interleaved < compute_bubble_fraction(build_1f1b_schedule(pp, m))
    assert compute_bubble_fraction(build_1f1b_schedule(1, 4)) == 0.0


def _producer(a: Action, rank: int, pp: int) -> tuple[int, Action] | None:
    step = -1 if a.kind is F else +1
    s = virtual_stage(a.chunk, rank, pp) + step
    return None if s < 0 else (stage_location(s, pp)[0], Action(a.kind, stage_location(s, pp)[1], a.microbatch))


@pytest.mark.parametrize("name,pp,v,m", [("1f1b", 4, 1, 6), ("gpipe", 3, 1, 4), ("interleaved", 2, 3, 4)])
def test_timeline_respects_data_dependencies(name, pp, v, m):
    schedule = build_schedule(name, pp, v, m)
    ticks = simulate_schedule(schedule)
    start = {(r, a): t for r in range(pp) for a, t in zip(schedule.actions[r], ticks[r])}
    for (rank, a), t in start.items():
        if a.kind.is_comm:
            continue
        prod = _producer(a, rank, pp)
        if prod is not None and virtual_stage(prod[1].chunk, prod[0], pp) < pp * v:
            assert t >= start[prod] + compute_action_ticks(prod[1])
    for r in range(pp):  # one rank computes one thing at a time
        busy = sorted((t, compute_action_ticks(a)) for a, t in zip(schedule.actions[r], ticks[r]))
        assert all(t0 + d0 <= t1 for (t0, d0), (t1, _) in zip(busy, busy[1:]) if d0)


def test_timeline_ticks_by_hand():
    # Forward 1 tick, backward 2, a comm batch completes once both sides have posted.
    assert simulate_schedule(build_gpipe_schedule(1, 2)) == [[0, 1, 2, 4]]
    schedule = build_gpipe_schedule(2, 1)
    assert [list(map(str, a)) for a in schedule.actions] == [
        ["F(c0,m0)", "SF(c0,m0)->1", "RB(c0,m0)<-1", "B(c0,m0)"],
        ["RF(c0,m0)<-0", "F(c0,m0)", "B(c0,m0)", "SB(c0,m0)->0"],
    ]
    # Rank 0's SF and RB are one batch: it completes only when rank 1 posts SB at tick 4.
    assert simulate_schedule(schedule) == [[0, 4, 4, 4], [1, 1, 2, 4]]


def test_render_schedule_has_one_row_per_rank():
    text = render_schedule(build_gpipe_schedule(2, 2))
    lines = text.splitlines()
    assert len(lines) == 3
    assert lines[1].split("|")[1].split()[:2] == ["F0", "F1"]
    assert lines[2].split("|")[1].split()[:3] == [".", "F0", "F1"]


# ------------------------------------------------- custom orders and hoisting


def test_one_compute_steps_for_interleaved_are_made_deadlock_free():
    # Flattened into single-compute steps, lazy recvs would deadlock (see comm_placement.py);
    # the placement must hoist recvs until it runs.
    pp, v, m = 2, 2, 4
    orders = [
        [a for s in compute_interleaved_steps(pp, r, v, m) for a in (s if isinstance(s, tuple) else (s,))]
        for r in range(pp)
    ]
    validate_schedule(build_schedule_from_compute_order(pp, v, m, orders))


def _random_feasible_orders(rng: random.Random, pp: int, v: int, m: int) -> list[list[Action]]:
    """Project a random topological order of the global dependency graph onto the ranks."""
    stages = pp * v
    done: set[tuple[ActionKind, int, int]] = set()
    orders: list[list[Action]] = [[] for _ in range(pp)]

    def ready(kind, s, mb):
        if kind is F:
            return s == 0 or (F, s - 1, mb) in done
        return (F, s, mb) in done and (s == stages - 1 or (B, s + 1, mb) in done)

    todo = [(k, s, mb) for k in (F, B) for s in range(stages) for mb in range(m)]
    while todo:
        task = rng.choice([t for t in todo if ready(*t)])
        todo.remove(task)
        done.add(task)
        rank, chunk = stage_location(task[1], pp)
        orders[rank].append(Action(task[0], chunk, task[2]))
    return orders


def test_random_feasible_compute_orders_build_valid_schedules():
    rng = random.Random(1234)
    for _ in range(40):
        pp, v, m = rng.randint(2, 4), rng.randint(1, 3), rng.randint(1, 5)
        orders = _random_feasible_orders(rng, pp, v, m)
        schedule = build_schedule_from_compute_order(pp, v, m, orders)
        validate_schedule(schedule)
        assert [_computes(a) for a in schedule.actions] == orders


def test_cyclic_compute_orders_are_rejected():
    # Rank 0 waits for B(m0)'s gradient before it has sent F(m0) to rank 1.
    orders = [[Action(B, 0, 0), Action(F, 0, 0)], [Action(F, 0, 0), Action(B, 0, 0)]]
    with pytest.raises(ValueError, match="cycle"):
        build_schedule_from_compute_order(2, 1, 1, orders)


# ------------------------------------------------------- validator rejects


def test_rejects_dropped_recv():
    good = build_1f1b_schedule(4, 8)
    actions = list(good.actions[2])
    actions.remove(Action(RF, 0, 3, peer=1))
    bad = _with_rank(good, 2, actions)
    with pytest.raises(ScheduleError, match="input") as info:
        validate_schedule(bad)
    _assert_points_at(info.value, bad, 2, actions.index(Action(F, 0, 3)))


def test_rejects_swapped_fifo_order():
    good = build_gpipe_schedule(2, 3)
    actions = list(good.actions[0])
    assert actions[:4] == [Action(F, 0, 0), Action(SF, 0, 0, peer=1), Action(F, 0, 1), Action(SF, 0, 1, peer=1)]
    actions[:4] = [Action(F, 0, 0), Action(F, 0, 1), Action(SF, 0, 1, peer=1), Action(SF, 0, 0, peer=1)]
    bad = _with_rank(good, 0, actions)
    with pytest.raises(ScheduleError, match="FIFO") as info:
        validate_schedule(bad)
    _assert_points_at(info.value, bad, 0, 2)


def test_rejects_wrong_peer():
    good = build_1f1b_schedule(4, 4)
    actions = list(good.actions[1])
    i = actions.index(Action(SF, 0, 0, peer=2))
    actions[i] = Action(SF, 0, 0, peer=0)
    bad = _with_rank(good, 1, actions)
    with pytest.raises(ScheduleError, match="rank 2") as info:
        validate_schedule(bad)
    _assert_points_at(info.value, bad, 1, i)


def test_rejects_backward_before_forward():
    good = build_1f1b_schedule(2, 2)
    actions = list(good.actions[1])
    assert actions[:3] == [Action(RF, 0, 0, peer=0), Action(F, 0, 0), Action(B, 0, 0)]
    actions[1], actions[2] = actions[2], actions[1]
    bad = _with_rank(good, 1, actions)
    with pytest.raises(ScheduleError, match="before its own forward") as info:
        validate_schedule(bad)
    _assert_points_at(info.value, bad, 1, 1)


def test_rejects_duplicated_forward():
    good = build_gpipe_schedule(3, 4)
    actions = list(good.actions[0])
    i = actions.index(Action(F, 0, 2))
    actions.insert(i + 1, Action(F, 0, 2))
    bad = _with_rank(good, 0, actions)
    with pytest.raises(ScheduleError, match=f"twice \\(first at action {i}\\)") as info:
        validate_schedule(bad)
    _assert_points_at(info.value, bad, 0, i + 1)


def test_rejects_missing_backward_and_missing_send():
    good = build_1f1b_schedule(2, 3)
    no_backward = _with_rank(good, 0, [a for a in good.actions[0] if a != Action(B, 0, 2)])
    with pytest.raises(ScheduleError, match=r"pp rank 0, end of list: B\(c0,m2\) never runs"):
        validate_schedule(no_backward)
    actions = [a for a in good.actions[0] if a != Action(SF, 0, 1, peer=1)]
    no_send = _with_rank(good, 0, actions)
    with pytest.raises(ScheduleError, match="never sent") as info:
        validate_schedule(no_send)
    _assert_points_at(info.value, no_send, 0, actions.index(Action(F, 0, 1)))


def test_rejects_out_of_range_ids():
    good = build_gpipe_schedule(2, 2)
    bad = _with_rank(good, 1, good.actions[1] + (Action(F, 3, 0),))
    with pytest.raises(ScheduleError, match="chunk must be in") as info:
        validate_schedule(bad)
    _assert_points_at(info.value, bad, 1, len(good.actions[1]))


def test_rejects_deadlocking_reorder():
    # Both ranks post a recv, in its own batch, before the send the other one waits for.
    good = build_1f1b_schedule(2, 2)
    rank0 = [
        Action(F, 0, 0),
        Action(RB, 0, 0, peer=1),
        Action(F, 0, 1),
        Action(SF, 0, 0, peer=1),
        Action(SF, 0, 1, peer=1),
        Action(B, 0, 0),
        Action(RB, 0, 1, peer=1),
        Action(B, 0, 1),
    ]
    assert sorted(map(str, rank0)) == sorted(map(str, good.actions[0]))
    bad = _with_rank(good, 0, rank0)
    with pytest.raises(ScheduleError, match="deadlock") as info:
        validate_schedule(bad)
    _assert_points_at(info.value, bad, 0, 1)
    assert f"pp rank 1 at action 0 {bad.actions[1][0]}" in str(info.value)


def test_simulate_refuses_invalid_schedules():
    good = build_gpipe_schedule(2, 2)
    with pytest.raises(ScheduleError):
        simulate_schedule(_with_rank(good, 1, good.actions[1][1:]))


def test_validate_is_fast_for_large_schedules():
    schedule = build_interleaved_1f1b_schedule(16, 4, 64)
    start = time.process_time()  # CPU time, not wall: a loaded CI machine must not fail this
    validate_schedule(schedule)
    assert time.process_time() - start < 1.0
