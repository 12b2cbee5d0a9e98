"""Intermittent slowdowns outside the compute spans (detect_intermittent_arrival.py).

A rank whose CPU is taken away in bursts (a cgroup quota or a competing process switched on and
off) is frozen wherever it is, mostly between its spans: the simulated rank stalls outside every
span, before its DP gradient reduce (or the model-parallel grad-norm where there is no DP), for
2 consecutive iterations of every 10, while its forward/backward spans are untouched. Traces come
from tests/scan_simulation.py on a loaded host, 80 iterations (the lab's intermittent jobs run 300).
"""

from __future__ import annotations

import numpy as np
import pytest
from scan_simulation import SimulatedJob, simulate_job_traces

from megatronapp.scan.analyze.detect import detect
from megatronapp.scan.analyze.detect_arrival import ArrivalSample
from megatronapp.scan.analyze.detect_intermittent_arrival import (
    build_own_work_streams,
    compare_own_work_intermittent,
    compute_slow_iteration_excess,
)

LOADED = dict(noise=0.15, hiccup_prob=0.05, rank_bias=0.05, iterations=80)
BURSTS = dict(slow_rank=1, stall_ns=20_000_000, slow_every=10, slow_burst=2)  # ~0.7 of a clean iteration
LAYOUTS = {
    "TP2xDP2": dict(tp_size=2, dp_size=2),
    "PP2xDP2": dict(pp_size=2, dp_size=2),
    "TP2xPP2": dict(tp_size=2, pp_size=2),
    "PP4": dict(pp_size=4),
}


def _sample(rank: int, it: int, own_ms: float, peer_ms: float, family: str = "dp", group: str = "g") -> ArrivalSample:
    return ArrivalSample(rank, family, group, it, it, int(own_ms * 1e6), peer_ms * 1e6, 0.0, False, 0.0)


def test_own_work_streams_sum_an_iteration_and_prefer_groups_of_identical_work():
    samples = [
        _sample(0, 1, 3, 4),
        _sample(0, 1, 2, 4),
        _sample(1, 1, 4, 5),
        _sample(0, 1, 9, 9, "pp", "p"),
        _sample(2, 1, 7, 7, "pp", "p"),
    ]
    spans, peers = build_own_work_streams(samples)
    assert [(s.key, s.pure_ns) for s in spans[0]] == [((1, -1, 0, "own_work:dp"), 5_000_000)]  # pp left out
    assert [s.key[3] for s in spans[2]] == ["own_work:pp"]  # a rank with no DP/TP group keeps what it has
    assert peers == {0: (1,), 1: (0,), 2: ()}
    assert compute_slow_iteration_excess(samples, 0, (1,)) == {1: pytest.approx(-3e6 + 3e6)}


def test_a_rank_whose_own_work_rises_in_bursts_has_a_small_p_value_and_its_peers_do_not():
    rng, samples = np.random.default_rng(0), []
    for it in range(1, 81):
        for rank in range(4):
            own = 10.0 * rng.lognormal(0.0, 0.1) * (2.0 if rank == 2 and it % 10 < 2 else 1.0)
            samples.append(_sample(rank, it, own, 10.0))
    stats = compare_own_work_intermittent(samples)
    assert stats[2].p_value < 1e-6 and set(stats[2].slow_iterations) <= {i for i in range(1, 81) if i % 10 < 2}
    assert all(stats[r].p_value > 0.005 for r in (0, 1, 3))
    assert compute_slow_iteration_excess(samples, 2, (10,))[10] > 5e6


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_rank_frozen_between_its_spans_in_bursts_is_named(name):
    """Its spans are untouched, so span evidence alone names nobody (the detector before own-work
    evidence): the rank must be named in >= 2 of 3 runs, intermittent, and nobody else."""
    runs = [
        detect(simulate_job_traces(SimulatedJob(**LAYOUTS[name], **LOADED, **BURSTS, seed=5000 + seed)))
        for seed in range(3)
    ]
    named = [[s.rank for s in r.suspects] for r in runs]
    assert all(n in ([], [1]) for n in named), named
    assert sum(n == [1] for n in named) >= 2, named
    s = next(r.suspects[0] for r in runs if r.suspects)
    assert s.evidence["intermittent"] and s.evidence["basis"] == "arrival_order"
    assert "own work before its collectives" in s.evidence["summary"] and s.saving_ns > 0


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_clean_long_runs_on_a_loaded_host_name_nobody(name):
    for seed in range(3):
        report = detect(simulate_job_traces(SimulatedJob(**LAYOUTS[name], **LOADED, seed=6000 + seed)))
        assert report.suspects == (), (seed, [s.evidence["summary"] for s in report.suspects])
