"""MegaScan alignment (pure, synthetic traces with known clock offsets), Chrome-trace merge,
the `trace` CLI, and one 4-rank gloo run traced end to end with skewed clocks."""

from __future__ import annotations

import argparse
import gzip
import json
import time
from collections import defaultdict

import numpy as np
import pyarrow as pa
import pytest
from timeline_checks import assert_flows_forward, assert_perfetto_reads_flows

from megatronapp.cli.main import main
from megatronapp.parallel.layout import ParallelLayout
from megatronapp.scan.cli import add_trace_subcommands, parse_iteration_range, parse_rank_list
from megatronapp.scan.merge.align import align_traces
from megatronapp.scan.merge.chrome import assign_lanes, compute_lanes
from megatronapp.scan.merge.merge import merge_traces
from megatronapp.scan.record.format import (
    RankTrace,
    TraceWriter,
    build_event_batch,
    build_rank_meta,
    load_trace_dir,
    trace_file_name,
)

EPOCH_NS = 1_700_000_000_000_000_000  # wall clock of the synthetic hosts at true time 0
MS = 1_000_000


# ----------------------------------------------------------------------------- synthetic jobs
def rank_meta(layout: ParallelLayout, rank: int) -> dict:
    layout_dict = {"tp_size": layout.tp_size, "pp_size": layout.pp_size, "dp_size": layout.dp_size}
    return build_rank_meta(
        rank=rank,
        world_size=layout.world_size,
        coords=layout.coords(rank).as_dict(),
        layout=layout_dict,
        host=f"node{rank // 8}",
        device="cpu",
        run_id="synthetic",
        clock="monotonic",
    )


class SyntheticJob:
    """True-time events of a TP x DP x PP job: TP and DP all-reduces (optionally a
    model-parallel one that links pipeline stages), and p2p between consecutive stages."""

    def __init__(self, layout: ParallelLayout, seed: int = 0, noise_ns: int = 20_000, model_parallel: bool = True):
        self.layout, self.rng, self.noise = layout, np.random.default_rng(seed), noise_ns
        self.rows: dict[int, list[dict]] = {r: [] for r in range(layout.world_size)}
        self.seq: dict = defaultdict(int)
        self.t = 0
        groups = layout.tp_group_ranks() + layout.dp_group_ranks()
        if model_parallel:
            groups += layout.model_parallel_group_ranks()
        self.groups = [g for g in groups if len(g) > 1]

    def collective(self, members: list[int], iteration: int, late: float = 0.0) -> None:
        key = f"g:[{','.join(map(str, members))}]"
        seq, end = self.seq[key], self.t + MS
        self.seq[key] += 1
        for r in members:
            delay = int(self.rng.integers(0, self.noise))
            if self.rng.random() < late:  # a rank descheduled before it read the clock
                delay += 5 * MS
            self.rows[r].append(
                {
                    "name": "all_reduce",
                    "cat": "comm",
                    "op": "all_reduce",
                    "group": key,
                    "seq": seq,
                    "start_ns": end - int(self.rng.integers(100_000, 900_000)),
                    "end_ns": end + delay,
                    "iteration": iteration,
                    "bytes": 4096,
                }
            )

    def p2p(self, src: int, dst: int, iteration: int) -> None:
        seq = self.seq[src, dst]
        self.seq[src, dst] += 1
        send = self.t + int(self.rng.integers(0, 100_000))
        common = {"cat": "comm", "seq": seq, "iteration": iteration, "bytes": 8192, "group": "0:[all]"}
        self.rows[src].append(
            {**common, "name": "send", "op": "send", "peer": dst, "start_ns": send, "end_ns": send + 30_000}
        )
        self.rows[dst].append(
            {
                **common,
                "name": "recv",
                "op": "recv",
                "peer": src,
                "start_ns": self.t - 200_000,
                "end_ns": send + int(self.rng.integers(50_000, 300_000)),
            }
        )

    def run(self, iterations: int, late: float = 0.0) -> SyntheticJob:
        lay = self.layout
        for it in range(1, iterations + 1):
            for r in range(lay.world_size):
                self.rows[r].append(
                    {
                        "name": "forward",
                        "cat": "compute",
                        "start_ns": self.t,
                        "end_ns": self.t + 5 * MS,
                        "iteration": it,
                    }
                )
            for group in self.groups:
                self.collective(group, it, late)
                self.t += 2 * MS
            for r in range(lay.world_size):
                c = lay.coords(r)
                if c.pp + 1 < lay.pp_size:
                    self.p2p(r, lay.rank_of(c.tp, c.dp, c.pp + 1), it)
            self.t += 3 * MS
        return self

    def traces(
        self, skew_ns: dict[int, int], drift_ppm: dict[int, float] | None = None, calib_span_ns: int = 0
    ) -> list[RankTrace]:
        """Each rank's view: device = true + skew (+ drift); calibration pairs read a
        host wall clock carrying the same skew, so only the trace itself reveals it."""
        out = []
        last = self.t + calib_span_ns
        for r, rows in self.rows.items():
            drift = (drift_ppm or {}).get(r, 0.0) * 1e-6

            def device(t: int) -> int:
                return t + skew_ns.get(r, 0) + round(drift * t)

            shifted = [{**row, "start_ns": device(row["start_ns"]), "end_ns": device(row["end_ns"])} for row in rows]
            for t in np.linspace(0, last, 5).astype(np.int64).tolist():
                shifted.append(
                    {"name": "clock", "cat": "calib", "start_ns": device(t), "end_ns": EPOCH_NS + t + skew_ns.get(r, 0)}
                )
            table = pa.Table.from_batches([build_event_batch(shifted)])
            out.append(RankTrace(meta=rank_meta(self.layout, r), events=table))
        return out


