"""benchmarks/fbd_bench.py: layouts that fit the machine, refusals before spawning, the time
budget, and one small CPU run of the one-device layout (backward PP1 + a forward worker)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import fbd_bench  # noqa: E402
from fbd_bench_rank import compute_placements  # noqa: E402


def _cfg(monkeypatch, gpus: int, *argv: str):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    cfg = fbd_bench.build_parser().parse_args(list(argv))
    fbd_bench.resolve_defaults(cfg)
    return cfg


@pytest.mark.parametrize("gpus, pp", [(1, 1), (2, 2), (8, 2)])
def test_cuda_defaults_fit_the_visible_gpus(monkeypatch, gpus, pp):
    cfg = _cfg(monkeypatch, gpus, "--device", "cuda")
    assert (cfg.tp, cfg.pp, cfg.dp, cfg.model) == (1, pp, 1, "350m")
    assert cfg.variants == list(fbd_bench.VARIANTS) and "fbd_cpu_forward" not in cfg.search_variants
    for variant in cfg.variants:  # every default variant is a layout NCCL can run
        compute_placements(variant, cfg, gpus)


def test_a_layout_nccl_cannot_run_is_refused_without_spawning(monkeypatch):
    cfg = _cfg(monkeypatch, 1, "--device", "cuda", "--pp", "2")
    (res,) = fbd_bench.run_job("plain", cfg, [(8, 4, 1, 0)], fbd_bench.Budget(None))
    assert res["error"].startswith("layout refused: pipeline-parallel group [0, 1] would put ranks 0 and 1 on GPU 0")
    (res,) = fbd_bench.run_job("fbd", cfg, [(8, 4, 1, 0)], fbd_bench.Budget(None))
    assert "backward pipeline-parallel group [0, 1]" in res["error"]


def test_jobs_past_the_budget_are_skipped_and_reported(monkeypatch, tmp_path):
    out = tmp_path / "r.json"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert fbd_bench.main(["--budget-s", "0", "--rounds", "1", "--out", str(out), "--max-micro-batch", "4"]) == 0
    report = json.loads(out.read_text())
    assert set(report["throughput"]) == {"plain", "recompute", "fbd", "free_forward"}
    assert all(e["errors"] == ["skipped: time budget spent"] for e in report["throughput"].values())
    assert all(e["largest"] is None for e in report["max_micro_batch"].values())


@pytest.mark.slow
def test_one_device_layout_runs_plain_and_fbd(tmp_path):
    """Backward PP1 + one forward worker on the same device, and the plain engine at PP1."""
    out = tmp_path / "r.json"
    argv = ["--device", "cpu", "--pp", "1", "--dp", "1", "--variants", "plain", "fbd", "--rounds", "1",
            "--steps", "1", "--warmup", "0", "--timeout", "240", "--out", str(out)]
    assert fbd_bench.main(argv) == 0
    report = json.loads(out.read_text())
    for variant in ("plain", "fbd"):
        entry = report["throughput"][variant]
        assert entry["errors"] == [] and entry["tokens_per_s"]["median"] > 0, entry
