"""`trace whatif`, `trace report` and per-iteration split merges, on simulated runs."""

from __future__ import annotations

import json
import re

import pytest
from scan_simulation import SimulatedJob, simulate_job_traces
from timeline_checks import assert_flows_forward

from megatronapp.cli.main import main
from megatronapp.scan.merge.merge import merge_traces_split, split_output_name
from megatronapp.scan.record.format import TraceWriter, trace_file_name

JOB = dict(tp_size=1, pp_size=2, dp_size=2, iterations=6, seed=7)


def _write(trace_dir, job: SimulatedJob):
    trace_dir.mkdir(parents=True, exist_ok=True)
    traces = simulate_job_traces(job)
    for t in traces:
        with TraceWriter(trace_dir / trace_file_name(t.rank), t.meta) as w:
            w.append(t.events.combine_chunks().to_batches()[0])
    return traces


def _cli(argv: list[str]) -> int:
    return main(["trace", *argv])


@pytest.mark.parametrize("fault", [dict(slow_rank=3, slow_factor=1.8), dict(slow_link=(0, 2), link_delay_ns=6_000_000)])
def test_whatif_predicts_the_clean_runs_iteration_time(tmp_path, capsys, fault):
    _write(tmp_path / "faulty", SimulatedJob(**JOB, **fault))
    _write(tmp_path / "clean", SimulatedJob(**JOB))
    assert _cli(["whatif", str(tmp_path / "faulty"), "--json"]) == 0
    faulty = json.loads(capsys.readouterr().out)
    assert _cli(["whatif", str(tmp_path / "clean"), "--json"]) == 0
    clean = json.loads(capsys.readouterr().out)
    assert clean["faults"] == [] and len(faulty["faults"]) == 1
    assert faulty["iteration_ms"] > 1.15 * clean["iteration_ms"]  # the fault costs time
    assert abs(faulty["iteration_if_all_fixed_ms"] - clean["iteration_ms"]) < 0.1 * clean["iteration_ms"]
    assert _cli(["whatif", str(tmp_path / "absent")]) == 2


def test_report_is_one_self_contained_page(tmp_path, capsys):
    _write(tmp_path / "t", SimulatedJob(**JOB, slow_rank=1, slow_factor=2.0))
    out = tmp_path / "out" / "report.html"
    assert _cli(["report", str(tmp_path / "t"), "--out", str(out)]) == 0
    page = out.read_text()
    assert "<script" not in page and not re.search(r'(src|href)="(?!https://ui\.perfetto\.dev)[a-z]+://', page)
    assert page.count("<polyline") == 4  # one step-time line per rank
    analysed = int(re.search(r"(\d+) iterations\s+analysed", page).group(1))
    assert page.count("<rect") == 2 * 4 * analysed  # own work and waiting, per rank and iteration
    assert "rank 1: slow_compute" in page and "No merged timeline" in page
    assert "TP1 \u00d7 PP2 \u00d7 DP2 (4 ranks)" in page and "{'" not in page  # layout as text, not a dict
    assert page.count(">iteration</text>") == 1 + 4 and "step time (ms)" in page  # axes on every chart
    assert "rank 1 (suspect)" in page and "waiting on others" in page  # legends
    assert re.search(r"median residual [\d.]+ (ms|\u00b5s|ns),", page)
    assert _cli(["merge", str(tmp_path / "t"), "-o", str(tmp_path / "t" / "timeline.json")]) == 0
    assert _cli(["report", str(tmp_path / "t"), "--out", str(out)]) == 0
    assert 'href="../t/timeline.json"' in out.read_text()


def test_a_clean_runs_report_says_nothing_was_found_and_how_sensitive_the_check_was(tmp_path):
    _write(tmp_path / "t", SimulatedJob(**JOB))
    out = tmp_path / "report.html"
    assert _cli(["report", str(tmp_path / "t"), "--out", str(out)]) == 0
    page = out.read_text()
    assert "Nothing was found" in page and "How sensitive the check was" in page
    assert "1.2\u00d7 its peers'" in page and "The closest any rank came" in page


def test_a_slow_links_report_shows_each_links_effective_bandwidth(tmp_path):
    _write(tmp_path / "t", SimulatedJob(**JOB, slow_link=(0, 2), link_delay_ns=6_000_000))
    out = tmp_path / "report.html"
    assert _cli(["report", str(tmp_path / "t"), "--out", str(out)]) == 0
    page = out.read_text()
    assert "slow link 0\u21922" in page and "effective bandwidth (Mbit/s)" in page
    rows = re.findall(r"<tr( style=[^>]*)?><td>(\d)\u2192(\d)</td>(?:<td>[^<]*</td>){3}<td>([\d.]+)</td>", page)
    slow = [float(bw) for style, s, d, bw in rows if (s, d) == ("0", "2")]
    others = [float(bw) for style, s, d, bw in rows if (s, d) != ("0", "2") and style == ""]
    assert slow and others and slow[0] < min(others)  # the slow link is the one with the least bandwidth


def test_split_merge_writes_one_file_per_chunk_of_iterations(tmp_path):
    traces = _write(tmp_path / "t", SimulatedJob(**JOB))
    summaries = merge_traces_split(tmp_path / "t", tmp_path / "tl.json.gz", per_file=4)
    assert [s.out for s in summaries] == [
        str(split_output_name(tmp_path / "tl.json.gz", a, b)) for a, b in ((0, 3), (4, 5))
    ]
    assert str(split_output_name("x/tl.json.gz", 4, 5)).endswith("tl.iter00004-00005.json.gz")
    recorded = sum(1 for t in traces for c in t.events.column("cat").to_pylist() if c != "calib")
    assert sum(s.events for s in summaries) == recorded
    import gzip

    for s, chunk in zip(summaries, ({0, 1, 2, 3}, {4, 5})):
        doc = json.loads(gzip.decompress(open(s.out, "rb").read()))
        assert {e["args"]["iteration"] for e in doc["traceEvents"] if e["ph"] == "X"} == chunk
        assert len(assert_flows_forward(doc)) == s.flows > 0
    with pytest.raises(ValueError, match=">= 1"):
        merge_traces_split(tmp_path / "t", tmp_path / "x.json", per_file=0)
