"""The streaming merge (merge.py) against the in-memory reference merge it replaced
(scan_merge_reference.py), and its state bounded whatever the trace length."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import scan_merge_reference as reference
from scan_simulation import SimulatedJob, simulate_job_traces, write_repeated_job

import megatronapp.scan.merge.merge as merge
from megatronapp.scan.record.format import TraceWriter, trace_file_name


def _write(traces, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for t in traces:
        with TraceWriter(path / trace_file_name(t.rank), t.meta) as w:
            for batch in t.events.to_batches(max_chunksize=97):  # many batches, like a real run
                w.append(batch)
    return path


def _canonical(path: Path) -> tuple[list, list, dict]:
    """Spans and metadata as sorted JSON; flows as sorted chains (flow ids renumbered)."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    events = doc["traceEvents"]
    spans = sorted(json.dumps(e, sort_keys=True) for e in events if e["ph"] in ("X", "M"))
    chains: dict[int, list] = {}
    for e in events:
        if e["ph"] in ("s", "t", "f"):
            chains.setdefault(e["id"], []).append((e["ph"], e["name"], e["pid"], e["tid"], e["ts"], e.get("bp")))
    flows = sorted(json.dumps(sorted(c)) for c in chains.values())
    other = doc["otherData"]["megascan"]
    other["alignment"].pop("sample_iterations", None)
    other.pop("merge")
    return spans, flows, other


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory) -> Path:
    job = SimulatedJob(
        tp_size=2, pp_size=2, dp_size=2, iterations=5, num_microbatches=4, seed=7, slow_rank=3, slow_factor=1.5
    )
    return _write(simulate_job_traces(job), tmp_path_factory.mktemp("trace"))


@pytest.mark.parametrize("window_events", [150, 1 << 16])  # many small windows; one window
@pytest.mark.parametrize("options", [{}, {"iterations": range(1, 4), "ranks": [0, 2, 3, 5, 6]}], ids=["all", "subset"])
def test_streamed_merge_equals_in_memory_merge(trace_dir, tmp_path, monkeypatch, window_events, options):
    monkeypatch.setattr(merge, "WINDOW_EVENTS", window_events)
    streamed = merge.merge_traces(trace_dir, tmp_path / "s.json.gz", **options)
    expected = reference.merge_traces(trace_dir, tmp_path / "r.json", **options)
    assert _canonical(tmp_path / "s.json.gz") == _canonical(tmp_path / "r.json")
    assert (streamed.events, streamed.arrivals, streamed.flows) == (expected.events, expected.arrivals, expected.flows)
    assert streamed.arrivals > 0 and (streamed.unmatched == 0) == (not options)  # a subset leaves ends alone


