"""benchmarks/dpp_gpu_sim.py run as a program: a tiny end-to-end run on CPU (the GPU run is the
same code on --device cuda) and one-line refusals. Its cost model: tests/dpp/test_dpp_study.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatronapp.dpp.scheduler import compute_default_caps

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "dpp_gpu_sim.py"


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=300)


def test_cpu_tiny_run_writes_costs_memory_and_ratios(tmp_path):
    proc = _run(
        "--device",
        "cpu",
        "--preset",
        "tiny",
        "--num-layers",
        "8",
        "-m",
        "4",
        "--iters",
        "3",
        "--seeds",
        "2",
        "--scenarios",
        "balanced",
        "jitter1",
        "--traversals",
        "in-order",
        "--out",
        str(tmp_path),
        "--keep-trace",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads((tmp_path / "dpp_gpu_sim.json").read_text())
    assert len(doc["forward_s"]) == 4 and all(len(r) == 2 and min(r) > 0 for r in doc["forward_s"] + doc["backward_s"])
    sets = doc["activation_set_bytes"]
    layers_only = [sets[p][c] for p in range(4) for c in range(2) if (p, c) not in ((0, 0), (3, 1))]
    assert min(layers_only) > 0 and len(set(layers_only)) == 1  # same shape, same saved tensors
    assert sets[3][1] > layers_only[0]  # the head's logits are kept too
    rows = doc["results"]["jitter1"]["rows"]
    assert rows["interleaved/rendezvous"]["speed"] == 1.0
    caps = compute_default_caps(4, 2, 4)
    assert all(0 < p <= c for p, c in zip(rows["dynamic-in-order"]["peak_activation_sets"], caps))
    assert rows["dynamic-in-order"]["peak_activation_MiB"] == rows["interleaved/eager"]["peak_activation_MiB"]
    assert list((tmp_path / "trace").glob("rank*.mscan"))


def test_bad_setup_is_one_line_exit_2():
    proc = _run("--device", "cpu", "--preset", "tiny")  # 4 layers into PP4 x V2
    assert proc.returncode == 2 and "do not split" in proc.stderr
    assert _run("--device", "cpu", "--pp", "2").returncode == 2


@pytest.mark.gpu
def test_cuda_run_times_chunks_with_cuda_events(tmp_path):
    """The same pipeline on CUDA (bf16, the tracer's CUDA-event clock): every task timed > 0."""
    proc = _run(
        "--device",
        "cuda",
        "--preset",
        "tiny",
        "--num-layers",
        "8",
        "-m",
        "4",
        "--iters",
        "3",
        "--seeds",
        "1",
        "--scenarios",
        "balanced",
        "--traversals",
        "in-order",
        "--out",
        str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads((tmp_path / "dpp_gpu_sim.json").read_text())
    assert doc["args"]["dtype"] == "bf16" and doc["device"] != "cpu"
    assert all(min(r) > 0 for r in doc["forward_s"] + doc["backward_s"])
