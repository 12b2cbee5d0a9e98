"""`scope serve` on several ranks: rank 0 serves and leads, the others follow; the page sees the
same tokens, captures and perturbation effects as with one process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from websockets.sync.client import connect

from megatronapp.config import build_layout
from megatronapp.inference.model import build_inference_model, read_model_config
from megatronapp.parallel.groups import build_process_groups
from megatronapp.scope_ui import protocol as P
from megatronapp.scope_ui.outbox import TokenOut, ViewOut

FLIP = {"kind": "bitflip", "bits": [30], "seed": 5, "target": {"site": "residual", "layers": [1], "positions": [2]}}
REQUEST = {"type": "generate", "prompt": "Hello there", "max_new_tokens": 6}


@pytest.fixture(scope="module")
def ckpt(ui_checkpoint):
    return ui_checkpoint


def _runner(rank: int, world: int, tp: int, pp: int, ckpt: str):
    from megatronapp.scope_ui.cli import build_generation_backend

    groups = build_process_groups(build_layout(world, tp, pp), rank)
    model = build_inference_model(read_model_config(ckpt), groups, "cpu", load_dir=ckpt)
    return build_generation_backend(ckpt, None, "cpu", False, P.Limits(), model=model)


class _Sink:
    """What the page would get: tokens, top-k, residual rows per layer, the comparison."""

    def __init__(self):
        self.out = {"tokens": {}, "topk": [], "residual": {}, "compare": None}

    def post(self, items) -> None:
        for it in items:
            if isinstance(it, P.RunEnd):
                self.out["tokens"][it.run] = it.tokens
            elif isinstance(it, TokenOut) and it.run == "clean":
                self.out["topk"].append([i for i, _ in it.topk])
            elif isinstance(it, ViewOut) and it.site == "residual" and it.run == "clean":
                self.out["residual"].setdefault(it.layer, []).append(it.data.tolist())
            elif isinstance(it, P.Compare):
                self.out["compare"] = it.first_divergence


def _collect(runner, leader=None) -> dict:
    """Run REQUEST with FLIP set showing layer 0, then refill layer 1 (the followers join both)."""
    sink = _Sink()
    runner.perturbations.add(dict(FLIP))
    (leader or runner).run(P.Generate.model_validate(REQUEST), sink, [0])
    (leader or runner).refill(1, sink)
    return sink.out


def serve_ranks_job(rank: int, world: int, tp: int, pp: int, ckpt: str):
    from megatronapp.scope_ui.ranks import JobChannel, LeaderRunner, follow

    runner = _runner(rank, world, tp, pp, ckpt)
    channel = JobChannel(torch.device("cpu"))
    if rank != 0:
        return {"followed": follow(runner, channel)}
    leader = LeaderRunner(runner, channel)
    try:
        return _collect(runner, leader)
    finally:
        leader.stop()


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_two_rank_serving_equals_one_process(cluster, ckpt, tp, pp):
    want = _collect(_runner(0, 1, 1, 1, ckpt))
    assert want["tokens"]["clean"] and sorted(want["residual"]) == [0, 1]
    lead, follower = cluster.run(serve_ranks_job, 2, tp, pp, ckpt)
    assert follower == {"followed": 2}  # the generation and the refill
    assert lead["tokens"] == want["tokens"]  # clean and perturbed runs
    assert lead["topk"] == want["topk"]
    for layer in (0, 1):  # captures gathered to rank 0 (fp16 bucket means: equal up to fp16 rounding)
        assert len(lead["residual"][layer]) == len(want["residual"][layer])
        for a, b in zip(lead["residual"][layer], want["residual"][layer]):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=2e-2, rtol=2e-2)
    assert lead["compare"] == want["compare"]


def test_serve_cli_on_two_ranks_over_websocket(ckpt):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "megatronapp.cli.main",
            "scope",
            "serve",
            "--load",
            ckpt,
            "--nproc-per-node",
            "2",
            "--tensor-model-parallel-size",
            "2",
            "--device",
            "cpu",
            "--port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        url = _wait_for_url(proc, timeout=180)
        with connect(url.replace("http://", "ws://").rstrip("/") + "/ws", max_size=None) as ws:
            assert json.loads(ws.recv(timeout=60))["type"] == "welcome"
            ws.send(json.dumps(REQUEST))
            while True:
                frame = ws.recv(timeout=120)
                msg = json.loads(frame) if isinstance(frame, str) else {}
                assert msg.get("type") != "error", msg
                if msg.get("type") == "run_end":
                    break
        single = _collect_clean(ckpt)
        assert msg["tokens"] == single
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise


def _collect_clean(ckpt: str) -> list[int]:
    runner, sink = _runner(0, 1, 1, 1, ckpt), _Sink()
    runner.run(P.Generate.model_validate(REQUEST), sink, [0])
    return sink.out["tokens"]["clean"]


def _wait_for_url(proc, timeout: float) -> str:
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        m = re.search(r"(http://\S+)", line)
        if "MegaScope UI" in line and m:
            return m.group(1)
    raise AssertionError("server did not start:\n" + "".join(seen[-20:]))
