"""One fault named twice (scan/analyze/verdict_filters.py): a TP peer in lockstep with a starved rank,
the reverse of a rate-limited link. Both are dropped in favour of the stronger suspect."""

from __future__ import annotations

from megatronapp.scan.analyze.detect import Suspect
from megatronapp.scan.analyze.verdict_filters import drop_echoes


def _rank(rank: int, tp: int, dp: int, pp: int, confidence: float) -> Suspect:
    return Suspect(rank, {"tp": tp, "dp": dp, "pp": pp}, "slow_compute", confidence, {"summary": ""})


def _link(src: int, dst: int, excess_ms: float, confidence: float = 0.9) -> Suspect:
    return Suspect(src, {}, "slow_link", confidence, {"summary": "", "excess_ms": excess_ms}, link=(src, dst))


def test_a_tp_peer_of_a_stronger_suspect_is_dropped_and_noted():
    kept, notes = drop_echoes([_rank(3, 1, 1, 0, 0.65), _rank(2, 0, 1, 0, 1.0)], tp_size=2)
    assert [s.rank for s in kept] == [2] and "TP peer rank 2" in notes[0]


def test_slow_ranks_in_different_tp_groups_or_without_tp_are_all_kept():
    assert len(drop_echoes([_rank(1, 1, 0, 0, 0.7), _rank(2, 0, 1, 0, 1.0)], tp_size=2)[0]) == 2
    assert len(drop_echoes([_rank(0, 0, 0, 0, 0.7), _rank(1, 0, 0, 0, 1.0)], tp_size=1)[0]) == 2  # DP ranks


def test_the_reverse_of_a_slower_link_is_dropped_whatever_the_confidence_order():
    for first, second in ((_link(2, 3, 11.0, 0.8), _link(3, 2, 4.0, 0.9)), (_link(3, 2, 4.0, 0.9), _link(2, 3, 11.0, 0.8))):
        kept, notes = drop_echoes([first, second], tp_size=1)
        assert [s.link for s in kept] == [(2, 3)] and "reverse of the slower link 2->3" in notes[0]


def test_unrelated_links_and_a_rank_with_a_link_are_kept():
    kept, _ = drop_echoes([_link(0, 2, 5.0), _link(1, 3, 6.0), _rank(1, 0, 0, 0, 0.8)], tp_size=1)
    assert len(kept) == 3
