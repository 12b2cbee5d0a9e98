"""The link probe's word on the trace's link findings: a link is named slow only when measured slow.

A trace sees a link's time per message, which a receiver descheduled by the operating system
inflates as much as a slow wire does; the probe (scan/probe.py, TRACE_DIR/probe.json) measures
the link's bandwidth while nothing else runs. `apply_link_probe`, over a DetectionReport:

  1. Without a probe result (or one that says it could not run), every slow-link suspect stays,
     marked unconfirmed, with a note saying why.
  2. With one, a slow-link suspect stays only if the probe measured its link below
     `config.probe_agree_ratio` of its comparable links' median bandwidth
     (probe.compute_peer_medians), or its small-message round trip slower than theirs by
     1 / `probe_agree_ratio` and by `link_min_excess_ns` (a link that delays every message
     rather than limiting its rate); otherwise it leaves, with a note giving the numbers.
  3. A link the probe measured below probe.SLOW_FRACTION of that median is named whatever it
     costs the iteration today (a degraded link costs more as the job grows), its cost beside it:
     the what-if of the trace's own messages on that link, or none where the trace has none.
  4. The measured links become the report's "Links measured" table.
"""

from __future__ import annotations

import dataclasses

from megatronapp.scan.analyze.detect_config import DetectConfig, DetectionReport, Suspect
from megatronapp.scan.analyze.detect_rules import to_ms
from megatronapp.scan.probe import SLOW_FRACTION, LinkMeasurement, compute_peer_medians
from megatronapp.scan.probe_config import ProbeResult

_NO_PROBE = (
    "no link probe in the trace directory (a traced job probes its links when it has a pipeline, "
    "or with --trace-probe on; `megatronapp trace probe` measures them on their own)"
)


def measured_link_rows(probe: ProbeResult) -> tuple[dict, ...]:
    """The probe's links with the median of their comparable links and the ratio to it."""
    links = [LinkMeasurement(**m) for m in probe.links]
    medians, latencies = compute_peer_medians(links), compute_peer_medians(links, "latency_s")
    rows = []
    for m in links:
        median, latency = medians.get((m.src, m.dst)), latencies.get((m.src, m.dst))
        ratio = m.mbytes_per_s / median if median else None
        rows.append(
            {
                "src": m.src,
                "dst": m.dst,
                "kind": m.kind,
                "mbytes_per_s": round(m.mbytes_per_s, 1),
                "peer_mbytes_per_s": None if median is None else round(median, 1),
                "ratio": None if ratio is None else round(ratio, 3),
                "latency_ms": round(m.latency_s * 1e3, 3),
                "peer_latency_ms": None if latency is None else round(latency * 1e3, 3),
            }
        )
    return tuple(rows)


def probe_agrees(row: dict, config: DetectConfig) -> bool:
    """The probe measured the link slow: low bandwidth or a long small-message round trip (step 2)."""
    if row["ratio"] is not None and row["ratio"] < config.probe_agree_ratio:
        return True
    peer = row["peer_latency_ms"]
    excess_ms = config.link_min_excess_ns / 1e6
    return peer is not None and row["latency_ms"] >= max(peer / config.probe_agree_ratio, peer + excess_ms)


def _with_probe(s: Suspect, row: dict, summary: str) -> Suspect:
    evidence = {
        **s.evidence,
        "summary": summary,
        "probe_mbytes_per_s": row["mbytes_per_s"],
        "probe_peer_mbytes_per_s": row["peer_mbytes_per_s"],
        "probe_ratio": row["ratio"],
    }
    return dataclasses.replace(s, evidence=evidence)


def _measured(row: dict) -> str:
    return (
        f"the probe measured {row['mbytes_per_s']} MB/s, {row['ratio']:.2f}x its comparable links' "
        f"{row['peer_mbytes_per_s']} MB/s, and a {row['latency_ms']} ms small-message round trip "
        f"(theirs {row['peer_latency_ms']} ms)"
    )


def _probe_named(row: dict, candidate: Suspect | None, iteration_ns: float) -> Suspect:
    """A link the probe measured below SLOW_FRACTION of its peers, with what it costs in the trace."""
    a, b = row["src"], row["dst"]
    if candidate is None:
        cost = "the trace has no message on it to say what it costs now"
        candidate = Suspect(a, {}, "slow_link", 1.0, {}, (a, b), iteration_ns, iteration_ns)
    else:
        share = candidate.saving_ns / max(candidate.iteration_ns, 1.0)
        cost = f"fixing it would save {to_ms(candidate.saving_ns)} ms per iteration ({share:.1%}) today"
    summary = f"link {a}->{b}: {_measured(row)} (below {SLOW_FRACTION:g}x: named whatever it costs); {cost}"
    named = _with_probe(candidate, row, summary)
    return dataclasses.replace(named, confidence=1.0, evidence={**named.evidence, "probe_named": True})


def apply_link_probe(report: DetectionReport, probe: ProbeResult | None, config: DetectConfig) -> DetectionReport:
    """`report` with its link findings confirmed, dropped or added by the probe (module docstring)."""
    if probe is None or probe.error or not probe.links:
        why = _NO_PROBE if probe is None else (probe.error or "the probe measured no link")
        notes = [f"link {s.link[0]}->{s.link[1]} is unconfirmed: {why}" for s in report.suspects if s.link]
        return dataclasses.replace(report, notes=(*report.notes, *notes))
    rows = measured_link_rows(probe)
    by_link = {(r["src"], r["dst"]): r for r in rows}
    suspects, notes = [], []
    for s in report.suspects:
        row = by_link.get(s.link) if s.link else None
        if s.link is None:
            suspects.append(s)
        elif row is None or row["ratio"] is None:
            notes.append(f"link {s.link[0]}->{s.link[1]} is unconfirmed: the probe did not measure it")
            suspects.append(s)
        elif probe_agrees(row, config):
            confirmed = _with_probe(s, row, f"{s.evidence['summary']}; confirmed: {_measured(row)}")
            if row["ratio"] < SLOW_FRACTION:  # measured far below its peers: named whatever it costs today
                confirmed = dataclasses.replace(confirmed, evidence={**confirmed.evidence, "probe_named": True})
            suspects.append(confirmed)
        else:
            notes.append(f"link {s.link[0]}->{s.link[1]} looked slow in the trace but {_measured(row)}: not named")
    named = {s.link for s in suspects if s.link}
    candidates = {s.link: s for s in report.link_candidates}
    for row in rows:
        link = (row["src"], row["dst"])
        if link not in named and row["ratio"] is not None and row["ratio"] < SLOW_FRACTION:
            suspects.append(_probe_named(row, candidates.get(link), report.iteration_ns))
    return dataclasses.replace(report, suspects=tuple(suspects), notes=(*report.notes, *notes), links_measured=rows)
