"""MegaScope UI server without a browser: same tokens as `megatronapp generate`, limits, security,
and a fuzz of >= 10,000 malformed messages (the server keeps serving, weights unchanged)."""

from __future__ import annotations

import json
import math
import random
import socket

import pytest
import torch
from scope_ui_jobs import TrainingServer, start_generation_server, weights_digest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from megatronapp.cli.main import main
from megatronapp.scope_ui import protocol as P
from megatronapp.scope_ui.server import ServerConfig, resolve_token

DIRECT_REPLIES = {"error", "welcome", "perturbations", "role", "run_start"}
RUN_BROADCASTS = ("run_start", "tokens", "run_end", "compare")


@pytest.fixture(scope="module")
def ckpt(ui_checkpoint):
    return ui_checkpoint


@pytest.fixture(scope="module")
def server(ckpt):
    srv = start_generation_server(ckpt, limits=P.Limits(max_messages_per_s=1e9, burst=10**9))
    yield srv
    srv.stop()


def ws_url(srv, token=None) -> str:
    return f"ws://127.0.0.1:{srv.port}/ws" + (f"?token={token}" if token else "")


def recv_json(ws, timeout=60.0) -> dict:
    while True:
        frame = ws.recv(timeout=timeout)
        if isinstance(frame, str):
            return json.loads(frame)


def generate_over_ws(srv, **settings) -> list[int]:
    with connect(ws_url(srv), max_size=None) as ws:
        assert recv_json(ws)["type"] == "welcome"
        ws.send(json.dumps({"type": "generate", **settings}))
        tokens, streamed = None, []
        while tokens is None:
            msg = recv_json(ws)
            assert msg["type"] != "error", msg
            if msg["type"] == "tokens":
                streamed += [t["id"] for t in msg["tokens"] if t["run"] == "clean"]
            if msg["type"] == "run_end" and msg["run"] == "clean":
                tokens = msg["tokens"]
    assert streamed == tokens  # what streamed is what the run returned
    return tokens


