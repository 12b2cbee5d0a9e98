"""The notes and victims of a detection report (detect.py): who waited for the suspects, what the
trace could not judge, and what was found but is too small to name."""

from __future__ import annotations

from collections import defaultdict

from megatronapp.scan.analyze.detect_config import DetectConfig, Suspect
from megatronapp.scan.analyze.detect_rules import to_ms

VICTIM_MIN_SHARE = 0.05  # of the iteration time spent waiting, to be listed as a victim


def compute_victims(instances, messages, n_iterations: int, iteration_ns: float, exclude: set) -> tuple:
    """(rank, wait ns per iteration) of the ranks outside `exclude` that waited at least
    VICTIM_MIN_SHARE of the iteration, at collectives and for messages; most waiting first."""
    wait = defaultdict(float)
    for inst in instances:
        for r, (start, _) in inst.spans.items():
            wait[r] += inst.last_start - start
    for m in messages:
        wait[m.dst] += max(0, m.send_start - m.wait_start)
    per_it = {r: w / max(n_iterations, 1) for r, w in wait.items() if r not in exclude}
    keep = [(r, round(w, 1)) for r, w in per_it.items() if w >= VICTIM_MIN_SHARE * iteration_ns]
    return tuple(sorted(keep, key=lambda x: -x[1]))


def coverage_notes(layout: dict, world: int, events: dict, basis: str, instances, messages) -> list[str]:
    """What the trace could not judge: missing ranks, weak peers, untraced TP collectives or messages."""
    notes = []
    missing = sorted(set(range(world)) - set(events))
    if missing:
        notes.append(f"no trace for ranks {missing}: they cannot be judged and their peers have fewer references")
    if basis == "pipeline_stages":
        notes.append("no DP replicas or TP peers: compute compared across pipeline stages (weak evidence)")
    elif basis == "none":
        notes.append("a single rank: no peers to compare compute against")
    if layout.get("tp_size", 1) > 1 and not any(i.family == "tp" for i in instances):
        notes.append("tp_size > 1 but no TP collectives traced: TP peers of a slow rank will look slow too")
    if layout.get("pp_size", 1) > 1 and not messages:
        notes.append("no matched send/recv pairs: slow links cannot be detected")
    return notes


def cold_notes(spans: dict, compute: dict, config: DetectConfig) -> list[str]:
    """Ranks left with too few warm spans to be judged for a constant slowdown (detect_rules:
    cold span), e.g. a slow link's receiver."""
    notes = []
    for rank, rank_spans in sorted(spans.items()):
        cold = sum(s.cold for s in rank_spans)
        judged = compute[rank].samples if rank in compute else 0
        if cold and judged < config.min_samples:
            notes.append(
                f"rank {rank}: {cold} of {len(rank_spans)} compute spans start within "
                f"{to_ms(config.cold_recovery_ns)} ms of a wait >= {to_ms(config.cold_idle_ns)} ms, "
                f"so its constant slowness is not judged (work after a long wait runs slower)"
            )
    return notes


def negligible_note(s: Suspect) -> str:
    """An intermittent suspect whose fix would save too little to name (detect.py, intermittent_min_saving)."""
    ev = s.evidence
    return (
        f"rank {s.rank} is {ev['slow_iteration_ratio']}x its peers in {len(ev['slow_iterations'])} of "
        f"{ev['iterations']} iterations, but fixing it would save {to_ms(s.saving_ns)} of {to_ms(s.iteration_ns)} "
        f"ms per iteration ({s.saving_ns / max(s.iteration_ns, 1):.2%}): not named"
    )
