"""MegaScan file format: roundtrip, malformed files, truncated streams, directory loading."""

from __future__ import annotations

import json
import warnings

import pyarrow as pa
import pytest

from megatronapp.scan.record.format import (
    CATEGORIES,
    EVENT_COLUMNS,
    TraceFormatError,
    TraceWriter,
    build_event_batch,
    build_rank_meta,
    load_rank_trace,
    load_trace_dir,
    trace_file_name,
)


def make_meta(rank: int = 0, world_size: int = 4) -> dict:
    return build_rank_meta(
        rank=rank,
        world_size=world_size,
        coords={"tp": rank % 2, "dp": 0, "pp": rank // 2},
        layout={"tp_size": 2, "pp_size": 2, "dp_size": 1, "virtual_pp_size": 1},
        host="node0",
        device="cpu",
        run_id="run-x",
        clock="monotonic",
        run={"lr": 0.1},
    )


def rows_for(iteration: int, names: list[str]) -> list[dict]:
    return [
        {
            "name": n,
            "cat": "comm" if n == "all_reduce" else "compute",
            "start_ns": 1000 * k + iteration,
            "end_ns": 1000 * k + 500 + iteration,
            "iteration": iteration,
            "microbatch": k,
            "op": "all_reduce" if n == "all_reduce" else "",
            "group": "1:[0,1]" if n == "all_reduce" else "",
            "seq": k if n == "all_reduce" else -1,
            "bytes": 64 if n == "all_reduce" else -1,
        }
        for k, n in enumerate(names)
    ]


def write_trace(path, meta, batches, close=True) -> None:
    writer = TraceWriter(path, meta)
    for rows in batches:
        writer.append(rows)
    if close:
        writer.close()


def test_roundtrip_keeps_meta_rows_and_per_batch_dictionaries(tmp_path):
    meta = make_meta(rank=3)
    # Different names per batch exercise dictionary replacement in the stream.
    batches = [rows_for(1, ["forward", "all_reduce"]), rows_for(2, ["backward", "optimizer", "all_reduce"])]
    path = tmp_path / trace_file_name(3)
    write_trace(path, meta, batches)
    trace = load_rank_trace(path)
    assert trace.meta == meta and trace.rank == 3 and not trace.partial
    assert trace.events.column_names == list(EVENT_COLUMNS)
    got = trace.events.to_pylist()
    expected = [r for b in batches for r in b]
    assert len(got) == len(expected)
    for row, want in zip(got, expected):
        for key, value in want.items():
            assert row[key] == value, (key, row, want)
        assert row["peer"] == -1 and row["layer"] == -1 and row["chunk"] == -1


def test_columns_are_non_null_with_spec_types(tmp_path):
    path = tmp_path / trace_file_name(0)
    write_trace(path, make_meta(), [rows_for(1, ["forward"])])
    schema = load_rank_trace(path).events.schema
    for name in ("name", "cat", "op", "group"):
        assert pa.types.is_dictionary(schema.field(name).type)
    assert schema.field("chunk").type == pa.int16() and schema.field("seq").type == pa.int64()
    assert all(not schema.field(c).nullable for c in EVENT_COLUMNS)


def test_writer_rejects_bad_rows_and_meta(tmp_path):
    with pytest.raises(ValueError, match="unknown MegaScan event columns"):
        build_event_batch([{"name": "x", "colour": "red"}])
    with pytest.raises(ValueError, match="categories"):
        build_event_batch([{"name": "x", "cat": "gpu"}])
    bad_meta = {k: v for k, v in make_meta().items() if k != "coords"}
    with pytest.raises(TraceFormatError, match="coords"):
        TraceWriter(tmp_path / "r.mscan", bad_meta)
    writer = TraceWriter(tmp_path / trace_file_name(0), make_meta())
    writer.close()
    with pytest.raises(ValueError, match="after close"):
        writer.append(rows_for(1, ["forward"]))
    assert set(CATEGORIES) == {"step", "compute", "comm", "user", "calib"}


@pytest.mark.parametrize(
    "content",
    [b"", b"this is not arrow at all" * 10, json.dumps({"traceEvents": []}).encode()],
    ids=["empty", "text", "json"],
)
def test_non_arrow_file_raises_format_error_naming_the_file(tmp_path, content):
    path = tmp_path / "rank00000.mscan"
    path.write_bytes(content)
    with pytest.raises(TraceFormatError, match="rank00000.mscan"):
        load_rank_trace(path)


def test_arrow_stream_without_megascan_meta_is_rejected(tmp_path):
    path = tmp_path / "rank00001.mscan"
    table = pa.table({"x": [1, 2]})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    with pytest.raises(TraceFormatError, match="rank00001.mscan.*not a MegaScan trace"):
        load_rank_trace(path)


def test_meta_of_future_schema_version_is_rejected(tmp_path):
    path = tmp_path / trace_file_name(0)
    meta = make_meta()
    schema = build_event_batch([]).schema.with_metadata({b"megascan": json.dumps({**meta, "schema_version": 99})})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema):
        pass
    with pytest.raises(TraceFormatError, match="schema_version 99"):
        load_rank_trace(path)