@pytest.mark.parametrize("sampling", [{}, {"greedy": False, "temperature": 0.8, "top_k": 20, "top_p": 0.9, "seed": 3}])
def test_ui_generation_equals_cli_generate(server, ckpt, capsys, sampling):
    prompt, n = "Once upon a", 10
    flags = ["--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "3"] if sampling else []
    assert (
        main(
            [
                "generate",
                "--load",
                ckpt,
                "--prompt",
                prompt,
                "--max-new-tokens",
                str(n),
                "--device",
                "cpu",
                "--json",
                *flags,
            ]
        )
        == 0
    )
    cli_tokens = json.loads(capsys.readouterr().out)["tokens"][0]
    ui_tokens = generate_over_ws(server, prompt=prompt, max_new_tokens=n, **sampling)
    assert ui_tokens == cli_tokens and len(ui_tokens) > 0


def test_bit_flip_diverges_and_second_tab_watches(server):
    with connect(ws_url(server), max_size=None) as driver, connect(ws_url(server), max_size=None) as watcher:
        assert (recv_json(driver)["role"], recv_json(watcher)["role"]) == ("driver", "watcher")
        spec = {"kind": "bitflip", "bits": [30], "target": {"site": "residual", "layers": [0], "positions": [3]}}
        watcher.send(json.dumps({"type": "perturb", "spec": spec}))
        w = recv_json(watcher)
        assert w["type"] == "error" and w["code"] == "not_driver"
        driver.send(json.dumps({"type": "perturb", "spec": spec}))
        active = recv_json(driver)
        assert active["type"] == "perturbations" and active["active"][0]["seed"] >= 0
        driver.send(json.dumps({"type": "generate", "prompt": "Hello there", "max_new_tokens": 6}))
        seen = {}
        while "compare" not in seen:
            msg = recv_json(watcher)  # the watcher sees the whole run too
            seen.setdefault(msg["type"], msg)
        assert seen["compare"]["first_divergence"] == 0
        assert seen["compare"]["layer_diff_norms"][0] > 0
        driver.send(json.dumps({"type": "clear_perturbations"}))
        while (msg := recv_json(driver))["type"] != "perturbations":
            pass
        assert msg["active"] == []


def test_limits_refuse_and_change_nothing(server):
    digest = weights_digest(server.hub.backend.model)
    cases = [
        ({"type": "generate", "prompt": "x" * 5000}, "too_large"),
        ({"type": "generate", "prompt": "hi", "max_new_tokens": 10_000}, "too_large"),
        ({"type": "generate", "prompt": "hi", "max_new_tokens": 200}, "refused"),  # over seq_length
        ({"type": "perturb", "spec": {"kind": "bitflip", "target": {"site": "residual", "layers": [99]}}}, "refused"),
        ({"type": "perturb", "spec": {"kind": "evil", "target": {"site": "residual"}}}, "refused"),
        ({"type": "train_control", "action": "pause"}, "wrong_mode"),
        ({"type": "hello", "version": 1}, "version"),
        ({"type": "view", "layer": 4}, "refused"),  # the model has 4 layers
        ({"type": "__import__('os').system('true')"}, "bad_message"),
    ]
    with connect(ws_url(server), max_size=None) as ws:
        recv_json(ws)
        ws.send(json.dumps({"type": "take_drive"}))
        recv_json(ws)
        for msg, code in cases:
            ws.send(json.dumps(msg))
            reply = recv_json(ws)
            assert reply["type"] == "error" and reply["code"] == code, (msg, reply)
        ws.send(b"\x00\x01binary")
        assert recv_json(ws)["code"] == "binary_not_accepted"
    assert server.hub.backend.perturbations.specs == []
    assert weights_digest(server.hub.backend.model) == digest


def test_rate_limit(ckpt):
    srv = start_generation_server(ckpt, limits=P.Limits(max_messages_per_s=5, burst=5))
    try:
        with connect(ws_url(srv)) as ws:
            recv_json(ws)
            for _ in range(20):
                ws.send(json.dumps({"type": "hello", "version": P.PROTOCOL_VERSION}))
            codes = [recv_json(ws).get("code") for _ in range(20)]
        assert codes.count("rate_limited") >= 10 and codes.count(None) >= 5
    finally:
        srv.stop()


def test_non_loopback_needs_token_and_wrong_token_or_origin_rejected(ckpt, capsys):
    with pytest.raises(ValueError, match="needs an access token"):
        ServerConfig(host="0.0.0.0", port=0, token=None)
    assert len(resolve_token("0.0.0.0", None)) >= 20  # generated when not given
    assert main(["scope", "serve", "--load", ckpt, "--host", "0.0.0.0", "--port", "-1"]) == 2
    assert "port must be" in capsys.readouterr().err
    srv = start_generation_server(ckpt, token="s3cret", host="0.0.0.0")
    try:
        for bad in (ws_url(srv), ws_url(srv, "wrong")):
            with pytest.raises(InvalidStatus):
                connect(bad)
        with pytest.raises(InvalidStatus):
            connect(ws_url(srv, "s3cret"), origin="http://evil.example")
        with connect(ws_url(srv, "s3cret"), origin=f"http://127.0.0.1:{srv.port}") as ws:
            assert recv_json(ws)["type"] == "welcome"
        assert _http_status(srv.port, "/") == 403 and _http_status(srv.port, "/?token=s3cret") == 200
    finally:
        srv.stop()


def _http_status(port: int, path: str, host: str | None = None) -> int:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path, headers={"Host": host or f"127.0.0.1:{port}"})
    return conn.getresponse().status


def test_loopback_server_refuses_foreign_host_header(server):
    assert _http_status(server.port, "/") == 200
    assert _http_status(server.port, "/", host=f"attacker.example:{server.port}") == 403  # DNS rebinding
    with pytest.raises(InvalidStatus):
        connect(ws_url(server), additional_headers={"Host": "attacker.example"})


def test_tensor_frame_round_trip_and_rate_limiter():
    header = P.TensorHeader(
        run="clean",
        step=2,
        site="residual",
        layer=1,
        dims=["batch", "token", "hidden"],
        dtype="float32",
        shape=[1, 2, 3],
        compression=[{"name": "quantize"}],
    )
    data = torch.arange(6, dtype=torch.float32)
    got, payload = P.decode_tensor_frame(P.encode_tensor_frame(header, data.numpy().tobytes()))
    assert got == json.loads(header.model_dump_json())
    assert torch.equal(torch.frombuffer(bytearray(payload), dtype=torch.float32), data)
    bucket = P.RateLimiter(rate=2.0, burst=3, now=0.0)
    assert [bucket.allow(0.0) for _ in range(4)] == [True, True, True, False]
    assert bucket.allow(0.5) and not bucket.allow(0.5)  # refills at 2 per second


