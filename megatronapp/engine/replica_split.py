"""Uneven microbatch counts per data-parallel replica for the same global batch, exactly.

Balanced, each of the DP replicas runs M microbatches. Under a split, replica r runs m_r of them
(sum of m_r = DP x M) and takes the global batch's samples in rank order: replica 0 the first
m_0 microbatches' worth, replica 1 the next m_1, ... (data/dataset.py compute_replica_sample_range),
so the step trains the same set of samples, each at its same position (its dropout masks too).

Where the gradients are normalised does not move: each microbatch's mean loss is still divided by
M, not by m_r (pipeline/runtime.py StageCompute's loss_microbatches), and the DP all-reduce still
averages over DP (engine/grads.py). So every sample weighs 1 / (DP x M) in the reduced gradient,
as in the balanced run, and the gradient equals the balanced run's up to the order of the sums;
the reported loss (the DP mean of the replicas' sums) is the global batch's mean as before. The
distributed optimizer sees the same reduced buffers and is unaffected. A per-replica mean (dividing
by m_r) would weigh replica r's samples by M / m_r instead: a different, wrong gradient.
"""

from __future__ import annotations

# schedules that run microbatches in groups of pp_size (pipeline/schedules.py)
GROUPED_SCHEDULES = ("interleaved", "interleaved-zb")


def compute_microbatch_granule(schedule: str, pp_size: int) -> int:
    """The step in which a replica's microbatch count may change under `schedule`: the interleaved
    schedules need each replica's count to be a multiple of the pipeline size."""
    return pp_size if schedule in GROUPED_SCHEDULES else 1


def check_replica_microbatches(
    split: tuple[int, ...], dp_size: int, num_microbatches: int, granule: int = 1
) -> tuple[int, ...]:
    """`split` as a tuple of ints when every replica runs at least `granule` microbatches, a
    multiple of it, and all of them add up to the balanced total; else ValueError (one line)."""
    split = tuple(int(m) for m in split)
    total = dp_size * num_microbatches
    if len(split) != dp_size:
        raise ValueError(f"a microbatch split needs one count per data-parallel replica ({dp_size}), got {split}")
    if sum(split) != total:
        raise ValueError(f"microbatch split {split} adds up to {sum(split)}, the global batch holds {total}")
    if min(split) < granule or any(m % granule for m in split):
        what = "at least 1" if granule == 1 else f"a multiple of {granule} (the interleaved schedules' groups)"
        raise ValueError(f"microbatch split {split}: each replica must run {what}")
    return split


def compute_first_microbatch(split: tuple[int, ...], dp_rank: int) -> int:
    """Index in the global batch of replica `dp_rank`'s first microbatch."""
    return sum(split[:dp_rank])


def check_job_split(job, split: tuple[int, ...]) -> tuple[int, ...]:
    """check_replica_microbatches for `job`'s data-parallel size, batch and schedule."""
    granule = compute_microbatch_granule(job.train.schedule, job.layout.pp_size)
    return check_replica_microbatches(split, job.layout.dp_size, job.num_microbatches, granule)
