"""Zero-bubble schedules (pipeline/zero_bubble.py) and the validator's I/W rules: valid over many
shapes, at 1F1B's memory, mutations rejected in one line, and the same gradients as one process."""

from __future__ import annotations

import pytest
from test_runtime_schedules import NUM_LAYERS, assert_schedules_match_single_process

from megatronapp.pipeline.actions import Action, ActionKind, PipelineSchedule
from megatronapp.pipeline.schedules import build_schedule
from megatronapp.pipeline.validate import ScheduleError, validate_schedule
from megatronapp.pipeline.zero_bubble import compute_peak_live

F, B, I, W = (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)


def _shapes():
    for pp in range(1, 9):
        for m in range(1, 17):
            yield "zb-h1", "1f1b", pp, 1, m
            if m % pp == 0:
                for v in range(1, 4):
                    yield "interleaved-zb", "interleaved", pp, v, m


def test_zero_bubble_schedules_validate_at_their_base_memory():
    count = 0
    for name, base_name, pp, v, m in _shapes():
        schedule, base = build_schedule(name, pp, v, m), build_schedule(base_name, pp, v, m)
        validate_schedule(schedule)
        for rank in range(pp):
            kinds = [a.kind for a in schedule.actions[rank]]
            assert B not in kinds and kinds.count(I) == kinds.count(W) == v * m
            computes = [a for a in schedule.actions[rank] if not a.kind.is_comm]
            base_computes = [a for a in base.actions[rank] if not a.kind.is_comm]
            assert compute_peak_live(computes) <= compute_peak_live(base_computes), (name, pp, v, m, rank)
            # the forwards and input gradients keep the base order
            assert [(a.kind is F, a.chunk, a.microbatch) for a in computes if a.kind is not W] == [
                (a.kind is F, a.chunk, a.microbatch) for a in base_computes
            ]
        count += 1
    assert count > 150


def test_last_rank_of_zb_h1_runs_each_w_right_after_its_input_gradient():
    # memory rule: the last rank holds one activation set in 1F1B, so W(m) must free it before F(m+1)
    computes = [a for a in build_schedule("zb-h1", 4, 1, 8).actions[3] if not a.kind.is_comm]
    assert [f"{a.kind.value}{a.microbatch}" for a in computes[:6]] == ["F0", "I0", "W0", "F1", "I1", "W1"]


def _with_rank(schedule: PipelineSchedule, rank: int, actions) -> PipelineSchedule:
    lists = list(schedule.actions)
    lists[rank] = tuple(actions)
    return PipelineSchedule(schedule.pp_size, schedule.num_chunks, schedule.num_microbatches, tuple(lists))


def _one_line(err: ScheduleError) -> str:
    assert "\n" not in str(err)
    return str(err)


def test_rejects_w_before_its_input_gradient():
    good = build_schedule("zb-h1", 2, 1, 4)
    actions = list(good.actions[1])
    w = actions.index(Action(W, 0, 0))
    moved = actions[:w] + actions[w + 1 :]
    moved.insert(moved.index(Action(I, 0, 0)), Action(W, 0, 0))
    with pytest.raises(ScheduleError, match="W before its I") as info:
        validate_schedule(_with_rank(good, 1, moved))
    assert _one_line(info.value).startswith("pp rank 1, action")


def test_rejects_w_after_the_optimizer_step():
    # the list is one step; a W missing from it would run after the optimizer update
    good = build_schedule("interleaved-zb", 2, 2, 4)
    actions = [a for a in good.actions[0] if a != Action(W, 1, 3)]
    with pytest.raises(ScheduleError, match="never runs before the optimizer step") as info:
        validate_schedule(_with_rank(good, 0, actions))
    assert "W(c1,m3)" in _one_line(info.value)


def test_rejects_whole_and_split_backward_of_one_microbatch():
    good = build_schedule("zb-h1", 1, 1, 2)
    actions = list(good.actions[0]) + [Action(B, 0, 1)]
    with pytest.raises(ScheduleError, match="its backward already ran"):
        validate_schedule(_with_rank(good, 0, actions))


@pytest.mark.parametrize("pp", [2, 4])
def test_zero_bubble_schedules_match_single_process(cluster, pp):
    combos = [("zb-h1", 1, m) for m in (1, 3, 2 * pp)] + [("interleaved-zb", 2, m) for m in (pp, 2 * pp)]
    assert NUM_LAYERS % (2 * pp) == 0
    assert_schedules_match_single_process(cluster, pp, combos)


def test_split_backward_config_is_resolved_from_the_schedule_and_refused_in_one_line():
    from megatronapp.config import ConfigError, TrainConfig

    assert TrainConfig(schedule="zb-h1").uses_split_backward()
    assert TrainConfig(schedule="dynamic").uses_split_backward()
    assert not TrainConfig(schedule="dynamic", compile=True).uses_split_backward()
    assert not TrainConfig(schedule="1f1b").uses_split_backward()
    assert TrainConfig(schedule="1f1b", split_backward=True).uses_split_backward()
    with pytest.raises(ConfigError, match="needs the split backward"):
        TrainConfig(schedule="interleaved-zb", split_backward=False)
    with pytest.raises(ConfigError, match="--compile cannot be combined") as info:
        TrainConfig(schedule="zb-h1", compile=True)
    assert "\n" not in str(info.value)