def _fuzz_message(rng: random.Random) -> str | bytes:
    kind = rng.randrange(10)
    if kind == 0:
        return rng.randbytes(rng.randrange(1, 300))  # binary garbage
    if kind == 1:
        return "".join(rng.choice('{}[]":,0123abc\\\x00') for _ in range(rng.randrange(1, 80)))  # bad JSON
    if kind == 2:
        return json.dumps({"type": rng.choice(["", "gen", "GENERATE", "eval", "exec", None, 3]), "x": 1})
    if kind == 3:  # wrong types for real fields
        bad = rng.choice([None, [], {}, "1", 1.5, -1, 10**30])  # (a valid one would start a generation)
        field = rng.choice(["prompt", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "greedy"])
        return json.dumps({"type": "generate", "prompt": "hi", field: bad})
    if kind == 4:
        return json.dumps({"type": "generate", "prompt": "a" * rng.randrange(4097, 60_000)})  # over the limit
    if kind == 5:
        spec = {
            "kind": rng.choice(["bitflip", "gaussian", "nope", 1]),
            "target": rng.choice(
                [{"site": "residual", "layers": [rng.randrange(-3, 9)]}, {"site": "param", "param": "x"}, [], "t"]
            ),
        }
        return json.dumps({"type": "perturb", "spec": spec, **({"extra": 1} if rng.random() < 0.3 else {})})
    if kind == 6:
        return json.dumps(rng.choice([[], 1, "s", None, {"no": "type"}]))
    if kind == 7:
        return "[" * rng.randrange(1, 5000)  # deep nesting
    if kind == 8:  # (a valid view gets no reply; these are all refused)
        return json.dumps(
            {"type": "view", "layer": rng.choice([-1, 4, 99, "0", None, 1.5]), "head": rng.choice([0, 9])}
        )
    return json.dumps(
        {
            "type": rng.choice(["hello", "train_control", "take_drive", "clear_perturbations"]),
            "version": rng.choice([1, 2, "1"]),
            "action": rng.choice(["pause", "stop", 1]),
        }
    )


def _abrupt_disconnect(port: int, rng: random.Random) -> None:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    head = (
        f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    ).encode()
    s.sendall(head[: rng.randrange(len(head))] if rng.random() < 0.5 else head + rng.randbytes(rng.randrange(1, 50)))
    s.close()


def test_fuzz_ten_thousand_malformed_messages(server):
    rng = random.Random(1234)
    model = server.hub.backend.model
    digest = weights_digest(model)
    sent = answered = closed = 0
    while sent < 10_000:
        try:
            with connect(ws_url(server), max_size=None, close_timeout=0.5) as ws:
                recv_json(ws)
                ws.send(json.dumps({"type": "take_drive"}))
                recv_json(ws)
                for _ in range(10):
                    for _ in range(100):
                        ws.send(_fuzz_message(rng))
                        sent += 1
                    replies = 0
                    while replies < 100:  # exactly one direct reply per message, in order
                        msg = recv_json(ws, timeout=30)
                        assert msg.get("code") != "internal", msg
                        replies += msg["type"] in DIRECT_REPLIES
                    answered += replies
        except ConnectionClosed:
            closed += 1
        for _ in range(5):
            _abrupt_disconnect(server.port, rng)
    assert sent >= 10_000 and answered == sent - closed
    with connect(ws_url(server), max_size=None) as ws:  # an oversized frame closes that connection only
        recv_json(ws)
        ws.send("x" * (5 * P.Limits().max_message_bytes))
        with pytest.raises(ConnectionClosed):
            while True:  # (a role message may come first: the driving tab may just have left; and a
                # generation a fuzz message started may still be broadcasting to every tab)
                assert recv_json(ws, timeout=10)["type"] in ("role", "welcome", *RUN_BROADCASTS)
    server.hub.backend.perturbations.clear()
    assert len(generate_over_ws(server, prompt="still serving", max_new_tokens=3)) >= 1
    assert weights_digest(model) == digest


def test_train_scope_flag_runs_and_refuses_multi_process(tmp_path, capsys):
    base = [
        "train",
        "--model",
        "tiny",
        "--train-iters",
        "2",
        "--device",
        "cpu",
        "--log-interval",
        "1",
        "--global-batch-size",
        "2",
        "--micro-batch-size",
        "1",
    ]
    assert main(base + ["--scope", "--scope-port", "0", "--scope-every", "1"]) == 0
    assert "MegaScope training view: http://127.0.0.1:" in capsys.readouterr().out
    assert main(base + ["--scope", "--nproc-per-node", "2"]) == 2
    assert "--scope serves one training process" in capsys.readouterr().err


