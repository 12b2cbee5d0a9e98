"""MegaScan on real multi-process training runs: traced TP2xPP2xDP2 merge, injected faults found.

Each run is a real `megatronapp train` job (gloo, CPU) with --trace; detection runs through
the CLI exactly as a user would (`trace detect DIR --json`).
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import pytest
from timeline_checks import assert_flows_forward, assert_perfetto_reads_flows

from megatronapp.scan.merge.align import align_traces
from megatronapp.scan.merge.matching import index_comm_events
from megatronapp.scan.record.format import load_trace_dir

TRAIN = [
    sys.executable,
    "-m",
    "megatronapp.cli.main",
    "train",
    "--device",
    "cpu",
    "--model",
    "tiny",
    "--seq-length",
    "64",
    "--hidden-size",
    "64",
]


def _run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)


def _train_traced(trace_dir, *extra: str, layout=("2", "2"), nproc="8", iters="6") -> None:
    tp, pp = layout
    res = _run(
        TRAIN
        + [
            "--nproc-per-node",
            nproc,
            "--tensor-model-parallel-size",
            tp,
            "--pipeline-model-parallel-size",
            pp,
            "--train-iters",
            iters,
            "--global-batch-size",
            "16",
            "--micro-batch-size",
            "2",
            "--trace",
            "--trace-dir",
            str(trace_dir),
            *extra,
        ]
    )
    assert res.returncode == 0, res.stderr[-3000:]


def _detect(trace_dir) -> tuple[int, dict]:
    res = _run([sys.executable, "-m", "megatronapp.cli.main", "trace", "detect", str(trace_dir), "--json"])
    assert res.returncode in (0, 3), res.stderr
    return res.returncode, json.loads(res.stdout)


def test_traced_tp2_pp2_dp2_run_merges_into_one_timeline(tmp_path):
    _train_traced(tmp_path / "t")
    assert sorted(p.name for p in (tmp_path / "t").glob("rank*.mscan")) == [f"rank{r:05d}.mscan" for r in range(8)]
    out = tmp_path / "timeline.json.gz"
    res = _run([sys.executable, "-m", "megatronapp.cli.main", "trace", "merge", str(tmp_path / "t"), "-o", str(out)])
    assert res.returncode == 0, res.stderr
    trace = json.loads(gzip.decompress(out.read_bytes()))
    events = trace["traceEvents"]
    names = {e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    assert len(names) == 8 and any("pp1" in n and "dp1" in n and "tp1" in n for n in names)
    spans = {e["name"] for e in events if e.get("ph") == "X"}
    assert {"iteration", "forward", "backward", "optimizer", "send", "recv", "all_reduce"} <= spans
    flows = [e for e in events if e.get("ph") in ("s", "f")]
    assert flows, "expected flow arrows for sends and collectives"
    assert_flows_forward(trace)
    stats = trace["otherData"]["megascan"]["merge"]
    assert stats["arrivals"] == trace["otherData"]["megascan"]["alignment"]["p2p_messages"] > 0
    assert_perfetto_reads_flows(out, stats["flows"])


@pytest.fixture(scope="module")
def clean_report(tmp_path_factory):
    # 32 iterations, as the held-out clean runs whose false-alarm rate BENCHMARKS.md reports
    # (megatronapp.faultlab.evaluation.injected_runner.ITERS). With 8 (CI stop 22), a few hundred ms of a busy neighbour on the
    # 2-core CI host made one replica >= 1.2x its peer in 5 of the 7 judged iterations: the
    # constant-slowdown bar, met by noise over too short a run.
    # The detector bounds its false alarms, it does not exclude them (intermittent_alpha 0.005 by
    # its noise model; 0 of 50 clean held-out runs named anybody). A clean-clone CI run saw one on this
    # 2-core host with 4 ranks: an "intermittent" rank costing 0.05 ms of a 46 ms iteration. So
    # a first alarm gets one more clean run; two in a row (a systematic false alarm) still fail.
    reports = []
    for attempt in range(2):
        d = tmp_path_factory.mktemp(f"clean{attempt}")
        _train_traced(d, layout=("1", "2"), nproc="4", iters="32")
        reports.append(_detect(d))
        if reports[-1][0] == 0 and not reports[-1][1]["suspects"]:
            break
    return reports


def test_clean_run_names_nobody(clean_report):
    code, report = clean_report[-1]
    first = clean_report[0][1]["suspects"]
    assert code == 0 and report["suspects"] == [], f"two clean runs in a row named {first} and {report['suspects']}"


def test_injected_slow_rank_is_named_as_root_cause(tmp_path):
    # 16 iterations: with 8, four ranks on two busy cores named nobody or a peer in 1 of 3 runs
    _train_traced(tmp_path, "--inject-slowdown", "2:2.0", layout=("1", "2"), nproc="4", iters="16")
    code, report = _detect(tmp_path)
    assert code == 3
    top = report["suspects"][0]
    assert top["rank"] == 2 and top["cause"] == "slow_compute"


def test_injected_slow_link_is_named(tmp_path):
    # PP2 x DP2: rank 0 (pp0, dp0) sends activations to rank 2 (pp1, dp0).
    _train_traced(tmp_path, "--inject-link-delay", "0:2:40", layout=("1", "2"), nproc="4", iters="8")
    code, report = _detect(tmp_path)
    assert code == 3, report
    top = report["suspects"][0]
    assert top["cause"] == "slow_link"
    assert tuple(top["link"]) == (0, 2)
    # Rank 2 sees every message from rank 0 at least 40 ms after it was sent. (That rank 0's
    # send itself is not held up is checked in tests/injection/test_injection.py: here a send span
    # ends only when the runtime waits on its whole batch, which also holds the recv of the
    # delayed gradient.)
    index = index_comm_events(align_traces(load_trace_dir(tmp_path))[0])
    late_ms = [(recv.end - send.start) / 1e6 for (src, dst, _), send, recv in index.messages() if (src, dst) == (0, 2)]
    assert late_ms and min(late_ms) >= 0.9 * 40, late_ms
