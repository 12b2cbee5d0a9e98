"""The link probe: which pairs it measures, how it names a slow link, and real measurements over gloo."""

from __future__ import annotations

import pytest

from megatronapp.parallel.layout import ParallelLayout
from megatronapp.scan.probe import LinkMeasurement, compute_probe_pairs, find_slow_links, measure_links, render_probe


def test_pairs_are_the_jobs_pipeline_and_ring_neighbours_both_ways():
    pairs = compute_probe_pairs(ParallelLayout(4, 1, 2))  # PP2 x DP2: pipelines 0-2, 1-3; DP groups 0-1, 2-3
    assert pairs == [(0, 1, "data"), (0, 2, "pipeline"), (1, 0, "data"), (1, 3, "pipeline")] + [
        (2, 0, "pipeline"),
        (2, 3, "data"),
        (3, 1, "pipeline"),
        (3, 2, "data"),
    ]
    looped = {(a, b) for a, b, _ in compute_probe_pairs(ParallelLayout(4, 1, 4, 2))}
    assert (3, 0) in looped and (0, 3) in looped  # virtual stages: the last stage sends to the first
    assert compute_probe_pairs(ParallelLayout(1)) == []


def _link(src, dst, mbps, kind="pipeline") -> LinkMeasurement:
    return LinkMeasurement(src, dst, kind, mbps, 0.01, 0.001)


def test_a_link_below_a_quarter_of_its_peers_is_named_with_its_direction():
    links = [_link(0, 1, 900), _link(1, 0, 25), _link(1, 2, 1000), _link(2, 1, 1100), _link(0, 2, 500, "data")]
    slow = find_slow_links(links)
    assert [(s.src, s.dst) for s, _ in slow] == [(1, 0)]  # the data link has no data peer: compared with all
    assert slow[0][1] == pytest.approx(1000)  # median of the other pipeline links 900, 1000, 1100
    text = render_probe(links)
    rows = {line.split()[0] + line.split()[2]: line for line in text.splitlines()[2:]}
    assert "SLOW" in rows["10"] and "SLOW" not in rows["01"]
    assert rows["10"].split()[4:7] == ["25.0", "1000.0", "0.03"]  # MB/s, comparable links' median, ratio
    assert not find_slow_links([_link(0, 1, 900), _link(1, 0, 500)])


def probe_world(rank: int, world: int, layout) -> list[dict]:
    links = measure_links(compute_probe_pairs(layout), rank, payload_bytes=1 << 20, repeats=3)
    return [m.as_dict() for m in links]


def test_every_rank_gets_every_links_measurement(cluster):
    layout = ParallelLayout(4, 1, 2)
    reports = cluster.run(probe_world, 4, layout)
    assert all(r == reports[0] for r in reports)
    measured = {(m["src"], m["dst"]) for m in reports[0]}
    assert measured == {(a, b) for a, b, _ in compute_probe_pairs(layout)}
    assert all(m["mbytes_per_s"] > 1 and m["round_trip_s"] > 0 and m["latency_s"] > 0 for m in reports[0])


def test_links_measured_slow_are_measured_again_and_keep_their_best_pass(monkeypatch):
    import megatronapp.scan.probe as probe

    pairs = [(0, 1, "pipeline"), (1, 0, "pipeline"), (1, 2, "pipeline"), (2, 1, "pipeline")]
    passes = iter(
        [
            [_link(0, 1, 900), _link(1, 0, 30), _link(1, 2, 1000), _link(2, 1, 1100)],  # 1 -> 0 slowed by noise
            [_link(1, 0, 950)],  # ... and healthy when measured again
        ]
    )
    asked = []

    def fake_pass(pairs, *args):
        asked.append([p[:2] for p in pairs])
        return next(passes)

    monkeypatch.setattr(probe, "_measure_pass", fake_pass)
    links = probe.measure_links(pairs, 0)
    assert asked == [[(0, 1), (1, 0), (1, 2), (2, 1)], [(1, 0)]]  # the second pass: the slow link only
    assert [m.mbytes_per_s for m in links] == [900, 950, 1000, 1100] and not find_slow_links(links)
