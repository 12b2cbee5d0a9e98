"""The detector's thresholds and verdict rules (DetectConfig, is_*), and what it returns (Suspect,
DetectionReport): the algorithm they belong to is in detect.py's docstring."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist

from megatronapp.flags import Flag
from megatronapp.scan.analyze import detect_arrival as arrivals
from megatronapp.scan.analyze import detect_links as p2p
from megatronapp.scan.analyze import detect_rules as rules

CAUSES = ("slow_compute", "slow_link")


class DetectInputError(ValueError):
    """Traces that cannot be analysed together; the message names the file."""


def is_constant(stats: rules.ComputeStats, config: DetectConfig) -> bool:
    """Slow in most iterations: median ratio, consistency and robust z above their bars."""
    edge = stats.basis == "pipeline_stages" and stats.edge_stage
    threshold = config.compute_min_ratio * (config.edge_stage_allowance if edge else 1.0)
    return (
        stats.ratio >= threshold
        and stats.consistency >= config.compute_min_consistency
        and stats.z >= config.compute_min_z
    )


def is_intermittent(stats: rules.ComputeStats, config: DetectConfig) -> bool:
    """Slow in a subset of iterations that a clean run produces with probability <= intermittent_alpha
    (detect_intermittent.py: the p-value covers every rank and subset size tried), slower there
    than its peers (not only than its usual self) at the same significance, and by a ratio worth
    naming (>= intermittent_min_ratio) both against its peers and against its own compute in the
    other iterations (a victim's ratio moves only because its peers' compute did)."""
    it = stats.intermittent
    return (
        it is not None
        and len(it.slow_iterations) >= config.intermittent_min_iterations
        and it.p_value <= config.intermittent_alpha
        and it.slow_z >= NormalDist().inv_cdf(1.0 - config.intermittent_alpha)
        and min(it.slow_ratio, it.self_ratio) >= config.intermittent_min_ratio
    )


def is_slow_compute(stats: rules.ComputeStats, config: DetectConfig) -> bool:
    """Default compute rule (see the module docstring, step 1): constant or intermittent."""
    return stats.samples >= config.min_samples and (is_constant(stats, config) or is_intermittent(stats, config))


def is_late_by_own_work(stats: arrivals.ArrivalStats, config: DetectConfig) -> bool:
    """Default arrival rule (module docstring, step 2): the compute bars on own work before arrival."""
    return arrivals.is_arrival_straggler(
        stats,
        min_samples=config.min_samples,
        min_excess_share=config.arrival_min_excess_share,
        min_ratio=config.compute_min_ratio,
        min_consistency=config.compute_min_consistency,
        min_z=config.compute_min_z,
        min_lateness_ns=config.arrival_min_lateness_ns,
    )


def is_slow_link(stats: p2p.LinkStats, config: DetectConfig) -> bool:
    """Default link rule (see the module docstring, step 3)."""
    return (
        stats.samples >= config.min_samples
        and stats.ratio >= config.link_min_ratio
        and stats.excess_ns >= config.link_min_excess_ns
        and stats.consistency >= config.link_min_consistency
    )


@dataclass(frozen=True)
class DetectConfig:
    """Thresholds of the detector. Margins are wide on purpose: 8 ranks of a tiny model on a
    2-core CPU showed per-span jitter of 0.1x-10x, fault-free DP replicas 1.22x apart in median
    (>= 1.2x in 3 of 5 iterations) and fault-free p2p links with medians of 0.2-2.1 ms, so
    verdicts rest on medians and on consistency across iterations."""

    compute_min_ratio: float = 1.2  # rank / peer median of pure compute
    compute_min_consistency: float = 0.7  # share of iterations whose median ratio reaches compute_min_ratio
    compute_min_z: float = 3.0  # robust significance of the median log-ratio
    strong_compute_ratio: float = 1.5  # ratio at which the effect size saturates
    intermittent_alpha: float = 0.005  # bound on the chance that a clean run names anybody intermittently slow
    # (noise model: detect_intermittent.py). At 0.02 the model predicts ~1 false alarm in 50 clean runs, and
    # heldout2 had exactly one (p = 0.0067); at 0.005, P(any in 50) <= 22%. 0.002 (<= 9.5%) lost a DDP rank
    # 2x slow in every 3rd iteration (p = 0.0033) on the design runs; 0.005 keeps it
    intermittent_max_share: float = 0.5  # of iterations: slower in more of them is a constant slowdown
    intermittent_min_iterations: int = 2
    intermittent_min_ratio: float = 1.1  # to its peers in the slow iterations: smaller is not worth naming
    intermittent_min_saving: float = 0.01  # of the mean iteration, by the what-if: an intermittent suspect whose
    # fix would save less is noise, not a straggler worth a user's time. Clean CPU runs show such noise: the
    # README demo's TP2xPP2 run, 1.14x in 4 of 119 iterations (p = 0.0021), saving 0.02%; a clean PP4 run of
    # 300 iterations, its last stage 1.28x in 23 of 299 (p = 0.00015), saving 0.4%. Real bursts (300 ms of a
    # CPU quota or a competing process every 1-2 s) slow whole iterations 2-4x
    edge_stage_allowance: float = 1.3  # cross-stage only: first/last stages carry embedding/head/loss work
    # (measured 1.19x on a fault-free 4-stage CPU run), so they need compute_min_ratio x this
    min_samples: int = 4
    cold_idle_ns: int = 3_000_000  # a rank idle this long computes slower for a while (detect_rules: cold span);
    # on the 2-core VM a 1 ms matmul chain is 1.04x after a 1 ms sleep, 1.3x after 5 ms, 1.5x after 45 ms
    cold_recovery_ns: int = 3_000_000  # ... and is back to 1.1x / 1.0x in its 2nd / 3rd ms of work
    link_min_ratio: float = 2.0  # link transfer / peer links' median
    link_min_excess_ns: int = 2_000_000  # and this much slower: CPU p2p medians jitter by ~1-2 ms
    link_min_consistency: float = 0.5  # of messages: a delay hides behind a sender later than it
    link_peer_quantile: float = 0.9  # a slow message must also beat this quantile of peer links' messages
    strong_link_ratio: float = 3.0
    straggler_min_share: float = 0.6  # share of last arrivals that corroborates a slow rank
    arrival_min_excess_share: float = 0.3  # of the waiting at its collectives, the share a rank caused beyond a
    # fair one (1 / members), as a fraction of what lies above a fair share: with own-work evidence, names it; at
    # least 1.5x a fair share too (detect_arrival.py). Needs 0.75 at dp2 and 0.475 at dp4: a flat 0.6 missed an
    # FSDP2 dp4 straggler 1.3x slow per iteration (1.9x its peers' own work in 93% of iterations, 55% of the
    # waiting: FSDP2 meets ~11 times an iteration and only the first meeting sees the data step, so the jitter
    # of the other ten dilutes its share)
    arrival_min_lateness_ns: int = 1_000_000  # median lead of its peers' arrival over its own
    warmup_iterations: int = 1  # iterations with a smaller index are skipped (no explicit range)
    iterations: tuple[int, int] | None = None  # half-open [A, B); None: all, warm-up skipped
    min_impact: float = 0.05  # of the iteration: a suspect whose fix saves less is listed as a candidate, not named
    ambiguity_tolerance: float = 0.1  # two related suspects whose savings agree this closely explain the same time
    probe_agree_ratio: float = 0.5  # a trace's slow link is confirmed by a probe measuring it below this share of
    # its comparable links' bandwidth; below probe.SLOW_FRACTION a measured link is named whatever it costs
    descheduled_min_ratio: float = 2.5  # a rank the rules missed is named by its measured run-queue delay when that
    # is this many times its peers' (measured_ranks.py): ranks sharing cores all wait for CPU, ~1.2-2x each other
    burst_min_ns: int = 2_000_000  # an iteration's run-queue delay this far above its peers' is a burst ...
    burst_min_share: float = 0.1  # ... and this share of their iteration (measured_intermittent.py)
    burst_min_lead: float = 2.5  # a rank's bursts are a fault when they cost the job this many times any other
    # rank's. On the 2-core machine's design runs, the faults only this rule found led by 4.6-27x, clean and noisy
    # runs of 300 iterations by 1.1x (2.5x once, at 0.5% of the iteration: intermittent_min_saving drops it), and
    # the pipeline neighbour of a stage slowed in bursts by 2.2x
    burst_min_iterations: int = 20  # bursts a lead rests on: in runs of 19 iterations a clean rank's 6-9
    # bursts, a few stalls of 10-18 ms, led the others' by 1.5-2.2x, and under background noise a replica the
    # scheduler kept beside a busy loop burst in 15 and led by 3.4x; faults of 300 ms every 1-2 s burst in 45+
    compute_rule: Callable[[rules.ComputeStats, DetectConfig], bool] = is_slow_compute
    link_rule: Callable[[p2p.LinkStats, DetectConfig], bool] = is_slow_link
    arrival_rule: Callable[[arrivals.ArrivalStats, DetectConfig], bool] = is_late_by_own_work

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_impact <= 1.0:
            raise ValueError(f"--min-impact must be a share of the iteration in [0, 1], got {self.min_impact}")
        for name in (
            "compute_min_ratio",
            "strong_compute_ratio",
            "link_min_ratio",
            "strong_link_ratio",
            "edge_stage_allowance",
            "intermittent_min_ratio",
            "descheduled_min_ratio",
            "burst_min_lead",
        ):
            if getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be >= 1.0 (a ratio to the peers' median), got {getattr(self, name)}")
        for name in (
            "compute_min_consistency",
            "link_min_consistency",
            "link_peer_quantile",
            "straggler_min_share",
            "intermittent_max_share",
            "intermittent_min_saving",
            "arrival_min_excess_share",
            "ambiguity_tolerance",
            "probe_agree_ratio",
            "burst_min_share",
        ):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be a fraction in [0, 1], got {getattr(self, name)}")
        if not 0.0 < self.intermittent_alpha < 0.5:
            raise ValueError(f"intermittent_alpha must be a probability in (0, 0.5), got {self.intermittent_alpha}")
        if (
            self.min_samples < 1
            or self.warmup_iterations < 0
            or self.link_min_excess_ns < 0
            or self.cold_idle_ns < 0
            or self.cold_recovery_ns < 0
            or self.burst_min_ns < 0
            or self.burst_min_iterations < 1
        ):
            raise ValueError(
                "min_samples and burst_min_iterations must be >= 1; "
                "warmup_iterations, link_min_excess_ns, cold_* and burst_min_ns >= 0"
            )
        if self.iterations is not None and self.iterations[1] <= self.iterations[0]:
            raise ValueError(f"iteration range {self.iterations[0]}:{self.iterations[1]} is empty; give A:B with B > A")


@dataclass(frozen=True)
class Suspect:
    """One root-cause candidate. For a slow link, rank is the link's source (convention)."""

    rank: int
    coords: dict
    cause: str  # one of CAUSES
    confidence: float  # 0..1
    evidence: dict  # numbers plus a one-line "summary"
    link: tuple[int, int] | None = None
    iteration_ns: float = 0.0  # median iteration time (critical path); the mean for an intermittent suspect
    what_if_iteration_ns: float = 0.0  # the same, estimated were the suspect as fast as its peers

    @property
    def saving_ns(self) -> float:
        return self.iteration_ns - self.what_if_iteration_ns


