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

from dist_harness import ProcessCluster
from megatronapp.config import build_layout
from megatronapp.inference.model import build_inference_model, read_model_config
from megatronapp.parallel.groups import build_process_groups
from megatronapp.scope_ui import protocol as P
from scope_ui_jobs import save_ui_checkpoint

FLIP = {"kind": "bitflip", "bits": [30], "seed": 5, "target": {"site": "residual", "layers": [1], "positions": [2]}}
REQUEST = {"type": "generate", "prompt": "Hello there", "max_new_tokens": 6}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    path = str(tmp_path_factory.mktemp("ui_ranks_ckpt"))
    save_ui_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def cluster():
    c = ProcessCluster(max_world=2, timeout=240)
    yield c
    c.close()


def _runner(rank: int, world: int, tp: int, pp: int, ckpt: str):
    from megatronapp.scope_ui.cli import build_generation_backend

    groups = build_process_groups(build_layout(world, tp, pp), rank)
    model = build_inference_model(read_model_config(ckpt), groups, "cpu", load_dir=ckpt)
    return build_generation_backend(ckpt, None, "cpu", False, P.Limits(), model=model)


def _collect(runner, leader=None) -> dict:
    """Run REQUEST with FLIP set; what the page would get: tokens, top-k, residual frames."""
    out = {"tokens": {}, "topk": [], "residual_bytes": 0, "compare": None}

    def emit(msg):
        if isinstance(msg, P.RunEnd):
            out["tokens"][msg.run] = msg.tokens
        elif isinstance(msg, P.Token) and msg.run == "clean":
            out["topk"].append([e.id for e in msg.topk])
        elif isinstance(msg, P.Compare):
            out["compare"] = msg.first_divergence

    def emit_tensor(header, data):
        if header.site == "residual" and header.run == "clean":
            out["residual_bytes"] += len(data)

    runner.perturbations.add(dict(FLIP))
    (leader or runner).run(P.Generate.model_validate(REQUEST), emit, emit_tensor)
    return out


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
    assert want["tokens"]["clean"] and want["residual_bytes"] > 0
    lead, follower = cluster.run(serve_ranks_job, 2, tp, pp, ckpt)
    assert follower == {"followed": 1}
    assert lead["tokens"] == want["tokens"]  # clean and perturbed runs
    assert lead["topk"] == want["topk"]
    assert lead["residual_bytes"] == want["residual_bytes"]  # captures gathered to rank 0
    assert lead["compare"] == want["compare"]


def test_serve_cli_on_two_ranks_over_websocket(ckpt):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "megatronapp.cli.main", "scope", "serve", "--load", ckpt,
                             "--nproc-per-node", "2", "--tensor-model-parallel-size", "2", "--device", "cpu",
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
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
    runner = _runner(0, 1, 1, 1, ckpt)
    tokens = {}
    runner.run(P.Generate.model_validate(REQUEST),
               lambda m: tokens.setdefault("t", m.tokens) if isinstance(m, P.RunEnd) else None, lambda *a: None)
    return tokens["t"]


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
