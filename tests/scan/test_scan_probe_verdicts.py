"""Detection after the trace: the impact gate, ambiguity, and the link probe's word on slow links.

Synthetic traces (scan_simulation) with a fault of known cost; the probe's result is given as
probe.json would hold it.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from scan_simulation import SimulatedJob, simulate_job_traces

from megatronapp.scan.analyze.detect_config import DetectConfig, DetectionReport, Suspect
from megatronapp.scan.analyze.detect_output import render_report, report_to_json
from megatronapp.scan.analyze.impact_gate import apply_impact_gate
from megatronapp.scan.analyze.load_align_detect import analyze_aligned, analyze_trace_dir, analyze_traces
from megatronapp.scan.merge.align import align_traces
from megatronapp.scan.probe_config import PROBE_FILE, ProbeResult, load_probe
from megatronapp.scan.record.format import TraceWriter, trace_file_name


def _slow_replica(optimizer_ns: int):
    """DP2, rank 1's forward/backward 1.5x: about 15 ms per iteration, whatever else the iteration holds."""
    job = SimulatedJob(dp_size=2, iterations=8, slow_rank=1, slow_factor=1.5, optimizer_ns=optimizer_ns, seed=3)
    return simulate_job_traces(job)


def test_a_fault_costing_under_two_percent_is_not_named_and_the_report_says_what_it_saw():
    traces = _slow_replica(optimizer_ns=1_000_000_000)  # a 1.27 s iteration: the 15 ms fault is 1.2% of it
    ungated = analyze_traces(traces, DetectConfig(min_impact=0.0)).detection
    assert [(s.rank, s.cause) for s in ungated.suspects] == [(1, "slow_compute")]  # the rules alone name it
    report = analyze_traces(traces).detection
    assert report.suspects == () and [s.rank for s in report.below_impact] == [1]
    share = report.below_impact[0].saving_ns / report.below_impact[0].iteration_ns
    assert 0.005 < share < 0.02
    text = render_report(report, width=300)
    assert "Nothing costing more than 5% of the iteration found" in text
    assert "slow_compute on rank 1, fixing it would save" in text and f"({share:.1%})" in text
    doc = report_to_json(report)
    assert doc["below_impact"][0]["rank"] == 1 and doc["min_impact"] == 0.05
    assert doc["what_if"]["iteration_if_all_fixed_ms"] == doc["what_if"]["iteration_ms"]  # nothing named, nothing fixed


def test_a_fault_costing_a_fifth_of_the_iteration_is_named():
    report = analyze_traces(_slow_replica(optimizer_ns=20_000_000)).detection
    assert [(s.rank, s.cause) for s in report.suspects] == [(1, "slow_compute")]
    assert report.suspects[0].saving_ns / report.suspects[0].iteration_ns > 0.15
    assert report.below_impact == () and "Nothing costing" not in render_report(report, width=300)


def _suspect(rank: int, saving_ms: float, link=None) -> Suspect:
    cause = "slow_link" if link else "slow_compute"
    return Suspect(rank, {}, cause, 0.9, {"summary": "s"}, link, 100e6, 100e6 - saving_ms * 1e6)


def _report(*suspects: Suspect) -> DetectionReport:
    return DetectionReport(suspects, (1, 2), 100e6, 100e6, 0.0, 4, {}, ((3, 5e6),), ())


def test_a_link_and_a_rank_at_its_end_saving_the_same_time_are_named_as_ambiguous():
    config = DetectConfig()
    gated = apply_impact_gate(_report(_suspect(2, 20.0), _suspect(0, 21.0, (0, 2))), config)
    assert len(gated.suspects) == 2 and len(gated.ambiguous) == 1
    assert "slow_compute on rank 2 and slow link 0->2 explain the same time" in gated.ambiguous[0]
    assert "ambiguous: " in render_report(dataclasses.replace(gated, iterations_analyzed=(1, 2)), width=300)
    assert apply_impact_gate(_report(_suspect(2, 20.0), _suspect(0, 40.0, (0, 2))), config).ambiguous == ()
    assert apply_impact_gate(_report(_suspect(2, 20.0), _suspect(1, 20.0)), config).ambiguous == ()  # two ranks
    gated = apply_impact_gate(_report(_suspect(2, 2.0)), config)
    assert gated.suspects == () and gated.victims == () and gated.what_if_all_fixed_ns == 100e6


def _link(src: int, dst: int, mbytes_per_s: float, kind: str = "pipeline") -> dict:
    return {"src": src, "dst": dst, "kind": kind, "mbytes_per_s": mbytes_per_s, "round_trip_s": 0.01, "latency_s": 5e-4}


# PP2 x DP2: pipelines 0 -> 2 and 1 -> 3, data-parallel pairs 0-1 and 2-3; every link near 1 GB/s
HEALTHY = (
    *(_link(0, 2, 900), _link(2, 0, 950), _link(1, 3, 1000), _link(3, 1, 980)),
    *(_link(0, 1, 800, "data"), _link(1, 0, 820, "data"), _link(2, 3, 790, "data"), _link(3, 2, 810, "data")),
)


@pytest.fixture(scope="module")
def slow_link_traces():
    """Every message on link 0 -> 2 arrives 3 ms late: in the trace the link looks slow."""
    job = SimulatedJob(pp_size=2, dp_size=2, iterations=8, slow_link=(0, 2), link_delay_ns=3_000_000, seed=1)
    return align_traces(simulate_job_traces(job))


def _links_named(report: DetectionReport) -> list:
    return [s.link for s in report.suspects if s.link]


