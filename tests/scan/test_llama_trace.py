"""MegaScan on a Llama-family run: a traced PP2 job of llama-tiny (tied embeddings across the
stages) merges into one timeline with its per-layer attention and MLP spans."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "megatronapp.cli.main", *args], capture_output=True, text=True, timeout=240, env=env
    )


def test_traced_llama_pp2_run_merges_with_layer_spans(tmp_path):
    train = [
        "train",
        "--device",
        "cpu",
        "--model",
        "llama-tiny",
        "--nproc-per-node",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--train-iters",
        "3",
        "--global-batch-size",
        "4",
        "--micro-batch-size",
        "2",
        "--trace",
        "--trace-granularity",
        "full",
        "--trace-dir",
        str(tmp_path / "t"),
    ]
    res = _run(train)
    assert res.returncode == 0, res.stderr[-3000:]
    out = tmp_path / "timeline.json.gz"
    res = _run(["trace", "merge", str(tmp_path / "t"), "-o", str(out)])
    assert res.returncode == 0, res.stderr
    events = json.loads(gzip.decompress(out.read_bytes()))["traceEvents"]
    spans = {e["name"] for e in events if e.get("ph") == "X"}
    assert {"forward", "backward", "optimizer", "send", "recv", "attention", "mlp"} <= spans, spans
