"""Layer partitions: even, Megatron's uneven first/last stage, explicit lists; pure arithmetic."""

from __future__ import annotations

import pytest

from megatronapp.parallel.partition import PartitionError, compute_chunk_layer_ranges, compute_stage_layers


def test_even_split_is_megatrons_interleaved_assignment():
    counts = compute_stage_layers(16, 4, 2)
    assert counts == (2,) * 8
    ranges = compute_chunk_layer_ranges(counts, 4)
    assert ranges[0] == [(0, 2), (8, 10)]  # pp rank 0 holds virtual stages 0 and 4
    assert ranges[3] == [(6, 8), (14, 16)]


def test_first_and_last_stage_layers_leave_the_rest_even():
    assert compute_stage_layers(16, 4, first=2, last=2) == (2, 6, 6, 2)
    assert compute_stage_layers(16, 4, first=1) == (1, 5, 5, 5)
    # with virtual stages each rank's layers are split over its chunks, rank order inside each chunk
    assert compute_stage_layers(16, 4, 2, first=2, last=2) == (1, 3, 3, 1, 1, 3, 3, 1)


def test_explicit_lists_per_rank_or_per_virtual_stage():
    assert compute_stage_layers(16, 4, per_stage=(3, 5, 4, 4)) == (3, 5, 4, 4)
    assert compute_stage_layers(6, 2, 2, per_stage=(1, 2, 2, 1)) == (1, 2, 2, 1)
    ranges = compute_chunk_layer_ranges((1, 2, 2, 1), 2)
    assert ranges == [[(0, 1), (3, 5)], [(1, 3), (5, 6)]]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"per_stage": (3, 5, 4)}, "has 3 entries"),
        ({"per_stage": (3, 5, 4, 5)}, "add up to 17"),
        ({"per_stage": (0, 8, 4, 4)}, "at least one layer"),
        ({"first": 3}, "do not split evenly"),
        ({"first": 10, "last": 10}, "do not fit"),
        ({"first": 2, "per_stage": (4, 4, 4, 4)}, "cannot be combined"),
    ],
)
def test_partitions_that_cannot_work_are_refused_in_one_line(kwargs, message):
    with pytest.raises(PartitionError, match=message) as err:
        compute_stage_layers(16, 4, **kwargs)
    assert "\n" not in str(err.value)


def test_a_rank_whose_layers_do_not_split_over_its_chunks_is_refused():
    with pytest.raises(PartitionError, match="do not split over 2 virtual stages"):
        compute_stage_layers(16, 4, 2, per_stage=(3, 5, 4, 4))