def test_streamed_split_equals_in_memory_split(trace_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(merge, "WINDOW_EVENTS", 200)
    streamed = merge.merge_traces_split(trace_dir, tmp_path / "s" / "t.json", 2)
    expected = reference.merge_traces_split(trace_dir, tmp_path / "r" / "t.json", 2)
    assert [Path(s.out).name for s in streamed] == [Path(s.out).name for s in expected] and len(streamed) == 3
    for s, r in zip(streamed, expected):
        assert _canonical(Path(s.out)) == _canonical(Path(r.out))


def test_merge_state_does_not_grow_with_trace_length(tmp_path, monkeypatch):
    """Same job, 4x the iterations: 4x the events and arrows, the same peak window and pending
    state (what bounds memory), nothing left unmatched."""
    monkeypatch.setattr(merge, "WINDOW_EVENTS", 2000)
    job = SimulatedJob(tp_size=2, pp_size=2, dp_size=2, num_microbatches=4, seed=1)
    summaries = []
    for iterations in (10, 40):
        d = tmp_path / f"it{iterations}"
        d.mkdir()
        events = write_repeated_job(job, d, iterations, iterations_per_batch=3)
        summaries.append(merge.merge_traces(d, tmp_path / f"it{iterations}.json"))
        assert summaries[-1].events == events and summaries[-1].unmatched == 0
    short, long = summaries
    assert long.events == 4 * short.events and long.flows == 4 * short.flows and long.arrivals == 4 * short.arrivals
    assert long.peak_window_rows == short.peak_window_rows <= 2000 + long.arrivals // 40 * 3
    assert long.peak_pending == short.peak_pending == 0


def test_unmatched_ends_are_dropped_after_one_window_and_counted(tmp_path, monkeypatch):
    """Only one side of every pipeline message is merged: each send waits one window, then is
    dropped, so the pending state stays at one window's sends however long the trace."""
    monkeypatch.setattr(merge, "WINDOW_EVENTS", 40)  # rank 0 writes 19 rows per iteration: 2 per window
    job = SimulatedJob(tp_size=1, pp_size=2, dp_size=1, num_microbatches=4, seed=2)
    peaks = []
    for iterations in (8, 32):
        d = tmp_path / f"it{iterations}"
        d.mkdir()
        write_repeated_job(job, d, iterations, iterations_per_batch=2)
        summary = merge.merge_traces(d, tmp_path / f"{iterations}.json", ranks=[0])
        # rank 0 sends 4 activations and receives 4 gradients per iteration
        assert summary.arrivals == 0 and summary.unmatched == iterations * 8
        peaks.append(summary.peak_pending)
    assert peaks[0] == peaks[1] == 2 * 8


def test_fixed_width_numbers_are_the_exact_decimals():
    import numpy as np

    from megatronapp.scan.merge.fixed_lines import format_micros, format_uints

    rng = np.random.default_rng(0)
    values = np.concatenate([[0, 1, 9, 10, 999, 1000, 10**18], rng.integers(0, 10**12, 500), rng.integers(0, 100, 50)])
    assert [bytes(r).decode().lstrip(" ") for r in format_uints(values)] == [str(v) for v in values.tolist()]
    assert [bytes(r).decode().lstrip(" ") for r in format_micros(values[:-1])] == [
        f"{v // 1000}.{v % 1000:03d}" for v in values[:-1].tolist()
    ]
    for dtype in (np.uint8, np.int16, np.int32):  # narrow columns (chunk, layer are int16)
        narrow = np.array([0, 7, 100, min(9999, np.iinfo(dtype).max)], dtype)
        assert [bytes(r).decode().lstrip(" ") for r in format_uints(narrow)] == [str(v) for v in narrow.tolist()]


def test_truncated_rank_is_merged_up_to_its_last_batch_and_reported(trace_dir, tmp_path):
    import shutil
    import warnings

    broken = tmp_path / "broken"
    shutil.copytree(trace_dir, broken)
    victim = broken / trace_file_name(4)
    victim.write_bytes(victim.read_bytes()[:-300])  # a crash mid-batch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = merge.merge_traces(broken, tmp_path / "t.json")
    assert [str(w.message).split(":")[0] for w in caught] == [str(victim)]  # warned once
    with open(tmp_path / "t.json") as f:
        other = json.load(f)["otherData"]["megascan"]
    full = merge.merge_traces(trace_dir, tmp_path / "full.json")
    assert other["partial_ranks"] == [4] and 0 < full.events - summary.events < 200


@pytest.mark.parametrize("seed", range(6))
def test_line_blocks_equal_python_formatting_for_random_layouts(seed):
    """Word stores overhang their field (fixed_lines.py): whatever the layout (numbers next to
    numbers or strings, at a line's start or end, one char wide), every line is exact, and
    blocks sharing an arena do not overwrite each other."""
    import numpy as np

    from megatronapp.scan.merge.fixed_lines import LineBlock, OutputArena, TextTable

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    arena = OutputArena()
    made = []
    for _ in range(3):
        block, expected = LineBlock(n, arena), [""] * n
        for _ in range(int(rng.integers(1, 8))):
            kind = rng.choice(["text", "uint", "micros", "field"])
            if kind == "text":
                text = "".join(rng.choice(list('ab,:{}"')) for _ in range(int(rng.integers(0, 4))))
                block.text(text)
                column = [text] * n
            elif kind == "field":
                words = ["".join(rng.choice(list("xyz")) for _ in range(k)) for k in range(1, 6)]
                ids = rng.integers(0, len(words), n)
                block.field(TextTable(words).take(ids))
                width = max(len(words[i]) for i in ids)
                column = [words[i].ljust(width) for i in ids]
            else:
                values = rng.integers(0, 10 ** int(rng.integers(1, 13)), n)
                if kind == "uint":
                    block.uint(values)
                    text = [str(v) for v in values.tolist()]
                else:
                    block.micros(values)
                    text = [f"{v // 1000}" for v in values.tolist()]
                width = max(len(t) for t in text)
                column = [t.rjust(width) for t in text]
                if kind == "micros":
                    column = [c + f".{v % 1000:03d}" for c, v in zip(column, values.tolist())]
            expected = [e + c for e, c in zip(expected, column)]
        made.append((block.to_bytes(), "".join(expected).encode()))
    for got, want in made:
        assert bytes(got) == want


def test_collective_member_order_equals_lexsort_of_the_four_keys():
    """The packed two-key sort (matching._instance_order) is np.lexsort((rank, start, seq, group)),
    also where the keys do not fit its packing (then it is the lexsort itself)."""
    import numpy as np

    from megatronapp.scan.merge.matching import _instance_order

    rng = np.random.default_rng(0)
    for start_range, seq_range in [(50, 20), (10**12, 2**31 - 1), (2**61, 30), (100, 2**40)]:
        n = 3000
        group, seq = rng.integers(0, 6, n), rng.integers(0, seq_range, n)
        start, rank = rng.integers(0, start_range, n), rng.integers(0, 64, n)
        assert np.array_equal(_instance_order(group, seq, start, rank), np.lexsort((rank, start, seq, group)))


def test_distinct_keys_equal_np_unique():
    import numpy as np

    from megatronapp.scan.merge.merge_window import _distinct

    rng = np.random.default_rng(1)
    for keys in (rng.integers(0, 50, 1000), rng.integers(0, 10**12, 1000), np.array([7]), np.zeros(0, np.int64)):
        assert np.array_equal(_distinct(keys), np.unique(keys))


def test_alignment_sample_holds_the_keyed_comm_rows_of_the_first_iterations(tmp_path):
    """The survey decodes every column only until its sample of ALIGN_SAMPLE_ITERATIONS is
    settled, then a few columns: its sample still equals the keyed comm rows of those iterations
    from a full load, in file order, a late one (written after the sample settled) included,
    and every calibration pair."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from megatronapp.scan.merge.stream import survey_rank
    from megatronapp.scan.record.format import load_rank_trace

    job = SimulatedJob(tp_size=2, pp_size=2, dp_size=1, iterations=14, num_microbatches=2, seed=4)
    trace = simulate_job_traces(job)[1]
    events = trace.events
    keyed = np.flatnonzero(
        pc.and_(
            pc.equal(events.column("cat").cast(pa.string()), "comm"), pc.equal(events.column("iteration"), 1)
        ).to_numpy(zero_copy_only=False)
    )[:2]
    late = np.concatenate([np.setdiff1d(np.arange(events.num_rows), keyed), keyed])  # two rows of iteration 1 come last
    path = _write([type(trace)(trace.meta, events.take(pa.array(late)), trace.path)], tmp_path)
    survey = survey_rank(path / trace_file_name(1), None, merge.ALIGN_SAMPLE_ITERATIONS)

    full = load_rank_trace(path / trace_file_name(1)).events
    cat = full.column("cat").cast(pa.string()).to_numpy(zero_copy_only=False)
    its, seq = full.column("iteration").to_numpy(), full.column("seq").to_numpy()
    first = list(dict.fromkeys(its[cat != "calib"].tolist()))[: merge.ALIGN_SAMPLE_ITERATIONS]
    want = full.filter(pa.array((cat == "comm") & (seq >= 0) & np.isin(its, first)))
    got = survey.trace.events
    got_cat = got.column("cat").cast(pa.string()).to_numpy(zero_copy_only=False)
    assert got.filter(pa.array(got_cat == "comm")).cast(full.schema).to_pylist() == want.to_pylist()
    assert sum(r["iteration"] == 1 for r in want.to_pylist()[-2:]) == 2  # the late rows are in it
    calib = full.filter(pa.array(cat == "calib"))
    got_calib = got.filter(pa.array(got_cat == "calib"))
    assert got_calib.column("start_ns").to_pylist() == calib.column("start_ns").to_pylist()
    assert got_calib.column("end_ns").to_pylist() == calib.column("end_ns").to_pylist()
    assert survey.events == int((cat != "calib").sum()) and len(first) == merge.ALIGN_SAMPLE_ITERATIONS
