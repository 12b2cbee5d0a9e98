"""What a run does to itself on purpose: the --inject-* flags, apart from the user's configs.

Slowdowns and link delays (injection/), compute jitter for MegaDPP's studies (dpp/jitter.py), a
crash of one FBD rank (fbd/links.py) and per-rank trace clock skews exist to test failure
handling, detection, clock alignment and scheduling; no setting of a real run depends on them.
Every --inject-* flag is defined here, once, and left out of --help (`megatronapp train --help`
lists the user's flags only); `add_injection_arguments` puts the ones a command takes on its
parser. The CLI builds this config only from those flags, never from the environment; tests
and benchmarks build the component injections directly. (`trace run` carries its own
--inject-slowdown / --inject-link-delay into a user's script, whose command line is the
script's, as MEGATRONAPP_INJECT_* variables that only its bootstrap reads: scan/record/autotrace.py.)
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from megatronapp.config import ConfigError
from megatronapp.dpp.config import JitterSpec, parse_jitter
from megatronapp.fbd.config import FbdInjection, parse_crash_spec
from megatronapp.flags import Flag, add_flags
from megatronapp.injection.inject import FaultPlan, parse_fault_plan

INJECTION_FLAGS = {
    "slowdown": Flag(
        "--inject-slowdown",
        help="that global rank's compute takes FACTOR x as long (every EVERY-th iteration)",
        kwargs={"action": "append", "metavar": "RANK:FACTOR[:EVERY]"},
    ),
    "link_delay": Flag(
        "--inject-link-delay",
        help="messages from SRC to DST arrive MS (+- JITTER) ms late",
        kwargs={"action": "append", "metavar": "SRC:DST:MS[:JITTER]"},
    ),
    "jitter": Flag(
        "--inject-jitter",
        help="slow each compute task on RANK by a random factor in [1, MAXFACTOR], reproducibly",
        kwargs={"action": "append", "metavar": "RANK:MAXFACTOR[:SEED]"},
    ),
    "crash": Flag(
        "--inject-crash",
        help="that global rank raises at the start of that iteration (MegaFBD)",
        kwargs={"metavar": "RANK:ITER"},
    ),
    "clock_skew": Flag(
        "--inject-clock-skew",
        help="add NS nanoseconds to every trace timestamp of RANK (clock alignment tests)",
        kwargs={"action": "append", "metavar": "RANK:NS"},
    ),
}

# command path -> the injections it takes
COMMAND_INJECTIONS = {
    ("train",): ("slowdown", "link_delay", "jitter", "crash", "clock_skew"),
    ("trace", "run"): ("slowdown", "link_delay"),
    ("schedule", "simulate"): ("jitter",),
    ("schedule", "show"): ("jitter",),
}


def add_injection_arguments(parser: argparse.ArgumentParser, kinds) -> None:
    """The --inject-* flags of `kinds` on `parser`, hidden from --help."""
    add_flags(parser, [INJECTION_FLAGS[k] for k in kinds], hidden=True)


@dataclass(frozen=True)
class InjectionConfig:
    faults: FaultPlan = field(default_factory=FaultPlan)  # --inject-slowdown, --inject-link-delay
    jitter: tuple[JitterSpec, ...] = ()  # --inject-jitter: random compute factors (global ranks)
    fbd: FbdInjection = field(default_factory=FbdInjection)  # --inject-crash
    clock_skew_ns: tuple[tuple[int, int], ...] = ()  # --inject-clock-skew: (global rank, ns)
    # the flags as given, recorded in a trace's run metadata (the trace-gap analysis reads them)
    specs: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # leave the default process group up after the run (only its subgroups are destroyed), so one
    # launched set of ranks runs several jobs in a row (benchmarks/dpp_bench.py)
    keep_process_group: bool = False

    @property
    def spec_dict(self) -> dict[str, list[str]]:
        return {name: list(values) for name, values in self.specs}

    def clock_skew_of(self, rank: int) -> int:
        return dict(self.clock_skew_ns).get(rank, 0)


def parse_clock_skew(spec: str) -> tuple[int, int]:
    """'RANK:NS' -> (rank, ns); one-line ConfigError on bad input."""
    try:
        rank, ns = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ConfigError(f"--inject-clock-skew expects RANK:NS, got {spec!r}") from None
    if rank < 0:
        raise ConfigError(f"--inject-clock-skew rank must be >= 0, got {rank}")
    return rank, ns


def build_injection_config(args: argparse.Namespace) -> InjectionConfig:
    """From the --inject-* flags (one-line errors for specs that do not parse)."""
    slowdown, link_delay, jitter = (
        tuple(getattr(args, f"inject_{k}") or ()) for k in ("slowdown", "link_delay", "jitter")
    )
    plan = parse_fault_plan(slowdown, link_delay)
    return InjectionConfig(
        faults=plan,
        jitter=tuple(parse_jitter(s) for s in jitter),
        fbd=FbdInjection(crash=parse_crash_spec(args.inject_crash)),
        clock_skew_ns=tuple(parse_clock_skew(s) for s in args.inject_clock_skew or ()),
        specs=(("inject_slowdown", slowdown), ("inject_link_delay", link_delay), ("inject_jitter", jitter)),
    )


def check_injection(inj: InjectionConfig, world_size: int, engine_world_size: int) -> None:
    """Every injection on a rank of the job: faults, crashes and clock skews on any of
    `world_size` ranks, jitter on the engine's ranks (under FBD, the backward workers)."""
    inj.faults.check(world_size)
    for j in inj.jitter:
        if j.rank >= engine_world_size:
            raise ConfigError(f"--inject-jitter rank {j.rank} is outside world size {engine_world_size}")
    crash = inj.fbd.crash
    if crash is not None and crash[0] >= world_size:
        raise ConfigError(f"--inject-crash rank {crash[0]} is outside world size {world_size}")
    for rank, _ in inj.clock_skew_ns:
        if rank >= world_size:
            raise ConfigError(f"--inject-clock-skew rank {rank} is outside world size {world_size}")
