"""parallel/layout.py's rank arithmetic in one process: Megatron's worked example, exactly, and
invariants checked by brute force over every layout of world sizes 1..64."""

from __future__ import annotations

import itertools

import pytest

from megatronapp.parallel.layout import LayoutError, ParallelLayout, RankCoords


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def all_layouts(max_world: int = 64):
    """Every (world, TP, PP) with TP x PP dividing the world."""
    for world in range(1, max_world + 1):
        for tp in divisors(world):
            for pp in divisors(world // tp):
                yield ParallelLayout(world, tp, pp)


LAYOUTS = list(all_layouts())


def test_megatron_worked_example():
    """Megatron-LM's initialize_model_parallel docstring: 16 GPUs, TP 2, PP 4 (so DP 2) make
    these groups (compared as sets: the order of the groups is not part of the contract)."""
    layout = ParallelLayout(16, tp_size=2, pp_size=4)
    as_set = lambda groups: {tuple(g) for g in groups}
    assert layout.dp_size == 2
    assert as_set(layout.tp_group_ranks()) == {(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11), (12, 13), (14, 15)}
    assert as_set(layout.dp_group_ranks()) == {(0, 2), (1, 3), (4, 6), (5, 7), (8, 10), (9, 11), (12, 14), (13, 15)}
    assert as_set(layout.pp_group_ranks()) == {(0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15)}
    assert layout.coords(13) == RankCoords(tp=1, dp=0, pp=3) and layout.rank_of(tp=1, dp=0, pp=3) == 13


def test_module_docstring_example():
    layout = ParallelLayout(8, tp_size=2, pp_size=2)
    table = [(c.tp, c.dp, c.pp) for c in map(layout.coords, range(8))]
    assert [t[0] for t in table] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert [t[1] for t in table] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [t[2] for t in table] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert layout.model_parallel_group_ranks() == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_every_layout_up_to_world_64_was_generated():
    assert len(LAYOUTS) == sum(sum(len(divisors(w // t)) for t in divisors(w)) for w in range(1, 65))
    assert {(l.world_size, l.tp_size, l.pp_size) for l in LAYOUTS} >= {(64, 8, 4), (60, 3, 5), (1, 1, 1)}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"w{l.world_size}-tp{l.tp_size}-pp{l.pp_size}")
def test_rank_arithmetic_invariants(layout: ParallelLayout):
    tp, dp, pp, world = layout.tp_size, layout.dp_size, layout.pp_size, layout.world_size
    assert tp * dp * pp == world
    coords = [layout.coords(r) for r in range(world)]
    # coords and rank_of are inverse, and Megatron's order: tp fastest, then dp, then pp
    for r, c in enumerate(coords):
        assert layout.rank_of(c.tp, c.dp, c.pp) == r == c.tp + c.dp * tp + c.pp * tp * dp
    assert {(c.tp, c.dp, c.pp) for c in coords} == set(itertools.product(range(tp), range(dp), range(pp)))

    # each family of groups partitions the world; members agree on the other two coordinates
    # and list their own coordinate 0, 1, 2, ... in order
    for groups, size, axis in (
        (layout.tp_group_ranks(), tp, "tp"),
        (layout.dp_group_ranks(), dp, "dp"),
        (layout.pp_group_ranks(), pp, "pp"),
    ):
        assert sorted(r for g in groups for r in g) == list(range(world))
        assert len(groups) == world // size and all(len(g) == size for g in groups)
        for g in groups:
            assert [getattr(coords[r], axis) for r in g] == list(range(size))
            others = {tuple(v for k, v in coords[r].as_dict().items() if k != axis) for r in g}
            assert len(others) == 1

    replicas = layout.model_parallel_group_ranks()  # one full model each: all tp x pp of one dp
    assert len(replicas) == dp and sorted(r for g in replicas for r in g) == list(range(world))
    for d, g in enumerate(replicas):
        assert len(g) == tp * pp and {coords[r].dp for r in g} == {d}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(world_size=0), "world_size must be >= 1"),
        (dict(world_size=8, tp_size=3), "not divisible by tensor-parallel size 3 x pipeline-parallel size 1"),
        (dict(world_size=8, tp_size=2, pp_size=8), "not divisible"),
        (dict(world_size=4, virtual_pp_size=2), "virtual pipeline stages need pipeline-parallel size >= 2"),
        (dict(world_size=4, pp_size=0), "pp_size must be >= 1"),
    ],
)
def test_impossible_layouts_are_refused_in_one_line(kwargs, message):
    with pytest.raises(LayoutError, match=message) as refused:
        ParallelLayout(**kwargs)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("rank", [-1, 8, 100])
def test_rank_outside_the_world_is_refused(rank):
    with pytest.raises(LayoutError, match=f"rank {rank} outside world of size 8"):
        ParallelLayout(8, 2, 2).coords(rank)
