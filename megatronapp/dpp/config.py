"""MegaDPP settings: the frozen config, its flags and the jitter-injection spec."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatronapp.dpp.policies import TRAVERSALS
from megatronapp.dpp.rebalance import RebalanceConfig
from megatronapp.flags import Flag
from megatronapp.p2p.outbox import spare_core_per_rank


class DppConfigError(ValueError):
    """A bad MegaDPP flag; the message is one line."""


@dataclass(frozen=True)
class JitterSpec:
    """Compute tasks on global rank `rank` take a factor drawn uniformly from [1, max_factor]."""

    rank: int
    max_factor: float
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise DppConfigError(f"--inject-jitter rank must be >= 0, got {self.rank}")
        if self.max_factor < 1.0:
            raise DppConfigError(f"--inject-jitter MAXFACTOR must be >= 1, got {self.max_factor}")


SEND_THREAD = ("auto", "on", "off")


def resolve_send_thread(setting: str, cores: int, local_ranks: int, threads_per_rank: int) -> bool:
    """Whether the dynamic runtime issues its sends from a thread of their own. `auto`: only
    when the host has a spare core for each rank's sender (cores >= local ranks x (compute
    threads + 1)). Measured on the 2-core VM with 2 ranks, where it has none: the thread
    takes the sends off the compute thread (~10 -> 0.7 ms a step) but the step is 0-2.5 %
    slower, as the sender then competes with the computing ranks for a core
    (BENCHMARKS.md, MegaDPP)."""
    if setting != "auto":
        return setting == "on"
    return spare_core_per_rank(cores, local_ranks, threads_per_rank)


@dataclass(frozen=True)
class DppConfig:
    # in-order (interleaved 1F1B's order, receives posted ahead, non-blocking sends) with W
    # filling (TrainConfig.split_backward, on by default for dynamic) measured best; see policies.py
    traversal: str = "in-order"
    max_inflight: int | None = None  # None: per rank, what interleaved 1F1B holds
    send_thread: str = "auto"  # one of SEND_THREAD: sends issued off the compute thread (p2p.outbox.Outbox)
    rebalance: RebalanceConfig = field(default_factory=RebalanceConfig)  # moving layers off a slow stage

    def __post_init__(self) -> None:
        if self.traversal not in TRAVERSALS:
            raise DppConfigError(f"--dpp-traversal must be one of {', '.join(TRAVERSALS)}, got {self.traversal!r}")
        if self.send_thread not in SEND_THREAD:
            raise DppConfigError(f"--dpp-send-thread must be one of {', '.join(SEND_THREAD)}, got {self.send_thread!r}")
        if self.max_inflight is not None and self.max_inflight < 1:
            raise DppConfigError(
                f"--dpp-max-inflight must be >= 1 (a rank needs one slot to admit any "
                f"microbatch), got {self.max_inflight}"
            )


def parse_jitter(spec: str) -> JitterSpec:
    """'RANK:MAXFACTOR[:SEED]' -> JitterSpec; DppConfigError (one line) on bad input."""
    parts = spec.split(":")
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        return JitterSpec(int(parts[0]), float(parts[1]), int(parts[2]) if len(parts) == 3 else 0)
    except ValueError as exc:
        if isinstance(exc, DppConfigError):
            raise
        raise DppConfigError(f"--inject-jitter expects RANK:MAXFACTOR[:SEED], got {spec!r}") from None


# The flags that set DppConfig's fields (`train`; `schedule simulate|show` take the first two)
DPP_FLAGS = (
    Flag(
        "--dpp-traversal",
        "traversal",
        "how a rank picks among ready F/B tasks (pending W tasks fill whatever wait is left). "
        "in-order (measured fastest): interleaved 1F1B's order, never left. The others "
        "reorder on a late input and measured 0.90-1.01x of static interleaved (BENCHMARKS.md; "
        "the late task is usually on the critical path): depth-first keeps in-order's memory; "
        "breadth-first and adaptive queue more independent work, for pipelines whose waits "
        "are too long for W tasks to fill, at the price of memory up to the cap",
        {"choices": TRAVERSALS},
    ),
    Flag(
        "--dpp-max-inflight",
        "max_inflight",
        "most (chunk, microbatch) activation sets a rank holds, pending W state included; "
        "default: what interleaved 1F1B holds",
        {"type": int, "metavar": "N"},
    ),
    Flag(
        "--dpp-send-thread",
        "send_thread",
        "issue the dynamic runtime's sends from a thread of their own (gloo's isend writes to the "
        "socket before it returns); auto: when the host has a spare core per rank",
        {"choices": SEND_THREAD},
    ),
)