def test_a_link_the_probe_measures_as_healthy_is_not_named(slow_link_traces):
    assert _links_named(analyze_aligned(*slow_link_traces).detection) == [(0, 2)]
    report = analyze_aligned(*slow_link_traces, probe=ProbeResult(HEALTHY)).detection
    assert _links_named(report) == []
    assert any("link 0->2 looked slow in the trace but the probe measured 900 MB/s" in n for n in report.notes)
    assert len(report.links_measured) == 8


def test_a_link_the_probe_measures_at_a_tenth_is_named_with_its_bandwidth(slow_link_traces):
    probe = ProbeResult((_link(0, 2, 98), *HEALTHY[1:]))
    report = analyze_aligned(*slow_link_traces, probe=probe).detection
    assert _links_named(report) == [(0, 2)]
    evidence = report.suspects[0].evidence
    assert evidence["probe_mbytes_per_s"] == 98 and evidence["probe_ratio"] == pytest.approx(98 / 980, abs=1e-3)
    text = render_report(report, width=300)
    assert "Links measured" in text and "confirmed: the probe measured 98 MB/s" in text


def test_a_link_the_trace_finds_and_the_probe_measures_below_a_quarter_passes_the_gate(slow_link_traces):
    probe = ProbeResult((_link(0, 2, 98), *HEALTHY[1:]))
    report = analyze_aligned(*slow_link_traces, probe=probe, config=DetectConfig(min_impact=0.99)).detection
    assert _links_named(report) == [(0, 2)] and report.below_impact == ()
    healthy_enough = ProbeResult((_link(0, 2, 400), *HEALTHY[1:]))  # slow by half, not by three quarters
    gated = analyze_aligned(*slow_link_traces, probe=healthy_enough, config=DetectConfig(min_impact=0.99)).detection
    assert _links_named(gated) == [] and [s.link for s in gated.below_impact] == [(0, 2)]


def test_without_a_probe_the_link_finding_is_unconfirmed(slow_link_traces):
    report = analyze_aligned(*slow_link_traces).detection
    assert any(n.startswith("link 0->2 is unconfirmed: no link probe") for n in report.notes)
    failed = analyze_aligned(
        *slow_link_traces, probe=ProbeResult((), "the link probe could not run: timeout")
    ).detection
    assert _links_named(failed) == [(0, 2)]
    assert any("link 0->2 is unconfirmed: the link probe could not run: timeout" in n for n in failed.notes)


def test_a_link_below_a_quarter_of_its_peers_is_named_whatever_it_costs(slow_link_traces):
    probe = ProbeResult((*HEALTHY[:2], _link(1, 3, 120), *HEALTHY[3:]))  # the trace saw nothing on 1 -> 3
    report = analyze_aligned(*slow_link_traces, probe=probe, config=DetectConfig(min_impact=0.5)).detection
    named = {s.link: s for s in report.suspects}
    assert set(named) == {(1, 3)}  # 0 -> 2 (measured healthy) left; 1 -> 3 named below the 50% gate
    summary = named[(1, 3)].evidence["summary"]
    assert "120 MB/s" in summary and "fixing it would save 0.0 ms per iteration (0.0%)" in summary


def test_detection_reads_probe_json_from_the_trace_directory(tmp_path, slow_link_traces):
    for trace in slow_link_traces[0]:
        with TraceWriter(tmp_path / trace_file_name(trace.rank), trace.meta) as writer:
            for batch in trace.events.to_batches():
                writer.append(batch)
    assert load_probe(tmp_path) is None
    (tmp_path / PROBE_FILE).write_text(json.dumps({"links": [_link(0, 2, 98), *HEALTHY[1:]]}))
    report = analyze_trace_dir(tmp_path).detection
    assert _links_named(report) == [(0, 2)] and report.suspects[0].evidence["probe_mbytes_per_s"] == 98
    (tmp_path / PROBE_FILE).write_text('{"links": [{"src": 0}]}')
    with pytest.raises(ValueError, match="not a link probe result"):
        analyze_trace_dir(tmp_path)


def test_a_probe_that_cannot_run_says_why_in_probe_json(tmp_path, monkeypatch):
    import torch.distributed as dist

    from megatronapp.scan.probe_job import probe_traced_job

    def refused(**kwargs):
        raise RuntimeError("Timed out waiting for rank 3 to join\n(store)")

    monkeypatch.setattr(dist, "new_group", refused)
    why = probe_traced_job(tmp_path, [(0, 1, "pipeline"), (1, 0, "pipeline")], 0, "cpu")
    assert why == "the link probe could not run: Timed out waiting for rank 3 to join (store)"
    assert load_probe(tmp_path) == ProbeResult((), why)


def test_the_html_report_shows_the_links_measured_and_what_the_gate_held_back(slow_link_traces):
    from megatronapp.scan.analyze.report import render_report_html
    from megatronapp.scan.analyze.report_data import compute_report_data

    probe = ProbeResult((_link(0, 2, 98), *HEALTHY[1:]))
    page = render_report_html(compute_report_data(analyze_aligned(*slow_link_traces, probe=probe)), "t", None)
    assert "Links measured (link probe)" in page and "<td>0\u21922</td><td>pipeline</td><td>98</td>" in page
    gated = analyze_aligned(*slow_link_traces, config=DetectConfig(min_impact=0.9))
    page = render_report_html(compute_report_data(gated), "t", None)
    assert "Nothing costing more than 90% of the iteration was found; the largest candidate: slow link 0-&gt;2" in page


def test_min_impact_outside_zero_to_one_is_refused_in_one_line(tmp_path, capsys):
    from megatronapp.cli.main import main

    assert main(["trace", "detect", str(tmp_path), "--min-impact", "2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "megatronapp: error: --min-impact must be a share of the iteration in [0, 1], got 2.0"
    )