def recovered_skews(report) -> dict[int, int]:
    return {r: -(off - report.offset_ns[0]) for r, off in report.offset_ns.items()}


def p2p_gaps(traces: list[RankTrace]) -> list[int]:
    """recv_end - send_start of every matched message (negative = causality broken)."""
    sends, recvs = {}, {}
    for t in traces:
        for row in t.events.to_pylist():
            if row["op"] == "send":
                sends[t.rank, row["peer"], row["seq"]] = row["start_ns"]
            elif row["op"] == "recv":
                recvs[row["peer"], t.rank, row["seq"]] = row["end_ns"]
    return [recvs[k] - s for k, s in sends.items() if k in recvs]


# ----------------------------------------------------------------------------- alignment
@pytest.mark.parametrize("tp, pp, world", [(2, 4, 32), (1, 1, 16), (4, 2, 64)])
def test_align_recovers_random_offsets_through_collectives(tp, pp, world):
    layout = ParallelLayout(world_size=world, tp_size=tp, pp_size=pp)
    rng = np.random.default_rng(world)
    skews = {r: int(rng.integers(-50 * MS, 50 * MS)) for r in range(world)}
    job = SyntheticJob(layout, seed=world).run(iterations=5)
    aligned, report = align_traces(job.traces(skews))
    for r, got in recovered_skews(report).items():
        assert abs(got - (skews[r] - skews[0])) < 40_000, (r, got, skews[r] - skews[0])
    assert report.violations == 0 and report.median_residual_ns < 40_000
    assert report.anchors == 5 * len(job.groups)
    assert report.method == dict.fromkeys(range(world), "collectives")
    assert all(gap >= 0 for gap in p2p_gaps(aligned)) and len(p2p_gaps(aligned)) == report.p2p_messages


def test_align_is_robust_to_late_clock_reads():
    layout = ParallelLayout(world_size=16, tp_size=2, pp_size=2)
    skews = {r: (r * 7919 % 23 - 11) * MS for r in range(16)}
    job = SyntheticJob(layout, seed=3).run(iterations=12, late=0.1)  # 10% of reads 5 ms late
    _, report = align_traces(job.traces(skews))
    errors = [abs(got - (skews[r] - skews[0])) for r, got in recovered_skews(report).items()]
    assert max(errors) < 200_000, errors


def test_wall_clock_is_kept_when_noisy_collectives_do_not_contradict_it():
    layout = ParallelLayout(world_size=8, tp_size=2, pp_size=2)
    # A busy host: clock reads after a collective are up to 1 ms late, 10% of them 5 ms late.
    job = SyntheticJob(layout, seed=11, noise_ns=1 * MS).run(iterations=10, late=0.1)
    _, report = align_traces(job.traces({}))
    assert {report.offset_ns[r] - report.offset_ns[0] for r in range(8)} == {0}
    assert set(report.method.values()) == {"wall-clock"}
    _, skewed = align_traces(job.traces({5: 20 * MS}))  # the same noise cannot hide 20 ms
    assert all(m.startswith("collectives") for m in skewed.method.values())
    assert abs(-(skewed.offset_ns[5] - skewed.offset_ns[0]) - 20 * MS) < 1 * MS


