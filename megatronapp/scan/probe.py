"""A link probe that measures what a trace can only infer: each directed link's bandwidth.

A rank descheduled by the operating system wakes late from every receive, so in a trace its
incoming link looks slow; a rate-limited link whose messages are small costs the iteration a few
milliseconds and hides in the noise. The probe settles both by measuring. Over the job's own
process group and backend (gloo or NCCL), every directed pair of the job's pipeline and
collective neighbours runs a timed ping-pong while the other ranks wait: the sender sends
`payload_bytes`, the receiver answers with one element, and the link's time is the fastest round
trip less the fastest small-message round trip measured first on the same pair, so the reverse direction's
latency is not charged to it. Pairs take turns in one global order, so no two probes share a
link or a core, and no order of pairs can deadlock (the earliest unfinished pair always has both
of its ranks at it).

`compute_probe_pairs` and `find_slow_links` are pure; `measure_links` is collective over every
rank of the group.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from megatronapp.parallel.layout import ParallelLayout

SLOW_FRACTION = 0.25  # a link below this share of its peers' median bandwidth is named, whatever it costs today
RETRIES = 2  # passes again over the links measured slow (measure_links)


@dataclass(frozen=True)
class LinkMeasurement:
    src: int
    dst: int
    kind: str  # "pipeline", "data" or "tensor": which of the job's groups the link carries
    mbytes_per_s: float
    round_trip_s: float  # fastest of the repeats, payload one way and one element back
    latency_s: float  # fastest small-message round trip

    def as_dict(self) -> dict:
        return asdict(self)


def compute_probe_pairs(layout: ParallelLayout) -> list[tuple[int, int, str]]:
    """(src, dst, kind) for every directed link the job's traffic uses: neighbours along each
    pipeline (and the last stage back to the first under virtual stages), and ring neighbours in
    each data- and tensor-parallel group (the rings a collective's messages follow)."""
    pairs: dict[tuple[int, int], str] = {}
    for group in layout.pp_group_ranks():
        wrap = layout.virtual_pp_size > 1 and len(group) > 2
        for a, b in zip(group, group[1:] + (group[:1] if wrap else [])):
            pairs.setdefault((a, b), "pipeline")
            pairs.setdefault((b, a), "pipeline")
    for kind, groups in (("data", layout.dp_group_ranks()), ("tensor", layout.tp_group_ranks())):
        for group in groups:
            if len(group) < 2:
                continue
            for a, b in zip(group, group[1:] + group[:1]):
                pairs.setdefault((a, b), kind)
                pairs.setdefault((b, a), kind)
    return sorted((a, b, kind) for (a, b), kind in pairs.items())


def compute_peer_medians(links: list[LinkMeasurement], field: str = "mbytes_per_s") -> dict[tuple[int, int], float]:
    """(src, dst) -> the median `field` (MB/s, or latency_s) of the comparable links: the other
    links of its kind (of every other link where its kind has no other); a link with no other
    link is left out."""
    medians = {}
    for link in links:
        peers = [getattr(x, field) for x in links if x.kind == link.kind and x is not link]
        peers = peers or [getattr(x, field) for x in links if x is not link]
        if peers:
            medians[link.src, link.dst] = statistics.median(peers)
    return medians


def find_slow_links(
    links: list[LinkMeasurement], fraction: float = SLOW_FRACTION
) -> list[tuple[LinkMeasurement, float]]:
    """Links measured below `fraction` of the median of their comparable links
    (compute_peer_medians), slowest first, each with that median."""
    medians = compute_peer_medians(links)
    slow = [(x, medians[x.src, x.dst]) for x in links if x.mbytes_per_s < fraction * medians.get((x.src, x.dst), 0)]
    return sorted(slow, key=lambda s: s[0].mbytes_per_s / s[1])


def _ping_pong(peer: int, sender: bool, payload: torch.Tensor, ack: torch.Tensor, group) -> float:
    t0 = time.perf_counter()
    if sender:
        dist.send(payload, peer, group=group)
        dist.recv(ack, peer, group=group)
    else:
        dist.recv(payload, peer, group=group)
        dist.send(ack, peer, group=group)
    if payload.is_cuda:
        torch.cuda.synchronize(payload.device)
    return time.perf_counter() - t0


def _time_pair(peer: int, sender: bool, payload_bytes: int, repeats: int, device, group) -> tuple[float, float]:
    """(fastest round trip with the payload, fastest small-message round trip), on both ranks: the
    fastest, because a probe's noise (a descheduled end, another process's traffic) only adds."""
    payload = torch.zeros(payload_bytes, dtype=torch.uint8, device=device)
    small = torch.zeros(1, dtype=torch.uint8, device=device)
    ack = torch.zeros(1, dtype=torch.uint8, device=device)
    _ping_pong(peer, sender, small, ack, group)  # connection set-up is not a link's speed
    latency = min(_ping_pong(peer, sender, small, ack, group) for _ in range(repeats))
    trip = min(_ping_pong(peer, sender, payload, ack, group) for _ in range(repeats))
    return trip, latency


def _measure_pass(pairs, rank: int, payload_bytes: int, repeats: int, device, group) -> list[LinkMeasurement]:
    mine = []
    for src, dst, kind in pairs:
        if rank not in (src, dst):
            continue
        trip, latency = _time_pair(dst if rank == src else src, rank == src, payload_bytes, repeats, device, group)
        if rank == src:
            seconds = max(trip - latency, trip / 2)  # a noisy latency must not make a link look infinitely fast
            mine.append(LinkMeasurement(src, dst, kind, payload_bytes / seconds / 1e6, trip, latency))
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, [m.as_dict() for m in mine], group=group)
    return sorted((LinkMeasurement(**m) for part in everyone for m in part), key=lambda m: (m.src, m.dst))


