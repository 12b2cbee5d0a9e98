"""The MegaDPP benchmark's fault scenarios, defined once by pipeline position.

MegaDPP's performance goal names three perturbations: one rank jittered up to 1.5x, two
ranks jittered independently (they alternate being the slowest), and a delayed link. They are
placed by pipeline stage of replica 0, so every layout gets the same perturbation:
  balanced  nothing
  jitter1   pp 2 jittered up to 1.5x (seed 0)
  jitter2   pp 1 and pp 2 jittered up to 1.5x, independently (seeds 1 and 2)
  link      pp 1 -> pp 2 delayed 5 ms per message
On PP4 x DP2 (global rank = pp * DP + dp, layout.py) this is `--inject-jitter 4:1.5`,
`--inject-jitter 2:1.5:1 --inject-jitter 4:1.5:2` and `--inject-link-delay 2:4:5`: the flags
dpp_bench.py used before scenarios were per layout. `compute_scenario_flags` gives the train
flags of any layout, `compute_scenario_sim` the simulator's jitter and link delays (pipeline
ranks) for a seed.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatronapp.dpp.config import JitterSpec
from megatronapp.parallel.layout import ParallelLayout


@dataclass(frozen=True)
class Scenario:
    jitter: tuple[tuple[int, float, int], ...] = ()  # (pp rank, max factor, seed)
    links: tuple[tuple[int, int, float], ...] = ()  # (src pp rank, dst pp rank, extra ms per message)


SCENARIOS = {
    "balanced": Scenario(),
    "jitter1": Scenario(jitter=((2, 1.5, 0),)),
    "jitter2": Scenario(jitter=((1, 1.5, 1), (2, 1.5, 2))),
    "link": Scenario(links=((1, 2, 5.0),)),
}


def _check(name: str, pp_size: int) -> Scenario:
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; choose one of {', '.join(SCENARIOS)}")
    if pp_size < 3 and name != "balanced":
        raise ValueError(f"scenario {name!r} perturbs pipeline stages 1 and 2: needs pp >= 3, got {pp_size}")
    return SCENARIOS[name]


def compute_scenario_flags(name: str, pp_size: int, dp_size: int) -> list[str]:
    """`megatronapp train` flags of scenario `name` on a TP1 x PP x DP layout (replica 0)."""
    scen = _check(name, pp_size)
    layout = ParallelLayout(pp_size * dp_size, 1, pp_size)
    rank = lambda pp: layout.rank_of(tp=0, dp=0, pp=pp)
    flags = []
    for pp, factor, seed in scen.jitter:
        flags += ["--inject-jitter", f"{rank(pp)}:{factor:g}" + (f":{seed}" if seed else "")]
    for src, dst, ms in scen.links:
        flags += ["--inject-link-delay", f"{rank(src)}:{rank(dst)}:{ms:g}"]
    return flags


def compute_scenario_sim(name: str, pp_size: int, seed: int) -> dict:
    """CostModel keyword arguments (jitter, link_delay_s) of scenario `name` for simulation
    seed `seed`: seed 0 draws what the real run's first step draws; other seeds stand for
    other steps (the jitter seeds of a scenario stay distinct for every seed)."""
    scen = _check(name, pp_size)
    width = max(1, len(scen.jitter))
    jitter = tuple(JitterSpec(pp, factor, width * seed + s) for pp, factor, s in scen.jitter)
    return {"jitter": jitter, "link_delay_s": tuple((s, d, ms / 1e3) for s, d, ms in scen.links)}
