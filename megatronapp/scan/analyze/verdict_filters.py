"""Ways one fault gets named twice, or in the wrong place, and the rules that keep its source (pure).

  * TP lockstep: TP peers meet in every layer's all-reduce, so a rank starved of CPU stretches
    its TP peer's spans too (the peer computes cold after each wait); against its DP replicas
    the peer then reads ~1.25x (design split 3: a quota on rank 2 of TP2 x DP2 named rank 2 and
    its TP peer 3). Of slow-compute suspects in one TP group, the most confident is kept.
  * A starved receiver: a rank frozen by a CPU quota or a competing process completes its
    receives late, so every link *into* it reads slow (design split 4: ranks 1 and 2 of PP4
    jobs under a competing process named as links 0->1 and 2->1, and 1->2 and 3->2). Where every
    incoming link of a rank, from at least two senders, is named, the rank is named instead
    (slow_compute, basis "incoming_links"); a single rate-limited link is one sender's.
  * Opposite links: a batch of sends and receives completes together, so the reverse of a
    rate-limited link carries its delay too (design split 3: PP4, 2 -> 3 limited, both 2 -> 3
    and 3 -> 2 named). Of two opposite links both named, the one into a slow-compute suspect
    is the receiver's echo and goes (design split 4: rank 2 under a quota and 2 -> 0 limited
    named 0 -> 2); else the one slower against its comparable links (ratio) is kept.
  * A late receiver: a rank whose input arrives over a slow link starts its work late and so
    arrives last at its DP collectives; judged by arrival order alone (wall clock), it is the
    link's echo (a PP2 x DP2 job with 1 -> 3 rate-limited named rank 3 "last at 88% of its DP
    collectives"). After the link probe, such a suspect at the receiving end of a named slow
    link goes; a rank the time budget measures descheduled is named again from its counters.
  * A TP partner, measured: a rank whose TP peer is descheduled waits in every layer's
    all-reduce, and arrives late at its own DP collectives (design split 13: a competing process
    on rank 0 of TP2 x PP2 x DP2 named rank 0 from the time budget and its TP peer 1 by arrival
    order). After the measured slow ranks are added, of slow-compute suspects in one TP group,
    those the time budget measures slow (their own CPU time or their run-queue delay) are kept
    and the others go; where the budget measures all or none of them slow, all stay.
Two independent faults on TP peers, on both directions of one link, or on every link into one
rank are then reported as one; each dropped suspect is kept in a note.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace


def _tp_group(coords: dict) -> tuple:
    return coords.get("dp", 0), coords.get("pp", 0)


def merge_starved_receivers(suspects: list, coords: dict, incoming: dict) -> tuple[list, list[str]]:
    """Links into one rank from every sender it has (>= 2) become that rank, as slow compute.
    `incoming`: rank -> the senders of its traced links."""
    by_dst = defaultdict(list)
    for s in suspects:
        if s.cause == "slow_link":
            by_dst[s.link[1]].append(s)
    kept, notes = list(suspects), []
    for dst, links in sorted(by_dst.items()):
        senders = {s.link[0] for s in links}
        if len(senders) < 2 or senders != set(incoming.get(dst, ())):
            continue
        kept = [s for s in kept if s not in links]
        strongest = max(links, key=lambda s: s.confidence)
        names = ", ".join(f"{s.link[0]}->{dst}" for s in links)
        summary = (
            f"rank {dst} completes its receives late from every sender ({names}): the receiver is slow, "
            f"not its links (a rate-limited link slows one sender's messages)"
        )
        evidence = {
            **strongest.evidence,
            "summary": summary,
            "basis": "incoming_links",
            "intermittent": False,
            "links": [list(s.link) for s in links],
            "excess_ms_per_iteration": max(s.evidence.get("excess_ms_per_iteration", 0.0) for s in links),
        }
        kept.append(
            replace(strongest, rank=dst, coords=coords.get(dst, {}), cause="slow_compute", link=None, evidence=evidence)
        )
        notes.append(f"links {names} all read slow: taken for their receiver, rank {dst}")
    return kept, notes


def _is_echo_of_reverse(s, kept: list, ranked: list, slow_ranks: set) -> object | None:
    """The named reverse of link `s` that makes `s` its echo, if any (module docstring)."""
    reverse = next((k for k in ranked if k.cause == "slow_link" and k.link == s.link[::-1]), None)
    if reverse is None:
        return None
    if (s.link[1] in slow_ranks) != (reverse.link[1] in slow_ranks):
        return reverse if s.link[1] in slow_ranks else None
    if reverse in kept or _slowness(reverse) > _slowness(s):
        return reverse
    return None


def _slowness(link) -> tuple:
    """How unlike its comparable links a link is: its ratio to them, then its excess. The ratio
    and not the excess: the two directions are compared with different links (downstream
    activations, upstream gradients), and design split 4's PP4 job with 1 -> 2 limited read
    23x / 3.9 ms there against 4.4x / 6.1 ms on 2 -> 1."""
    return link.evidence.get("ratio", 0.0), link.evidence.get("excess_ms", 0.0)


def drop_echoes(
    suspects: list, tp_size: int, coords: dict | None = None, incoming: dict | None = None
) -> tuple[list, list[str]]:
    """(suspects kept, notes on the ones dropped or merged); `suspects` are detect_config.Suspect, any
    order; `coords` and `incoming` (rank -> senders of its links) enable the starved-receiver rule."""
    suspects, notes = merge_starved_receivers(suspects, coords or {}, incoming or {})
    kept = []
    by_conf = sorted(suspects, key=lambda s: -s.confidence)
    slow_ranks = {s.rank for s in suspects if s.cause == "slow_compute"}
    for s in by_conf:
        if s.cause == "slow_compute" and tp_size > 1:
            peer = next(
                (k for k in kept if k.cause == "slow_compute" and _tp_group(k.coords) == _tp_group(s.coords)), None
            )
            if peer is not None:
                notes.append(
                    f"rank {s.rank} is slower than its peers too, but its TP peer rank {peer.rank} is the "
                    f"stronger suspect and TP peers run in lockstep: taken for its victim"
                )
                continue
        if s.cause == "slow_link":
            reverse = _is_echo_of_reverse(s, kept, by_conf, slow_ranks)
            if reverse is not None:
                notes.append(
                    f"link {s.link[0]}->{s.link[1]} is slow too, but it is the reverse of the slower link "
                    f"{reverse.link[0]}->{reverse.link[1]}, whose delay it shares through batched "
                    f"sends and receives (or its receiver is slow itself): not named"
                )
                continue
        kept.append(s)
    return kept, notes


def root_causes_first(suspects: list) -> list:
    """Most likely first, a slow rank ahead of any link it is an endpoint of: a rank descheduled
    by a competing process wakes late from its receives and stalls mid-send, so its own links read
    slow too, often more consistently than its compute; the rank explains them, not the reverse."""

    def likelihood(s) -> float:
        if s.cause != "slow_compute":
            return s.confidence
        return max([s.confidence] + [x.confidence for x in suspects if x.link and s.rank in x.link])

    return sorted(suspects, key=lambda s: (-likelihood(s), s.cause != "slow_compute", -s.saving_ns, s.rank))


def drop_link_receiver_echoes(suspects: list) -> tuple[list, list[str]]:
    """Slow-compute suspects named by arrival order alone at the receiver of a named slow link
    are that link's echo (module docstring): (suspects kept, a note for each dropped)."""
    into = {s.link[1]: s.link for s in suspects if s.cause == "slow_link"}
    kept, notes = [], []
    for s in suspects:
        link = into.get(s.rank) if s.cause == "slow_compute" else None
        if link is not None and s.evidence.get("basis") == "arrival_order":
            notes.append(
                f"rank {s.rank} arrives late at its collectives, but its input comes over the slow link "
                f"{link[0]}->{link[1]}: taken for that link's echo"
            )
            continue
        kept.append(s)
    return kept, notes


def drop_measured_tp_echoes(suspects: list, measured_slow: set[int]) -> tuple[list, list[str]]:
    """Of slow-compute suspects sharing a TP group, those the time budget does not measure slow
    (`measured_slow`: ranks it does) when it measures another of them slow (module docstring):
    (suspects kept, a note for each dropped)."""
    groups = defaultdict(list)
    for s in suspects:
        if s.cause == "slow_compute":
            groups[_tp_group(s.coords)].append(s)
    dropped = {}
    for members in groups.values():
        slow = [s for s in members if s.rank in measured_slow]
        if slow and len(slow) < len(members):
            for s in members:
                if s.rank not in measured_slow:
                    dropped[id(s)] = slow[0].rank
    notes = [
        f"rank {s.rank} is late too, but its TP peer rank {dropped[id(s)]} is measured slow and it is not "
        f"(CPU time and run-queue delay like its peers'): taken for its victim"
        for s in suspects
        if id(s) in dropped
    ]
    return [s for s in suspects if id(s) not in dropped], notes