def test_stages_linked_only_by_p2p_are_shifted_minimally_to_causality():
    layout = ParallelLayout(world_size=8, tp_size=2, pp_size=2)
    job = SyntheticJob(layout, seed=5, model_parallel=False).run(iterations=4)
    stage1 = [r for r in range(8) if layout.coords(r).pp == 1]
    # Stage 1 reads 40 ms early: its recvs end before the sends started.
    traces = job.traces(dict.fromkeys(stage1, -40 * MS))
    assert min(p2p_gaps(traces)) < 0
    aligned, report = align_traces(traces)
    gaps = p2p_gaps(aligned)
    assert report.violations_before > 0 and report.violations == 0
    assert min(gaps) == 0  # the minimal shift makes the tightest message just causal
    shifts = {report.offset_ns[r] - report.offset_ns[0] for r in stage1}
    assert len(shifts) == 1  # the stage moved as one: its own clocks agreed, so they stay agreed
    assert abs(shifts.pop() - 40 * MS) < 400_000  # ~40 ms back, up to the transfer times
    assert {report.method[r] for r in stage1} == {"wall-clock+causality"}
    assert report.median_residual_ns < 40_000
    # A stage that reads late breaks nothing, so the wall clock is kept.
    _, untouched = align_traces(job.traces(dict.fromkeys(stage1, 40 * MS)))
    assert untouched.violations_before == 0
    assert {untouched.offset_ns[r] - untouched.offset_ns[0] for r in range(8)} == {0}


def test_drift_is_fitted_when_calibration_spans_long():
    layout = ParallelLayout(world_size=4, tp_size=2)
    job = SyntheticJob(layout, seed=9).run(iterations=3)
    drifts = {0: 0.0, 1: 40.0, 2: -25.0, 3: 10.0}
    _, report = align_traces(job.traces({1: 3 * MS}, drift_ppm=drifts, calib_span_ns=120_000 * MS))
    for r, ppm in drifts.items():
        assert report.drift_ppm[r] == pytest.approx(-ppm, abs=0.5)
    _, short = align_traces(job.traces({}, drift_ppm=drifts, calib_span_ns=0))
    assert all(v == 0.0 for v in short.drift_ppm.values())


def test_contradictory_p2p_is_reported_not_looped_on():
    layout = ParallelLayout(world_size=2, pp_size=2)

    def message(peer: int, op: str, start: int, end: int) -> dict:
        return {
            "name": op,
            "cat": "comm",
            "op": op,
            "peer": peer,
            "seq": 0,
            "start_ns": start,
            "end_ns": end,
            "iteration": 1,
            "group": "0:[0,1]",
        }

    # Each recv ends well before its send starts, in both directions: no offset fixes both.
    rows = {
        0: [message(1, "send", 1000, 1100), message(1, "recv", 0, 400)],
        1: [message(0, "send", 1000, 1100), message(0, "recv", 0, 500)],
    }
    traces = [
        RankTrace(meta=rank_meta(layout, r), events=pa.Table.from_batches([build_event_batch(rows[r])])) for r in (0, 1)
    ]
    began = time.process_time()  # CPU time, not wall: a loaded CI machine must not fail this
    _, report = align_traces(traces)
    assert time.process_time() - began < 10
    assert report.p2p_messages == 2 and report.violations >= 1 and report.violations_before == 2


def test_align_rejects_duplicate_ranks():
    job = SyntheticJob(ParallelLayout(world_size=2)).run(iterations=1)
    traces = job.traces({})
    with pytest.raises(ValueError, match="duplicate ranks"):
        align_traces([traces[0], traces[0]])


# ----------------------------------------------------------------------------- merge
def test_assign_lanes_nests_every_lane():
    rng = np.random.default_rng(0)
    starts = rng.integers(0, 1000, 300).tolist()
    ends = [s + int(d) for s, d in zip(starts, rng.integers(0, 200, 300))]
    lanes = assign_lanes(starts, ends)
    for lane in set(lanes):
        spans = [(s, e) for s, e, l in zip(starts, ends, lanes) if l == lane]
        for a in spans:
            for b in spans:
                disjoint = a[1] <= b[0] or b[1] <= a[0]
                nested = (a[0] <= b[0] and b[1] <= a[1]) or (b[0] <= a[0] and a[1] <= b[1])
                assert disjoint or nested, (a, b)
    assert assign_lanes([0, 10, 20], [5, 15, 25]) == [0, 0, 0]
    assert assign_lanes([0, 2], [5, 8]) == [0, 1]