def test_truncated_stream_returns_complete_batches_and_warns(tmp_path):
    path = tmp_path / trace_file_name(2)
    batches = [rows_for(1, ["forward"]), rows_for(2, ["backward", "all_reduce"]), rows_for(3, ["optimizer"] * 4)]
    write_trace(path, make_meta(rank=2), batches)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 40])  # cut inside the last batch
    with pytest.warns(UserWarning, match="rank00002.mscan"):
        trace = load_rank_trace(path)
    assert trace.partial
    assert trace.events.num_rows == len(batches[0]) + len(batches[1])
    assert trace.events.column("iteration").to_pylist() == [1, 2, 2]


def test_unclosed_writer_leaves_readable_partial_file(tmp_path):
    fresh = TraceWriter(tmp_path / trace_file_name(7), make_meta(rank=7))  # crashed before any event
    with pytest.warns(UserWarning, match="rank00007.mscan"):
        empty = load_rank_trace(fresh.path)
    assert empty.partial and empty.events.num_rows == 0 and empty.rank == 7
    fresh.close()
    path = tmp_path / trace_file_name(1)
    write_trace(path, make_meta(rank=1), [rows_for(1, ["forward", "backward"])], close=False)
    with pytest.warns(UserWarning, match="end-of-stream"):
        trace = load_rank_trace(path)
    assert trace.partial and trace.events.num_rows == 2


def test_load_trace_dir_sorts_filters_and_keeps_calibration(tmp_path):
    for rank in (3, 0, 2, 1):
        batches = [rows_for(it, ["forward", "all_reduce"]) for it in (1, 2, 3)]
        batches.append([{"name": "clock", "cat": "calib", "start_ns": 5, "end_ns": 7}])
        write_trace(tmp_path / trace_file_name(rank), make_meta(rank=rank), batches)
    (tmp_path / "notes.txt").write_text("ignored")
    traces = load_trace_dir(tmp_path)
    assert [t.rank for t in traces] == [0, 1, 2, 3]
    some = load_trace_dir(tmp_path, ranks=[2, 0], iterations=range(2, 3))
    assert [t.rank for t in some] == [0, 2]
    for t in some:
        cats = t.events.column("cat").to_pylist()
        iters = t.events.column("iteration").to_pylist()
        assert cats.count("calib") == 1
        assert {i for i, c in zip(iters, cats) if c != "calib"} == {2}
    listed = load_trace_dir(tmp_path, iterations={1, 3})
    assert set(listed[0].events.column("iteration").to_pylist()) == {1, 3, -1}


def test_load_trace_dir_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="no MegaScan files"):
        load_trace_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_trace_dir(tmp_path / "nope")
    write_trace(tmp_path / trace_file_name(0), make_meta(rank=1), [])
    with pytest.raises(TraceFormatError, match="rank00000.mscan.*meta says 1"):
        load_trace_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"ranks \[5\]"):
        load_trace_dir(tmp_path, ranks=[5])
    (tmp_path / trace_file_name(0)).write_bytes(b"garbage")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(TraceFormatError, match="rank00000.mscan"):
            load_trace_dir(tmp_path)


def _trace_base_steps(trace_dir, steps: int) -> None:
    """What base granularity records for a single-stage job with 2 microbatches (the
    launch-bound case the overhead goal is judged on): 9 spans a step, handed to the writer once, at close."""
    from megatronapp import spans
    from megatronapp.scan.record.tracer import TraceConfig, Tracer

    config = TraceConfig(enabled=True, trace_dir=str(trace_dir), interval=1, flush_seconds=3600.0)
    tracer = Tracer(config, make_meta(rank=0, world_size=1), "cpu")
    for it in range(1, steps + 1):
        tracer.step_begin(it)
        for mb in range(2):
            with tracer.span(spans.FORWARD, microbatch=mb, chunk=0), tracer.span(spans.LOSS, microbatch=mb):
                pass
        for mb in range(2):
            with tracer.span(spans.BACKWARD, microbatch=mb, chunk=0):
                pass
        with tracer.span(spans.GRAD_REDUCE, cat="comm"):
            pass
        with tracer.span(spans.OPTIMIZER):
            pass
        tracer.step_end(it)
    tracer.close()


@pytest.mark.parametrize("steps", [20, 100])
def test_short_base_trace_takes_at_most_40_bytes_per_event(tmp_path, steps):
    """A short trace is mostly fixed cost (schema, per-batch headers): the file writes the schema
    itself instead of an empty batch, string dictionaries only when they grow, and the start
    calibration pair with the first window."""
    _trace_base_steps(tmp_path, steps)
    path = tmp_path / trace_file_name(0)
    events = load_rank_trace(path).events
    spans_ = events.filter(pa.compute.not_equal(events.column("cat").cast(pa.string()), "calib"))
    assert spans_.num_rows == 9 * steps
    assert path.stat().st_size / spans_.num_rows <= 40
    assert events.num_rows - spans_.num_rows == 2  # start and end calibration pairs, both kept
    assert spans_.column("name").to_pylist()[:9] == [
        "loss",
        "forward",
        "loss",
        "forward",
        "backward",
        "backward",
        "grad_reduce",
        "optimizer",
        "iteration",
    ]
    assert spans_.column("microbatch").to_pylist()[:6] == [0, 0, 1, 1, 0, 1]