@dataclass(frozen=True)
class DetectionReport:
    suspects: tuple[Suspect, ...]  # most likely first
    iterations_analyzed: tuple[int, ...]
    iteration_ns: float  # median iteration time over the analysed iterations
    iteration_mean_ns: float  # their mean (what an intermittent suspect's what-if is compared with)
    what_if_all_fixed_ns: float  # all suspects fixed at once (savings added up)
    world_size: int
    layout: dict
    victims: tuple[tuple[int, float], ...]  # (rank, wait ns per iteration) of non-suspects, when suspects exist
    notes: tuple[str, ...]
    # Ranks whose iterations could not be joined to the others' (no shared collective or message):
    # a report without suspects must not read as if they had been compared (iteration_keys.py).
    unjoined_ranks: tuple[int, ...] = ()
    # Every judged p2p link as a slow-link candidate with its what-if, named or not: what the link
    # probe's verdicts draw on (link_probe_verdicts.py).
    link_candidates: tuple[Suspect, ...] = ()
    min_impact: float = 0.0  # the impact gate applied (impact_gate.py); 0: none
    below_impact: tuple[Suspect, ...] = ()  # suspects the gate did not name, largest saving first
    ambiguous: tuple[str, ...] = ()  # pairs of suspects that explain the same time, in words
    links_measured: tuple[dict, ...] = ()  # the probe's links: src, dst, kind, mbytes_per_s, peer_mbytes_per_s, ratio


# The detector's flags (`trace detect`, and the detection at the end of `train --trace` and `trace run`)
DETECT_FLAGS = (
    Flag(
        "--min-impact",
        "min_impact",
        "name a suspect only when fixing it would save at least this share of the iteration",
        {"metavar": "SHARE"},
    ),
)