def measure_links(
    pairs: list[tuple[int, int, str]],
    rank: int,
    *,
    payload_bytes: int = 4 << 20,
    repeats: int = 5,
    device: torch.device | str = "cpu",
    group=None,
    retries: int = RETRIES,
) -> list[LinkMeasurement]:
    """Probe every directed pair in turn; every rank returns every link's measurement.

    Links measured slow (find_slow_links) are measured again, up to `retries` times, and keep
    their best pass: a probe's noise (another process on the core, a descheduled end) only slows
    it, and on a shared CPU one pass in several reads a healthy link at a fraction of its speed.
    Every rank holds every measurement, so all of them choose the same links to measure again.
    Collective over `group` (default: the world); ranks are global."""
    links = _measure_pass(pairs, rank, payload_bytes, repeats, device, group)
    for _ in range(retries):
        slow = {(s.src, s.dst) for s, _ in find_slow_links(links)}
        if not slow:
            break
        best = {(m.src, m.dst): m for m in links}
        for m in _measure_pass([p for p in pairs if p[:2] in slow], rank, payload_bytes, repeats, device, group):
            if m.mbytes_per_s > best[m.src, m.dst].mbytes_per_s:
                best[m.src, m.dst] = m
        links = sorted(best.values(), key=lambda m: (m.src, m.dst))
    return links


def render_probe(links: list[LinkMeasurement], fraction: float = SLOW_FRACTION) -> str:
    """The probe's table: MB/s per directed link beside the median of its comparable links, and
    the ratio of the two; links below `fraction` of that median are marked SLOW."""
    if not links:
        return "Link probe: no links to measure (one rank)"
    medians = compute_peer_medians(links)
    lines = [
        "Link probe (MB/s per directed link, ping-pong over the job's backend):",
        f"  {'link':<10} {'kind':<8} {'MB/s':>10} {'comparable':>11} {'ratio':>6}",
    ]
    for m in links:
        median = medians.get((m.src, m.dst))
        ratio = m.mbytes_per_s / median if median else None
        mark = f"  SLOW: below {fraction:g}x its comparable links" if ratio is not None and ratio < fraction else ""
        peer = f"{median:11.1f} {ratio:6.2f}" if median else f"{'-':>11} {'-':>6}"
        lines.append(f"  {m.src:>3} -> {m.dst:<3} {m.kind:<8} {m.mbytes_per_s:10.1f} {peer}{mark}")
    return "\n".join(lines)