@pytest.mark.parametrize("spread", [3000, 60_000])  # dense: large clusters; sparse: clusters of 1-3 spans
@pytest.mark.parametrize("seed", range(6))
def test_vectorised_lanes_equal_the_greedy_rule_per_group(seed, spread):
    """compute_lanes (clusters, bracket check, greedy only where spans cross) == assign_lanes
    run on each group alone, including ties, zero-length spans and touching spans."""
    rng = np.random.default_rng(seed)
    n = 2000
    group = rng.integers(0, 5, n)
    starts = rng.integers(0, spread, n) // 10 * 10  # coarse grid: many equal starts
    ends = starts + rng.choice([0, 10, 20, 50, 300], n) * (rng.random(n) < 0.9)
    lanes = compute_lanes(group, starts, ends)
    for g in range(5):
        rows = np.flatnonzero(group == g)
        assert lanes[rows].tolist() == assign_lanes(starts[rows].tolist(), ends[rows].tolist())
    nested = np.array([0, 1, 2, 10, 11]), np.array([100, 50, 5, 20, 12])  # one laminar cluster
    assert compute_lanes(np.zeros(5, np.int64), *nested).tolist() == [0] * 5


def write_dir(traces: list[RankTrace], path) -> None:
    for t in traces:
        with TraceWriter(path / trace_file_name(t.rank), t.meta) as w:
            for batch in t.events.to_batches(max_chunksize=50):
                w.append(batch)


def load_json(path) -> dict:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def check_chrome_trace(doc: dict, ranks: list[int]) -> dict:
    """Structural checks shared by the merge tests; returns events grouped by phase."""
    by_ph = defaultdict(list)
    for e in doc["traceEvents"]:
        by_ph[e["ph"]].append(e)
    names = {e["pid"]: e["args"]["name"] for e in by_ph["M"] if e["name"] == "process_name"}
    assert sorted(names) == ranks
    assert all(names[r].startswith(f"rank {r} (pp") for r in ranks)
    assert doc["displayTimeUnit"] == "ms"
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in by_ph["X"])
    flows = defaultdict(list)
    for e in by_ph["s"] + by_ph["t"] + by_ph["f"]:
        flows[e["id"]].append(e)
    for fid, chain in flows.items():
        phases = sorted(e["ph"] for e in chain)
        assert phases.count("s") == 1 and phases.count("f") == 1, (fid, phases)
        for e in chain:  # every flow point sits inside a slice of its own thread
            # ts/dur are µs with ns decimals: compare within half a ns of float rounding
            assert any(
                x["pid"] == e["pid"] and x["tid"] == e["tid"] and x["ts"] - 5e-4 <= e["ts"] <= x["ts"] + x["dur"] + 5e-4
                for x in by_ph["X"]
            ), e
    assert_flows_forward(doc)
    return {"by_ph": by_ph, "flows": flows}


def test_merge_writes_valid_gzipped_chrome_trace_atomically(tmp_path):
    layout = ParallelLayout(world_size=8, tp_size=2, pp_size=2)
    job = SyntheticJob(layout, seed=1).run(iterations=3)
    write_dir(job.traces({3: 9 * MS}), tmp_path / "trace")
    out = tmp_path / "out" / "timeline.json.gz"
    summary = merge_traces(tmp_path / "trace", out)
    doc = load_json(out)
    parts = check_chrome_trace(doc, list(range(8)))
    n_rows = sum(len(rows) for rows in job.rows.values())
    p2p = [f for f in parts["flows"].values() if f[0]["name"] == "p2p"]
    assert len(p2p) == summary.arrivals == sum(n for k, n in job.seq.items() if isinstance(k, tuple))
    assert summary.events == n_rows == len(parts["by_ph"]["X"]) - summary.arrivals and summary.events_per_s > 0
    assert len(parts["flows"]) - len(p2p) == 3 * len(job.groups)
    sort = {e["pid"]: e["args"]["sort_index"] for e in parts["by_ph"]["M"] if e["name"] == "process_sort_index"}
    coords = {r: layout.coords(r) for r in range(8)}
    assert sorted(sort, key=sort.get) == sorted(range(8), key=lambda r: (coords[r].pp, coords[r].dp, coords[r].tp))
    other = doc["otherData"]["megascan"]
    assert other["alignment"]["violations"] == 0 and other["merge"]["events"] == n_rows
    assert abs(-(other["alignment"]["offset_ns"]["3"] - other["alignment"]["offset_ns"]["0"]) - 9 * MS) < 40_000
    # A failed merge leaves the previous output untouched and no temporary file behind.
    before = out.read_bytes()
    (tmp_path / "trace" / trace_file_name(2)).write_bytes(b"broken")
    with pytest.raises(ValueError, match="rank00002.mscan"):
        merge_traces(tmp_path / "trace", out)
    assert out.read_bytes() == before and sorted(p.name for p in out.parent.iterdir()) == ["timeline.json.gz"]


