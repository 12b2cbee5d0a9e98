"""MegaFBD on one GPU (run on the device machine): the backward worker on the GPU, its forward
worker on the same GPU (a separate process) or on the CPU, hand-offs and weights through host
memory (gloo), since NCCL cannot link two processes on one GPU. Losses equal the plain engine's
on that GPU (fp32: at PP1 the backward worker computes exactly what the plain engine does)."""

from __future__ import annotations

import json

import pytest
from test_cli import run_cli

pytestmark = pytest.mark.gpu
COMMON = ["--device", "cuda", "--model", "tiny", "--train-iters", "3", "--global-batch-size", "4", "--lr", "1e-2"]


def _losses(tmp_path, name: str, extra: list[str]) -> list[float]:
    metrics = tmp_path / f"{name}.jsonl"
    res = run_cli(COMMON + extra + ["--metrics-file", str(metrics)], timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


@pytest.mark.parametrize("forward", [[], ["--forward-device", "cpu"]], ids=["forward_same_gpu", "forward_cpu"])
def test_one_gpu_fbd_trains_what_the_plain_engine_trains(tmp_path, forward):
    plain = _losses(tmp_path, "plain", ["--nproc-per-node", "1"])
    fbd = _losses(tmp_path, "fbd", ["--nproc-per-node", "2", "--forward-backward-disaggregating", *forward])
    assert len(plain) == 3 and plain[-1] != plain[0]
    assert fbd == pytest.approx(plain, rel=1e-6, abs=1e-6)
