"""Pure parts of the held-out detection evaluation: scenarios from a seed, scoring, CIs, tuning.

Splits: scenarios of the "design" split are the only ones thresholds may be tuned on; the
"heldout" split draws from a disjoint seed space (the split name is part of every scenario's
seed), so its figures come from runs never used for tuning.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from itertools import product

KINDS = ("none", "compute", "intermittent", "link", "two_faults")
FAULT_KINDS = KINDS[1:]
SPLITS = ("design", "heldout")
# (source, tp, pp, nproc): engine layouts (TP/PP/DP mixes) and the plain DDP script under `trace run`.
SOURCES = (("engine", 1, 2, 4), ("engine", 2, 2, 8), ("engine", 2, 1, 4), ("engine", 1, 4, 4), ("ddp", 1, 1, 4))


@dataclass(frozen=True)
class Fault:
    rank: int = -1  # slowed rank
    factor: float = 1.0
    every: int = 1
    link: tuple[int, int] | None = None
    delay_ms: float = 0.0


@dataclass(frozen=True)
class Scenario:
    split: str
    index: int
    kind: str
    source: str
    tp: int
    pp: int
    nproc: int
    fault: Fault = field(default_factory=Fault)
    seed: int = 0  # of the job itself (data order, simulator noise)

    @property
    def name(self) -> str:
        return f"{self.split}-{self.index:04d}-{self.kind}"

    def truth(self) -> set[tuple]:
        """The root causes a perfect detector names: ("slow_compute", rank) / ("slow_link", (src, dst))."""
        out = set()
        if self.fault.factor > 1.0:
            out.add(("slow_compute", self.fault.rank))
        if self.fault.link is not None:
            out.add(("slow_link", tuple(self.fault.link)))
        return out


def _neighbour_link(rng: random.Random, tp: int, pp: int, nproc: int) -> tuple[int, int]:
    """A directed link between neighbouring pipeline stages (Megatron order: TP fastest, then DP)."""
    dp = nproc // (tp * pp)
    t, d, p = rng.randrange(tp), rng.randrange(dp), rng.randrange(pp)
    q = p + rng.choice([s for s in (-1, 1) if 0 <= p + s < pp])
    rank = lambda stage: t + d * tp + stage * tp * dp  # noqa: E731
    return rank(p), rank(q)


def draw_scenario(split: str, seed: int, index: int, kind: str, sources=SOURCES) -> Scenario:
    """Scenario `index` of `split`: source/layout, faulty rank or link and magnitudes from the
    seed (compute 1.2-2x, intermittent every 2-4 iterations, link 2-50 ms)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    rng = random.Random(f"{split}/{seed}/{index}/{kind}")
    usable = [s for s in sources if kind not in ("link", "two_faults") or s[2] > 1]  # links need a pipeline
    source, tp, pp, nproc = rng.choice(usable)
    factor = round(rng.uniform(1.2, 2.0), 2)
    slow = rng.randrange(nproc)
    link = _neighbour_link(rng, tp, pp, nproc) if pp > 1 else None
    delay = round(rng.uniform(2.0, 50.0), 1)
    fault = {"none": Fault(),
             "compute": Fault(rank=slow, factor=factor),
             "intermittent": Fault(rank=slow, factor=factor, every=rng.randint(2, 4)),
             "link": Fault(link=link, delay_ms=delay),
             "two_faults": Fault(rank=slow, factor=factor, link=link, delay_ms=delay)}[kind]
    return Scenario(split, index, kind, source, tp, pp, nproc, fault, seed=rng.randrange(2**31))


def plan_scenarios(split: str, seed: int, runs_per_kind: int, clean_runs: int, sources=SOURCES) -> list[Scenario]:
    """Interleaved kinds (so a partial run still covers every kind), indices unique in the split."""
    counts = {k: (clean_runs if k == "none" else runs_per_kind) for k in KINDS}
    plan, index = [], 0
    for round_ in range(max(counts.values())):
        for kind in KINDS:
            if round_ < counts[kind]:
                plan.append(draw_scenario(split, seed, index, kind, sources))
                index += 1
    return plan


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float] | None:
    """95% Wilson score interval of a proportion (None when n = 0)."""
    if n == 0:
        return None
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return round(max(0.0, centre - half), 3), round(min(1.0, centre + half), 3)


def _named(suspects: list[dict]) -> set[tuple]:
    return {(s["cause"], tuple(s["link"]) if s["link"] else s["rank"]) if s["cause"] == "slow_link"
            else (s["cause"], s["rank"]) for s in suspects}


def _rate(k: int, n: int) -> dict:
    return {"value": round(k / n, 3) if n else None, "k": k, "n": n, "ci95": wilson(k, n)}


def compute_scores(results: list[tuple[Scenario, list[dict]]]) -> dict:
    """Per fault kind: recall (every true cause named), precision (named causes that are true),
    root_cause_accuracy (runs whose suspects are exactly the true causes: no victim named);
    clean runs: false-alarm rate. Each with k, n and a 95% Wilson interval."""
    scores = {}
    clean = [named for sc, named in results if sc.kind == "none"]
    scores["none"] = {"false_alarm_rate": _rate(sum(bool(n) for n in clean), len(clean))}
    for kind in FAULT_KINDS:
        runs = [(sc.truth(), _named(named)) for sc, named in results if sc.kind == kind]
        named_total = sum(len(n) for _, n in runs)
        scores[kind] = {
            "recall": _rate(sum(t <= n for t, n in runs), len(runs)),
            "precision": _rate(sum(len(t & n) for t, n in runs), named_total),
            "root_cause_accuracy": _rate(sum(t == n for t, n in runs), len(runs)),
        }
    return scores


def threshold_grid() -> list[dict]:
    """Candidate DetectConfig overrides searched on the design split."""
    return [{"compute_min_ratio": c, "link_min_ratio": lr, "link_min_excess_ns": ex}
            for c, lr, ex in product((1.1, 1.15, 1.2, 1.3), (1.5, 2.0, 3.0), (1_000_000, 2_000_000, 4_000_000))]


def select_thresholds(scored: list[tuple[dict, dict]]) -> dict:
    """The grid point with no false alarm (if any has none) and the best mean recall over fault
    kinds; ties go to the higher (more conservative) thresholds."""
    def key(item: tuple[dict, dict]) -> tuple:
        overrides, scores = item
        alarms = scores["none"]["false_alarm_rate"]["k"]
        recalls = [scores[k]["recall"]["value"] or 0.0 for k in FAULT_KINDS if scores[k]["recall"]["n"]]
        return (alarms == 0, sum(recalls) / max(len(recalls), 1), tuple(sorted(overrides.items())))

    return max(scored, key=key)[0]
