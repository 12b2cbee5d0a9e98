"""The impact gate: a suspect is named only when fixing it would save a share of the iteration
worth a user's time, and two suspects that explain the same time are named as ambiguous.

`apply_impact_gate`, over a DetectionReport whose suspects carry their what-if (detect.py, step 5):

  1. A suspect's share is its saving over its iteration time. An intermittent suspect's saving
     is a mean over every iteration, so it is judged on the iterations it slows: its mean share
     times (iterations analysed / iterations it slows). A fault that makes one iteration in five
     30% slower costs 6% on average and 30% where it strikes; a user waits on the 30% (detect.py
     has already dropped an intermittent suspect that saves under `intermittent_min_saving` on
     average). Below `config.min_impact` a suspect leaves the suspects for `below_impact` (largest
     first), unless the link probe named it (a link measured far below its peers is named
     whatever it costs).
  2. Two remaining suspects are ambiguous when they are related (a link and a rank at one of its
     ends, or two links sharing an end) and their savings agree within `ambiguity_tolerance`
     (relative): either fix removes the same time, and the trace cannot tell which is the cause.
  3. The all-fixed estimate is recomputed from the suspects left; victims only mean something
     next to a culprit, so they go when none is left.
"""

from __future__ import annotations

import dataclasses
from itertools import combinations

from megatronapp.scan.analyze.detect_config import DetectConfig, DetectionReport, Suspect
from megatronapp.scan.analyze.detect_rules import to_ms


def impact_share(s: Suspect) -> float:
    """The share of its iteration that fixing `s` would save."""
    return max(0.0, s.saving_ns) / s.iteration_ns if s.iteration_ns > 0 else 0.0


def gated_share(s: Suspect) -> float:
    """The share the gate judges (step 1): an intermittent suspect's on the iterations it slows."""
    hit, total = len(s.evidence.get("slow_iterations") or ()), s.evidence.get("iterations") or 0
    if s.evidence.get("intermittent") and 0 < hit < total:
        return impact_share(s) * total / hit
    return impact_share(s)


def describe_suspect(s: Suspect) -> str:
    return f"slow link {s.link[0]}->{s.link[1]}" if s.link else f"{s.cause} on rank {s.rank}"


def _ends(s: Suspect) -> set[int]:
    return set(s.link) if s.link else {s.rank}


def _related(a: Suspect, b: Suspect) -> bool:
    if a.link is None and b.link is None:
        return False  # two slow ranks are two causes (both are fixed, both save)
    return bool(_ends(a) & _ends(b))


def find_ambiguous(suspects: tuple[Suspect, ...], tolerance: float) -> tuple[str, ...]:
    """Step 2 of the module docstring, in words."""
    out = []
    for a, b in combinations(suspects, 2):
        big = max(a.saving_ns, b.saving_ns)
        if _related(a, b) and big > 0 and abs(a.saving_ns - b.saving_ns) <= tolerance * big:
            out.append(
                f"{describe_suspect(a)} and {describe_suspect(b)} explain the same time "
                f"({to_ms(a.saving_ns)} and {to_ms(b.saving_ns)} ms per iteration): ambiguous, either may be the cause"
            )
    return tuple(out)


def apply_impact_gate(report: DetectionReport, config: DetectConfig) -> DetectionReport:
    """`report` with the suspects below `config.min_impact` moved to `below_impact` (module docstring)."""
    keep = tuple(s for s in report.suspects if s.evidence.get("probe_named") or gated_share(s) >= config.min_impact)
    below = tuple(sorted((s for s in report.suspects if s not in keep), key=lambda s: -s.saving_ns))
    fixed = report.iteration_ns - sum(max(0.0, s.saving_ns) for s in keep)
    return dataclasses.replace(
        report,
        suspects=keep,
        below_impact=below,
        min_impact=config.min_impact,
        ambiguous=find_ambiguous(keep, config.ambiguity_tolerance),
        what_if_all_fixed_ns=max(fixed, 0.0),
        victims=report.victims if keep else (),
    )
