"""What a training run does to itself on purpose: the --inject-* flags, apart from the user's configs.

Slowdowns and link delays (faults/), compute jitter for MegaDPP's studies (dpp/jitter.py) and a
crash of one FBD rank (fbd/links.py) exist to test failure handling, detection and scheduling;
no setting of a real training run depends on them. The CLI builds this config only from those
flags (and, for slowdowns and link delays, the MEGATRONAPP_INJECT_* environment that `trace run`
and the fault lab set); tests and benchmarks build the component injections directly.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from megatronapp.config import ConfigError
from megatronapp.dpp.config import JitterSpec, parse_jitter
from megatronapp.faults.inject import FaultPlan, fault_plan_from_env, parse_fault_plan
from megatronapp.fbd.config import FbdInjection, parse_crash_spec


@dataclass(frozen=True)
class InjectionConfig:
    faults: FaultPlan = field(default_factory=FaultPlan)  # --inject-slowdown, --inject-link-delay
    jitter: tuple[JitterSpec, ...] = ()  # --inject-jitter: random compute factors (global ranks)
    fbd: FbdInjection = field(default_factory=FbdInjection)  # --inject-crash
    # the flags as given, recorded in a trace's run metadata (the trace-gap analysis reads them)
    specs: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def spec_dict(self) -> dict[str, list[str]]:
        return {name: list(values) for name, values in self.specs}


def build_injection_config(args: argparse.Namespace) -> InjectionConfig:
    """From the --inject-* flags (one-line errors for specs that do not parse)."""
    plan = parse_fault_plan(args.inject_slowdown, args.inject_link_delay)
    specs = (
        ("inject_slowdown", tuple(args.inject_slowdown or ())),
        ("inject_link_delay", tuple(args.inject_link_delay or ())),
        ("inject_jitter", tuple(args.inject_jitter or ())),
    )
    return InjectionConfig(
        faults=fault_plan_from_env() if plan.empty else plan,
        jitter=tuple(parse_jitter(s) for s in args.inject_jitter or ()),
        fbd=FbdInjection(crash=parse_crash_spec(getattr(args, "inject_crash", None))),
        specs=specs,
    )


def check_injection(inj: InjectionConfig, world_size: int, engine_world_size: int) -> None:
    """Every injection on a rank of the job: faults and crashes on any of `world_size` ranks,
    jitter on the engine's ranks (under FBD, the backward workers)."""
    inj.faults.check(world_size)
    for j in inj.jitter:
        if j.rank >= engine_world_size:
            raise ConfigError(f"--inject-jitter rank {j.rank} is outside world size {engine_world_size}")
    crash = inj.fbd.crash
    if crash is not None and crash[0] >= world_size:
        raise ConfigError(f"--inject-crash rank {crash[0]} is outside world size {world_size}")