def test_merge_filters_iterations_and_ranks(tmp_path):
    layout = ParallelLayout(world_size=4, tp_size=2)
    job = SyntheticJob(layout, seed=2).run(iterations=4)
    write_dir(job.traces({}), tmp_path)
    out = tmp_path / "sub.json"
    summary = merge_traces(tmp_path, out, iterations=range(2, 4), ranks=[1, 3])
    doc = load_json(out)
    check_chrome_trace(doc, [1, 3])
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["name"] != "arrival"]
    assert {e["args"]["iteration"] for e in spans} == {2, 3}
    expected = sum(1 for r in (1, 3) for row in job.rows[r] if row["iteration"] in (2, 3))
    assert summary.events == len(spans) == expected and summary.ranks == [1, 3]


# ----------------------------------------------------------------------------- CLI
def test_cli_parsers():
    assert parse_iteration_range("3:7") == range(3, 7) and parse_iteration_range("5") == range(5, 6)
    assert parse_iteration_range(":4") == range(0, 4) and parse_iteration_range("9:").start == 9
    assert parse_rank_list("0,2,4-6") == [0, 2, 4, 5, 6]
    for bad in ("7:3", "a:b"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_iteration_range(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_rank_list("x")


def test_cli_trace_merge_runs_and_reports(tmp_path, capsys):
    job = SyntheticJob(ParallelLayout(world_size=2, tp_size=2), seed=4).run(iterations=2)
    write_dir(job.traces({}), tmp_path)
    assert main(["trace", "merge", str(tmp_path), "-o", str(tmp_path / "t.json"), "--iterations", "2:3"]) == 0
    assert "events/s" in capsys.readouterr().out
    check_chrome_trace(load_json(tmp_path / "t.json"), [0, 1])
    assert main(["trace", "merge", str(tmp_path / "missing"), "-o", str(tmp_path / "x.json")]) == 2
    assert (
        capsys.readouterr().err.strip() == f"megatronapp: error: trace directory {tmp_path / 'missing'} does not exist"
    )
    parser = argparse.ArgumentParser(prog="megatronapp")
    add_trace_subcommands(parser.add_subparsers(dest="command"))
    trace_parser = parser._subparsers._group_actions[0].choices["trace"]
    assert set(trace_parser._subparsers._group_actions[0].choices) == {
        "merge",
        "detect",
        "run",
        "whatif",
        "report",
        "check",
        "probe",
    }


# ----------------------------------------------------------------------------- 4 real ranks
SKEWS = {0: 0, 1: 37 * MS, 2: 0, 3: -12 * MS}
ITERATIONS = range(1, 9)  # interval 3, 2 consecutive: iterations 3, 4, 6, 7 are traced


def traced_gloo_job(rank: int, world_size: int, trace_dir: str) -> dict:
    import torch
    import torch.distributed as dist

    from megatronapp.scan.record.instrument import install_distributed_instrumentation
    from megatronapp.scan.record.tracer import TraceConfig, Tracer

    layout = ParallelLayout(world_size=world_size, tp_size=2, pp_size=2)
    tp_groups = [dist.new_group(g) for g in layout.tp_group_ranks()]
    pp_groups = [dist.new_group(g) for g in layout.pp_group_ranks()]
    config = TraceConfig(
        enabled=True,
        trace_dir=trace_dir,
        interval=3,
        continuous_iterations=2,
        clock_skew_ns=SKEWS[rank],
        flush_seconds=0.0,
    )
    tracer = Tracer(config, rank_meta(layout, rank))
    instrumentation = install_distributed_instrumentation(tracer)
    c = layout.coords(rank)
    my_tp = tp_groups[[rank in g for g in layout.tp_group_ranks()].index(True)]
    my_pp = pp_groups[[rank in g for g in layout.pp_group_ranks()].index(True)]
    x = torch.ones(256)
    for it in ITERATIONS:
        tracer.step_begin(it)
        with tracer.span("forward"):
            time.sleep(0.002)
            dist.all_reduce(x, group=my_tp)
            if c.pp == 0:
                dist.isend(x, layout.rank_of(c.tp, c.dp, 1)).wait()
            else:
                dist.irecv(torch.empty(256), layout.rank_of(c.tp, c.dp, 0)).wait()
        with tracer.span("backward"):
            ring = [
                dist.P2POp(dist.isend, x, (rank + 1) % world_size),
                dist.P2POp(dist.irecv, torch.empty(256), (rank - 1) % world_size),
            ]
            for work in dist.batch_isend_irecv(ring):
                work.wait()
            dist.all_reduce(x, group=my_pp)
        dist.barrier()
        x.fill_(1.0)
        tracer.step_end(it)
    instrumentation.uninstall()
    tracer.close()
    return {"restored": dist.all_reduce.__module__ == "torch.distributed.distributed_c10d"}


def test_four_ranks_traced_merged_and_aligned(tmp_path, cluster):
    results = cluster.run(traced_gloo_job, 4, str(tmp_path / "trace"))
    assert all(r["restored"] for r in results)
    traces = load_trace_dir(tmp_path / "trace")
    assert [t.rank for t in traces] == [0, 1, 2, 3] and not any(t.partial for t in traces)
    traced = [3, 4, 6, 7]
    for t in traces:
        rows = [r for r in t.events.to_pylist() if r["cat"] != "calib"]
        assert sorted({r["iteration"] for r in rows}) == traced
        comm = [r for r in rows if r["cat"] == "comm"]
        # per iteration: tp all_reduce, one pp p2p, ring send + recv, pp all_reduce, barrier
        assert len(comm) == 6 * len(traced)
        barrier_seqs = [r["seq"] for r in comm if r["op"] == "barrier"]
        assert barrier_seqs == [it - 1 for it in traced]  # counted on untraced iterations too
        assert sum(r["cat"] == "calib" for r in t.events.to_pylist()) == 1 + 2  # start + 2 windows
    out = tmp_path / "timeline.json"
    summary = merge_traces(tmp_path / "trace", out)
    parts = check_chrome_trace(load_json(out), [0, 1, 2, 3])
    kinds = defaultdict(int)
    for chain in parts["flows"].values():
        kinds[chain[0]["name"]] += 1
    assert kinds["p2p"] == (2 + 4) * len(traced)  # 0->2, 1->3 and the 4-message ring
    assert kinds["collective"] == (2 + 2 + 1) * len(traced)  # 2 tp, 2 pp groups, world barrier
    assert summary.flows == (2 + 4) * len(traced) + (2 + 2 + 3) * len(traced)  # arrows: barrier has 3 hops
    assert_perfetto_reads_flows(out, summary.flows)
    report = summary.report
    assert report.violations_before > 0 and report.violations == 0
    for r, got in recovered_skews(report).items():
        assert abs(got - SKEWS[r]) < 2 * MS, (r, got, SKEWS[r], report)
    aligned, _ = align_traces(traces)
    assert min(p2p_gaps(aligned)) >= 0


# ----------------------------------------------------------------------------- scale
@pytest.mark.slow
def test_1024_ranks_align_and_detect():
    """TP8 x PP4 x DP32 = 1,024 simulated ranks, clocks skewed by up to +-50 ms: alignment
    restores causality and detection names the one slowed rank."""
    from scan_simulation import SimulatedJob, simulate_job_traces

    from megatronapp.scan.analyze.load_align_detect import analyze_traces

    job = SimulatedJob(tp_size=8, pp_size=4, dp_size=32, iterations=3, seed=11, slow_rank=517, slow_factor=1.6)
    traces = simulate_job_traces(job)
    skews = np.random.default_rng(0).integers(-50 * MS, 50 * MS, size=len(traces))
    skewed = []
    for t, skew in zip(traces, skews.tolist()):
        ev = t.events
        for col in ("start_ns", "end_ns"):  # device and host wall clock both off: only the trace tells
            shifted = ev.column(col).to_numpy() + skew
            ev = ev.set_column(ev.schema.get_field_index(col), ev.schema.field(col), pa.array(shifted, pa.int64()))
        skewed.append(RankTrace(meta=t.meta, events=ev, path=t.path))
    analysis = analyze_traces(skewed)
    report = analysis.alignment
    assert report.violations_before > 0 and report.violations == 0
    errors = [abs(got - int(skews[r] - skews[0])) for r, got in recovered_skews(report).items()]
    assert np.median(errors) < 0.1 * MS and max(errors) < 2 * MS
    assert [(s.rank, s.cause) for s in analysis.detection.suspects] == [(517, "slow_compute")]
