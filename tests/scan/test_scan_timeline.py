"""Merged timelines read correctly in Perfetto: every p2p arrow runs send -> arrival, collective
arrows follow arrival order, nothing is dropped. Pure checks, and Perfetto's own trace processor
(`megatronapp trace check`)."""

from __future__ import annotations

import json

import pytest
from scan_simulation import SimulatedJob, simulate_job_traces
from timeline_checks import assert_flows_forward, assert_perfetto_reads_flows

from megatronapp.scan.merge.matching import CommEnd, index_comm_events
from megatronapp.scan.merge.merge import ARRIVAL_NS, merge_traces, place_arrival
from megatronapp.scan.record.format import TraceWriter, trace_file_name


def _write(traces, trace_dir) -> None:
    for t in traces:
        with TraceWriter(trace_dir / trace_file_name(t.rank), t.meta) as w:
            w.append(t.events.combine_chunks().to_batches()[0])


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """A simulated TP2 x PP2 x DP2 job (recvs are posted before their sends, as in 1F1B)."""
    d = tmp_path_factory.mktemp("sim")
    traces = simulate_job_traces(SimulatedJob(tp_size=2, pp_size=2, dp_size=2, iterations=3, seed=3))
    _write(traces, d)
    summary = merge_traces(d, d / "timeline.json")
    return traces, summary, json.loads((d / "timeline.json").read_text())


def test_recvs_start_before_their_sends_in_the_fixture(merged):
    traces, _, _ = merged
    index = index_comm_events(traces)
    early = sum(recv.start < send.start for _, send, recv in index.messages())
    assert index.message_count() > 0 and early > index.message_count() // 4  # the case Perfetto gets wrong


def test_every_arrow_runs_forward_and_messages_end_on_arrivals(merged):
    traces, summary, doc = merged
    index = index_comm_events(traces)
    arrows = assert_flows_forward(doc)
    assert len(arrows) == summary.flows
    p2p = [(s, d) for s, d in arrows if d[2] == "arrival"]
    assert len(p2p) == summary.arrivals == index.message_count()
    assert all(s[2] == "send" for s, _ in p2p)
    expected_collective = sum(len(m) - 1 for m in index.collectives.values() if len(m) > 1)
    assert len(arrows) - len(p2p) == expected_collective
    # each arrival sits at the end of its recv: same thread, ends when the recv ended
    recvs = {
        (e["pid"], e["args"]["peer"], e["args"]["seq"]): e
        for e in doc["traceEvents"]
        if e["ph"] == "X" and e["name"] == "recv"
    }
    for e in (e for e in doc["traceEvents"] if e["ph"] == "X" and e["name"] == "arrival"):
        recv = recvs[e["pid"], e["args"]["peer"], e["args"]["seq"]]
        assert recv["ts"] - 5e-4 <= e["ts"] and abs(e["ts"] + e["dur"] - recv["ts"] - recv["dur"]) < 1e-3


def test_perfetto_reads_the_merged_timeline(merged, tmp_path):
    _, summary, doc = merged
    path = tmp_path / "timeline.json"
    path.write_text(json.dumps(doc))
    report = assert_perfetto_reads_flows(path, summary.flows)
    kinds = {(k["out_name"], k["in_name"]): k["n"] for k in report["flow_kinds"]}
    assert kinds[("send", "arrival")] == summary.arrivals


def _end(start: int, end: int, rank: int = 0) -> CommEnd:
    return CommEnd(rank=rank, start=start, end=end, iteration=0, bytes=4, op="", row=0)


def test_arrival_placement():
    # normal: recv posted first, send later; the arrival is the recv's last ARRIVAL_NS
    assert place_arrival(_end(500, 520), _end(0, 10_000)) == (10_000 - ARRIVAL_NS, 10_000)
    # the send began inside that last stretch: the arrival starts with the send
    assert place_arrival(_end(9_500, 9_600), _end(0, 10_000)) == (9_500, 10_000)
    # a short recv: the arrival is the whole recv
    assert place_arrival(_end(0, 10), _end(100, 300)) == (100, 300)
    # causality broken (recv done before the send began): outside the recv, at the send
    assert place_arrival(_end(900, 950), _end(100, 300)) == (900, 901)
