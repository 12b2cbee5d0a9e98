"""Two ways a single fault gets named twice, and the rule that keeps only its source (pure).

  * TP lockstep: TP peers meet in every layer's all-reduce, so a rank starved of CPU stretches
    its TP peer's spans too (the peer computes cold after each wait); against its DP replicas
    the peer then reads ~1.25x (design split 3: a quota on rank 2 of TP2 x DP2 named rank 2 and
    its TP peer 3). Of slow-compute suspects in one TP group, the most confident is kept.
  * Opposite links: a batch of sends and receives completes together, so the reverse of a
    rate-limited link carries its delay too (design split 3: PP4, 2 -> 3 limited, both 2 -> 3
    and 3 -> 2 named). Of two opposite links both named, the one with the larger excess
    transfer time is kept.
Two independent faults on TP peers, or on both directions of one link, are then reported as
one; the dropped suspect is kept in a note.
"""

from __future__ import annotations


def _tp_group(coords: dict) -> tuple:
    return coords.get("dp", 0), coords.get("pp", 0)


def drop_echoes(suspects: list, tp_size: int) -> tuple[list, list[str]]:
    """(suspects kept, notes on the ones dropped); `suspects` are detect.Suspect, any order."""
    kept, notes = [], []
    by_conf = sorted(suspects, key=lambda s: -s.confidence)
    for s in by_conf:
        if s.cause == "slow_compute" and tp_size > 1:
            peer = next((k for k in kept if k.cause == "slow_compute" and _tp_group(k.coords) == _tp_group(s.coords)),
                        None)
            if peer is not None:
                notes.append(f"rank {s.rank} is slower than its peers too, but its TP peer rank {peer.rank} is the "
                             f"stronger suspect and TP peers run in lockstep: taken for its victim")
                continue
        if s.cause == "slow_link":
            reverse = next((k for k in kept if k.cause == "slow_link" and k.link == s.link[::-1]), None)
            if reverse is None:
                reverse = next((k for k in by_conf if k.cause == "slow_link" and k.link == s.link[::-1]
                                and k.evidence.get("excess_ms", 0) > s.evidence.get("excess_ms", 0)), None)
            if reverse is not None:
                notes.append(f"link {s.link[0]}->{s.link[1]} is slow too, but it is the reverse of the slower link "
                             f"{reverse.link[0]}->{reverse.link[1]}, whose delay it shares through batched "
                             f"sends and receives: not named")
                continue
        kept.append(s)
    return kept, notes
