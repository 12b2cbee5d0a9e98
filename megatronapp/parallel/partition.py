"""Which transformer layers each pipeline stage holds: even, Megatron's uneven first/last stage, or any list.

A partition is the number of layers of every virtual stage, in Megatron's virtual-stage order
v = chunk * PP + pp_rank; layers are laid out contiguously in that order, so virtual stage v holds
layers [sum(counts[:v]), sum(counts[:v + 1])). Worked example, 16 layers, PP 4, 2 virtual stages:

    even                      counts (2,2,2,2, 2,2,2,2)   pp 0 holds layers 0-1 and 8-9
    first 2, last 2           middle stages (16-2-2)/2 = 6 each -> per rank 2,6,6,2
                              -> per virtual stage (1,3,3,1, 1,3,3,1)
    --pipeline-stage-layers 3,5,4,4   -> one entry per pipeline rank, split over its chunks;
                              3 does not split over 2 chunks: give 8 per-virtual-stage counts instead

Everything here is pure: the engine, inference and the checks read the same numbers.
"""

from __future__ import annotations


class PartitionError(ValueError):
    """A layer partition that cannot work; the message says why in one line."""


def compute_stage_layers(
    num_layers: int,
    pp_size: int,
    vpp_size: int = 1,
    *,
    first: int | None = None,
    last: int | None = None,
    per_stage: tuple[int, ...] = (),
) -> tuple[int, ...]:
    """Layers per virtual stage (length PP x VPP, virtual-stage order).

    `per_stage` has one entry per pipeline rank (each split evenly over that rank's chunks) or one
    per virtual stage; otherwise `first` / `last` fix the first and last pipeline rank's layers
    (Megatron's --decoder-first/last-pipeline-num-layers) and the rest are split evenly.
    """
    stages = pp_size * vpp_size
    if per_stage:
        if first is not None or last is not None:
            raise PartitionError(
                "--pipeline-stage-layers cannot be combined with --decoder-first/last-pipeline-num-layers"
            )
        if len(per_stage) == stages:
            counts = tuple(per_stage)
        elif len(per_stage) == pp_size:
            counts = _per_rank_to_virtual(per_stage, vpp_size)
        else:
            raise PartitionError(
                f"--pipeline-stage-layers has {len(per_stage)} entries; give {pp_size} (one per pipeline rank)"
                + (f" or {stages} (one per virtual stage)" if vpp_size > 1 else "")
            )
    elif first is None and last is None:
        if num_layers % stages:
            raise PartitionError(
                f"num layers {num_layers} is not divisible by pipeline-parallel size {pp_size} x virtual stages {vpp_size}"
            )
        counts = (num_layers // stages,) * stages
    else:
        counts = _per_rank_to_virtual(_first_last_per_rank(num_layers, pp_size, first, last), vpp_size)
    return _checked(counts, num_layers)


def _first_last_per_rank(num_layers: int, pp_size: int, first: int | None, last: int | None) -> tuple[int, ...]:
    if pp_size < 2:
        raise PartitionError("--decoder-first/last-pipeline-num-layers need pipeline-parallel size >= 2")
    fixed = [n for n in (first, last) if n is not None]
    middle_ranks = pp_size - len(fixed)
    rest = num_layers - sum(fixed)
    if rest < 0 or (middle_ranks == 0 and rest != 0):
        raise PartitionError(f"first/last stage layers {fixed} do not fit {num_layers} layers on {pp_size} stages")
    if middle_ranks and rest % middle_ranks:
        raise PartitionError(
            f"the {rest} layers left after the first/last stages do not split evenly over {middle_ranks} stages"
        )
    per = rest // middle_ranks if middle_ranks else 0
    counts = [per] * pp_size
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return tuple(counts)


def _per_rank_to_virtual(per_rank: tuple[int, ...], vpp_size: int) -> tuple[int, ...]:
    for p, n in enumerate(per_rank):
        if n % vpp_size:
            raise PartitionError(
                f"pipeline rank {p}'s {n} layers do not split over {vpp_size} virtual stages; "
                "give one count per virtual stage"
            )
    return tuple(n // vpp_size for _ in range(vpp_size) for n in per_rank)


def _checked(counts: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    if any(n < 1 for n in counts):
        raise PartitionError(f"every pipeline stage needs at least one layer, got {list(counts)}")
    if sum(counts) != num_layers:
        raise PartitionError(f"stage layers {list(counts)} add up to {sum(counts)}, not num layers {num_layers}")
    return counts


def compute_chunk_layer_ranges(stage_layers: tuple[int, ...], pp_size: int) -> list[list[tuple[int, int]]]:
    """[pp_rank][chunk] -> (first, last) layer range of a partition from `compute_stage_layers`."""
    starts = [0]
    for n in stage_layers:
        starts.append(starts[-1] + n)
    vpp = len(stage_layers) // pp_size
    return [[(starts[c * pp_size + p], starts[c * pp_size + p + 1]) for c in range(vpp)] for p in range(pp_size)]


def is_even(stage_layers: tuple[int, ...]) -> bool:
    return len(set(stage_layers)) <= 1