def test_perturbation_during_training_shows_in_loss_and_is_removed():
    torch.set_num_threads(1)
    training = TrainingServer()
    name = "layers.1.mlp.mlp.fc2.weight"
    param = training.backend.named_params[name]
    try:
        with connect(f"ws://127.0.0.1:{training.server.port}/ws", max_size=None) as ws:
            assert recv_json(ws)["mode"] == "train"

            def wait_for(pred) -> dict:
                while not pred(msg := recv_json(ws)):
                    pass
                return msg

            paused = lambda m: m["type"] == "train_state" and m["waiting"]
            start = wait_for(lambda m: m["type"] == "train_step")
            assert math.isfinite(start["loss"]) and len(start["layer_grad_norms"]) == 4
            ws.send(json.dumps({"type": "train_control", "action": "pause"}))
            wait_for(paused)
            clean = param.detach().clone()
            fault = {"kind": "offset", "value": 0.5, "target": {"site": "param", "param": name, "indices": [5, 6, 7]}}
            ws.send(json.dumps({"type": "perturb", "spec": fault}))
            ws.send(json.dumps({"type": "train_control", "action": "step"}))  # installed after this step
            wait_for(paused)
            moved = (param.detach() - clean).flatten()
            assert float(moved[5:8].min()) > 0.4 and float(moved.abs().max()) < 0.6  # a step alone moves ~1e-2
            ws.send(json.dumps({"type": "clear_perturbations"}))
            ws.send(json.dumps({"type": "train_control", "action": "step"}))
            wait_for(paused)
            assert not training.backend._active
            assert float((param.detach() - clean).abs().max()) < 0.05  # original values back
            nan = {"kind": "special", "value": "nan", "target": {"site": "residual", "layers": [1]}}
            ws.send(json.dumps({"type": "perturb", "spec": nan}))
            ws.send(json.dumps({"type": "train_control", "action": "resume"}))
            hit = wait_for(lambda m: m["type"] == "train_step" and m["loss"] is None)  # NaN (JSON null)
            assert hit["iteration"] > start["iteration"]
    finally:
        training.stop()


def _frames_until(ws, done) -> list:
    """Frames (dicts, or (header, array) for tensors) until done(frames) holds."""
    import numpy as np

    frames = []
    while not done(frames):
        f = ws.recv(timeout=60)
        if isinstance(f, str):
            frames.append(json.loads(f))
        else:
            h, payload = P.decode_tensor_frame(f)
            frames.append((h, np.frombuffer(payload, dtype=h["dtype"]).reshape(h["shape"])))
    return frames


def _layer_rows(frames, site: str, layer: int) -> list:
    """The rows the page holds after `frames`; attention row r cut to its r + 1 causal keys (a
    merged frame pads the keys of its shorter rows with zeros)."""
    rows = []
    for f in frames:
        if isinstance(f, tuple) and (f[0]["site"], f[0]["layer"], f[0]["run"]) == (site, layer, "clean"):
            axis = 2 if site == "attn_probs" else 1
            rows = rows[: f[0]["start"]] + [f[1].take(i, axis=axis) for i in range(f[1].shape[axis])]
    return [(r[..., : i + 1] if site == "attn_probs" else r).tolist() for i, r in enumerate(rows)]


def test_layer_switch_after_a_run_refills_that_layer_exactly(server):
    request = {"type": "generate", "prompt": "Hello there", "max_new_tokens": 5, "stop_on_eod": False}
    ended = lambda fs: any(isinstance(f, dict) and f["type"] == "run_end" for f in fs)
    with connect(ws_url(server), max_size=None) as ws:
        recv_json(ws)
        ws.send(json.dumps({"type": "take_drive"}))
        ws.send(json.dumps({"type": "view", "layer": 0, "head": 0}))
        ws.send(json.dumps(request))
        first = _frames_until(ws, ended)
        positions = len(_layer_rows(first, "residual", 0))
        assert positions == len(first[-1]["tokens"]) - 1 + len(
            next(f for f in first if isinstance(f, dict) and f["type"] == "run_start")["prompt_tokens"]
        )
        assert not _layer_rows(first, "residual", 2)  # only the shown layer was captured
        ws.send(json.dumps({"type": "view", "layer": 2, "head": 0}))  # refilled: same request, layer 2 only
        refill = _frames_until(
            ws,
            lambda fs: (
                len(_layer_rows(fs, "residual", 2)) == positions and len(_layer_rows(fs, "attn_probs", 2)) == positions
            ),
        )
        assert all(isinstance(f, tuple) for f in refill)  # views only: no tokens, no run messages
        ws.send(json.dumps(request))  # now streamed live with layer 2 shown from the start
        live = _frames_until(ws, ended)
    for site in ("attn_probs", "residual"):
        assert _layer_rows(refill, site, 2) == _layer_rows(live, site, 2)
