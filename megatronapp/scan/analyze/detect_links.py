"""Point-to-point evidence: matched messages with the receiver's wait start, and each directed
link's transfer times against comparable links (the slow-link rule of detect.py, step 3).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from megatronapp.scan.analyze.detect_rules import RankEvents
from megatronapp.scan.merge.matching import CommIndex
from megatronapp.spans import COMPUTE_KINDS

_EXACT_PEER_LINKS = 32  # link classes up to this size compare each link with the others only


@dataclass(frozen=True)
class P2PMessage:
    src: int
    dst: int
    iteration: int
    seq: int
    bytes: int
    send_start: int
    recv_start: int
    wait_start: int  # when the receiver stopped doing other work and waited
    recv_end: int
    send_end: int = -1  # when the sender's send returned (-1: unknown)

    @property
    def transfer_ns(self) -> int:
        return max(0, self.recv_end - max(self.send_start, self.wait_start))

    @property
    def waited_on_sender(self) -> bool:
        return self.send_start > self.wait_start


def _recv_wait_start(compute_ends: np.ndarray, start: int, end: int) -> int:
    lo, hi = np.searchsorted(compute_ends, start, "right"), np.searchsorted(compute_ends, end, "right")
    return int(compute_ends[hi - 1]) if hi > lo else start


def collect_p2p_messages(index: CommIndex, events: dict[int, RankEvents], iterations: set[int]) -> list[P2PMessage]:
    """Matched messages (matching.py) whose recv is in `iterations`, with the receiver's wait start."""
    compute_ends = {}
    for r, ev in events.items():
        c = ev.cols
        compute_ends[r] = np.sort(c["end_ns"][(c["cat"] == "compute") & np.isin(c["name"], COMPUTE_KINDS)])
    out = []
    for (src, dst, seq), send, recv in index.messages():
        if recv.iteration not in iterations or dst not in compute_ends:
            continue
        wait = _recv_wait_start(compute_ends[dst], recv.start, recv.end)
        out.append(
            P2PMessage(src, dst, recv.iteration, seq, recv.bytes, send.start, recv.start, wait, recv.end, send.end)
        )
    return out


@dataclass(frozen=True)
class LinkStats:
    """One directed link's effective transfer time against comparable links (see compare_links)."""

    src: int
    dst: int
    samples: int
    median_ns: float
    peer_median_ns: float  # median of the comparable links' medians
    peer_high_ns: float  # the comparable links' messages' upper quantile (their own jitter)
    ratio: float
    excess_ns: float  # median_ns - peer_median_ns
    consistency: float  # fraction of messages above every bar: ratio, excess and peer_high_ns
    excess_ns_per_iteration: float  # median over iterations of sum(max(0, transfer - peer median))
    peer_links: int


def _link_classes(by_link: dict, coords: dict[int, dict]) -> dict[tuple, tuple]:
    """Comparable links: same message size (power of two) and, when that leaves each link a
    peer, the same pipeline direction (downstream activations vs upstream gradients: on a
    busy CPU the two directions jitter differently)."""
    size = {
        link: int(np.round(np.log2(max(1.0, float(np.median([m.bytes for m in ms])))))) for link, ms in by_link.items()
    }
    direction = {(s, d): (coords.get(d, {}).get("pp", 0) > coords.get(s, {}).get("pp", 0)) for s, d in by_link}
    fine = {link: (size[link], direction[link]) for link in by_link}
    counts = defaultdict(int)
    for key in fine.values():
        counts[key] += 1
    return {link: fine[link] if counts[fine[link]] > 1 else (size[link],) for link in by_link}


def group_by_link(messages: list[P2PMessage]) -> dict[tuple, list[P2PMessage]]:
    by_link: dict[tuple, list[P2PMessage]] = defaultdict(list)
    for m in messages:
        by_link[(m.src, m.dst)].append(m)
    return by_link


def select_timed_messages(messages: list[P2PMessage]) -> dict[tuple, list[P2PMessage]]:
    """Per directed link, the messages whose transfer time is the link's own: those the receiver
    was already waiting for when they were sent (receive end - send start), where a link has at
    least a quarter of its messages (and 4) of that kind; else all of them. A message that
    arrived while the receiver was busy shows only the tail of its transfer, and a receive
    completed together with a send of the same batch (the engine's batch_isend_irecv) carries
    the other direction's time: with a rate-limited link 1 -> 0 of a PP2 job, the fast 0 -> 1
    measured 3.7 ms median over all messages, 2.3 ms over these (1 -> 0: 7.8 and 13.4 ms)."""
    out = {}
    for link, ms in group_by_link(messages).items():
        timed = [m for m in ms if m.waited_on_sender]
        out[link] = timed if len(timed) >= max(4, len(ms) // 4) else ms
    return out


def compare_links(
    messages: list[P2PMessage],
    coords: dict[int, dict],
    min_ratio: float,
    min_excess_ns: int,
    peer_quantile: float = 0.9,
    timed_only: bool = False,
) -> dict[tuple, LinkStats]:
    """Per directed link with at least one comparable link (_link_classes): its transfers against theirs.

    The reference is the median of the other links' medians (robust to one bad link); a
    message counts as slow when it beats min_ratio x and min_excess_ns over that reference and
    also the `peer_quantile` of the other links' messages, so a link is only as suspicious as
    it is unlike the jitter its peers show. timed_only: per link only the messages whose time is
    the link's own where there are enough (select_timed_messages)."""
    by_link = select_timed_messages(messages) if timed_only else group_by_link(messages)
    transfers = {link: np.array([m.transfer_ns for m in ms], dtype=float) for link, ms in by_link.items()}
    medians = {link: float(np.median(t)) for link, t in transfers.items()}
    cls = _link_classes(by_link, coords)
    members: dict[tuple, list] = defaultdict(list)
    for link in by_link:
        members[cls[link]].append(link)
    pooled = {}  # large classes: one link barely moves the class's reference, so include it (linear time)
    for key, links in members.items():
        if len(links) > _EXACT_PEER_LINKS:
            pooled[key] = (
                float(np.median([medians[o] for o in links])),
                float(np.quantile(np.concatenate([transfers[o] for o in links]), peer_quantile)),
            )
    out = {}
    for link, ms in by_link.items():
        others = [o for o in members[cls[link]] if o != link]
        if not others:
            continue
        if cls[link] in pooled:
            ref, high = pooled[cls[link]]
            ref = max(ref, 1.0)
        else:
            ref = max(float(np.median([medians[o] for o in others])), 1.0)
            high = float(np.quantile(np.concatenate([transfers[o] for o in others]), peer_quantile))
        t = transfers[link]
        slow = (t >= min_ratio * ref) & (t - ref >= min_excess_ns) & (t >= high)
        per_it = defaultdict(float)
        for m, x in zip(ms, t):
            per_it[m.iteration] += max(0.0, x - ref)
        out[link] = LinkStats(
            link[0],
            link[1],
            len(ms),
            medians[link],
            ref,
            high,
            medians[link] / ref,
            medians[link] - ref,
            float(slow.mean()),
            float(np.median(list(per_it.values()))),
            len(others),
        )
    return out
