"""benchmarks/fbd_bench.py's layouts and runs: the layouts it picks on CUDA are ones NCCL can run
(checked with the package's placement rules), and the script run as a program keeps to its time
budget and trains the one-device layout (backward PP1 + a forward worker) on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatronapp.config import build_layout
from megatronapp.fbd.layout import RoleLayout, compute_role_placements, role_group_ranks
from megatronapp.parallel.placement import check_gpu_groups, compute_plain_placements, engine_group_ranks

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fbd_bench.py"


def _run(*argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("gpus, pp", [(1, 1), (2, 2), (8, 2)])
def test_the_cuda_default_layouts_fit_the_visible_gpus(gpus, pp):
    """The benchmark's CUDA defaults (TP1, DP1, PP1 on one GPU else PP2, TF1): the plain engine,
    FBD with forward workers on the backward GPUs, and FBD with forward workers on CPUs."""
    plain = compute_plain_placements(pp, "cuda", gpus)
    check_gpu_groups(engine_group_ranks(build_layout(pp, 1, pp)), plain, gpus)
    roles = RoleLayout(2 * pp, 1, pp, 1)
    for forward in ("cuda", "cpu"):
        check_gpu_groups(role_group_ranks(roles), compute_role_placements(roles, "cuda", forward, gpus), gpus)


def test_pp2_on_one_gpu_is_refused_for_the_engine_and_for_fbd():
    with pytest.raises(ValueError, match=r"pipeline-parallel group \[0, 1\] would put ranks 0 and 1 on GPU 0"):
        check_gpu_groups(engine_group_ranks(build_layout(2, 1, 2)), compute_plain_placements(2, "cuda", 1), 1)
    roles = RoleLayout(4, 1, 2, 1)
    with pytest.raises(ValueError, match=r"backward pipeline-parallel group \[0, 1\]"):
        check_gpu_groups(role_group_ranks(roles), compute_role_placements(roles, "cuda", "cuda", 1), 1)


def test_jobs_past_the_budget_are_skipped_and_reported(tmp_path):
    out = tmp_path / "r.json"
    proc = _run("--budget-s", "0", "--rounds", "1", "--out", str(out), "--max-micro-batch", "4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["throughput"]) == {"plain", "recompute", "fbd", "free_forward"}
    assert all(e["errors"] == ["skipped: time budget spent"] for e in report["throughput"].values())
    assert all(e["largest"] is None for e in report["max_micro_batch"].values())


@pytest.mark.slow
def test_one_device_layout_runs_plain_and_fbd(tmp_path):
    """Backward PP1 + one forward worker on the same device, and the plain engine at PP1."""
    out = tmp_path / "r.json"
    proc = _run(
        "--device",
        "cpu",
        "--pp",
        "1",
        "--dp",
        "1",
        "--variants",
        "plain",
        "fbd",
        "--rounds",
        "1",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--timeout",
        "240",
        "--out",
        str(out),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    for variant in ("plain", "fbd"):
        entry = report["throughput"][variant]
        assert entry["errors"] == [] and entry["tokens_per_s"]["median"] > 0, entry
