"""The UI's outbound path: coalescing a slow tab's backlog (pure), the per-tab sender with a
real generation behind a socket that stalls (tokens never lost, views merged into the same
rows a fast tab gets), and frames' wire form."""

from __future__ import annotations

import asyncio
import json
import threading

import numpy as np
import pytest
import torch
from scope_ui_jobs import save_ui_checkpoint

from megatronapp.scope_ui import protocol as P
from megatronapp.scope_ui.outbox import TokenOut, ViewOut, coalesce, encode, merge_views
from megatronapp.scope_ui.server import Hub, _send_loop


def _tok(step: int, run: str = "clean") -> TokenOut:
    return TokenOut(run=run, step=step, id=100 + step, topk=((1, 0.5),), lens=((2, 0.25),), t_server_ms=1.0)


def _attn(step: int, layer: int = 0, prompt: int = 3, run: str = "clean") -> ViewOut:
    """Step rows of a (1, 2 heads, S, T) map whose entries say (step, row, key)."""
    s = prompt if step == 0 else 1
    start = 0 if step == 0 else prompt + step - 1
    t = start + s
    data = np.array(
        [[[[1000 * step + 10 * (start + i) + j for j in range(t)] for i in range(s)]] * 2], dtype=np.float32
    )
    return ViewOut(
        run=run,
        step=step,
        site="attn_probs",
        layer=layer,
        start=start,
        dims=("batch", "head", "token", "key"),
        data=data,
    )


def test_coalesce_keeps_every_token_in_order_and_merges_view_rows():
    items = [P.RunStart(run="clean", prompt_tokens=[1, 2, 3], prompt_text=["a", "b", "c"])]
    for step in range(6):
        items += [_attn(step), _attn(step, layer=1), _tok(step)]
    items.append(P.RunEnd(run="clean", tokens=[100 + s for s in range(6)], text="", tokens_per_s=1.0))
    out = coalesce(items, layer=0)
    assert isinstance(out[0], P.RunStart) and isinstance(out[-1], P.RunEnd)
    (view,) = [o for o in out if isinstance(o, ViewOut)]  # layer 1 is not shown: dropped
    (tokens,) = [o for o in out if isinstance(o, list)]
    assert [t.step for t in tokens] == list(range(6))
    assert out.index(view) < out.index(tokens)  # rows before the tokens that redraw them
    assert view.start == 0 and view.data.shape == (1, 2, 3 + 5, 3 + 5)
    for row in range(8):  # every row is the one its own step sent, keys past it zero-padded
        step = 0 if row < 3 else row - 2
        want = _attn(step).data[0, 0, row - _attn(step).start]
        assert np.array_equal(view.data[0, 1, row, : len(want)], want)
        assert not view.data[0, 1, row, len(want) :].any()


def test_coalesce_never_moves_anything_across_a_barrier():
    items = [
        _tok(0),
        _attn(0),
        P.RunEnd(run="clean", tokens=[], text="", tokens_per_s=1.0),
        _tok(0, "perturbed"),
        _attn(0, run="perturbed"),
    ]
    out = coalesce(items)
    kinds = [type(o).__name__ for o in out]
    assert kinds == ["ViewOut", "list", "RunEnd", "ViewOut", "list"]
    assert out[0].run == "clean" and out[3].run == "perturbed"


def test_merge_refill_probe_and_gap():
    late = _attn(4)
    refill = _attn(0)
    assert merge_views(late, refill) is refill  # a refill restarts the rows
    assert merge_views(_attn(1), _attn(3)) is None  # step 2 missing: never bridged
    out = coalesce([_attn(1), _attn(3)])
    assert [v.start for v in out] == [3, 5]  # both kept, in order
    probes = [
        ViewOut(
            run="probe",
            step=i,
            site="residual",
            layer=0,
            start=0,
            dims=("batch", "token", "hidden"),
            data=np.full((1, 4, 8), i, dtype=np.float16),
        )
        for i in range(3)
    ]
    (last,) = coalesce(probes, layer=3)  # probe frames replace each other, whatever the shown layer
    assert last.step == 2


def test_encode_frames():
    frame = encode(_attn(2), str)
    header, payload = P.decode_tensor_frame(frame)
    assert header["start"] == 4 and header["shape"] == [1, 2, 1, 5] and header["dtype"] == "float32"
    assert np.array_equal(np.frombuffer(payload, dtype=np.float32).reshape(header["shape"]), _attn(2).data)
    msg = json.loads(encode([_tok(0), _tok(1)], lambda i: f"<{i}>"))
    assert msg["type"] == "tokens" and [t["text"] for t in msg["tokens"]] == ["<100>", "<101>"]
    assert msg["tokens"][0]["topk"][0] == {"id": 1, "text": "<1>", "p": 0.5}


class _RecordingSocket:
    """A tab's socket that records what it was sent."""

    def __init__(self):
        self.frames = []

    async def send_text(self, text: str) -> None:
        self.frames.append(json.loads(text))

    async def send_bytes(self, data: bytes) -> None:
        header, payload = P.decode_tensor_frame(data)
        self.frames.append((header, np.frombuffer(payload, dtype=header["dtype"]).reshape(header["shape"])))


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    from megatronapp.scope_ui.cli import build_generation_backend

    torch.set_num_threads(1)
    ckpt = str(tmp_path_factory.mktemp("ui_ckpt"))
    save_ui_checkpoint(ckpt)
    return build_generation_backend(ckpt, None, "cpu", False, P.Limits())


def _rows(frames, site: str, layer: int) -> np.ndarray:
    """A tab's rows of (site, layer) after applying its frames as the page does (cut at start, append)."""
    rows = []
    for f in frames:
        if isinstance(f, tuple) and f[0]["site"] == site and f[0]["layer"] == layer and f[0]["run"] == "clean":
            header, data = f
            axis = 2 if site == "attn_probs" else 1
            rows = rows[: header["start"]] + [np.take(data, i, axis=axis) for i in range(data.shape[axis])]
    width = max(r.shape[-1] for r in rows)
    return np.stack([np.pad(r, [(0, 0)] * (r.ndim - 1) + [(0, width - r.shape[-1])]) for r in rows])


def _serve_one_generation(runner, stalled: bool, n: int):
    """Two tabs (layers 1 and 2) on a Hub, one generation; with `stalled`, the layer-1 tab's socket
    takes nothing until the generation is over (its sender starts only then, so the whole run is
    its backlog whatever the timing). Returns each tab's frames."""

    async def scenario():
        hub = Hub(runner, P.Limits())
        hub.loop = asyncio.get_running_loop()
        tabs = [hub.join(_RecordingSocket()), hub.join(_RecordingSocket())]
        tabs[0].layer, tabs[1].layer = 1, 2
        senders = [asyncio.create_task(_send_loop(t, hub.decode)) for t in (tabs[1:] if stalled else tabs)]
        msg = P.Generate(type="generate", prompt="Once upon", max_new_tokens=n, stop_on_eod=False)
        posted = asyncio.Event()

        def model_thread():
            runner.run(msg, hub, hub.layers_shown())
            hub.loop.call_soon_threadsafe(posted.set)  # queued after every post of the run (FIFO)

        threading.Thread(target=model_thread, daemon=True).start()
        await posted.wait()  # every record of the run is in the tabs' backlogs
        if stalled:
            senders.append(asyncio.create_task(_send_loop(tabs[0], hub.decode)))
        while not any(isinstance(f, dict) and f["type"] == "run_end" for f in tabs[0].ws.frames):
            await asyncio.sleep(0.01)
        for s in senders:
            s.cancel()
        return [t.ws.frames for t in tabs]

    return asyncio.run(scenario())


def test_stalled_tab_gets_every_token_and_the_same_rows_in_few_frames(runner, monkeypatch):
    monkeypatch.setattr("megatronapp.scope_ui.runner.FLUSH_S", 0.0)  # one post per token: the tab coalesces
    n = 12
    slow, other = _serve_one_generation(runner, stalled=True, n=n)
    fast, _ = _serve_one_generation(runner, stalled=False, n=n)
    for frames in (slow, fast):
        tokens = [t for f in frames if isinstance(f, dict) and f["type"] == "tokens" for t in f["tokens"]]
        (end,) = [f for f in frames if isinstance(f, dict) and f["type"] == "run_end"]
        assert [t["step"] for t in tokens] == list(range(n)) and [t["id"] for t in tokens] == end["tokens"]
        assert all(f[0]["layer"] == 1 for f in frames if isinstance(f, tuple))  # the tab's layer only
    assert len(slow) <= 6 < n <= len(fast)  # run_start, (rows merged, tokens batched), run_end
    for site in ("attn_probs", "residual"):
        assert np.array_equal(_rows(slow, site, 1), _rows(fast, site, 1))
        assert len(_rows(slow, site, 1)) == len(runner.tokenizer.encode("Once upon")) + n - 1
    assert (
        _rows(other, "attn_probs", 2).shape[2] == runner.model.cfg.num_attention_heads
    )  # (rows, B, heads, T): its own layer


def test_model_thread_posts_at_most_once_per_flush_interval(runner, monkeypatch):
    monkeypatch.setattr("megatronapp.scope_ui.runner.FLUSH_S", 3600.0)
    posts = []

    class Sink:
        def post(self, items):
            posts.append(list(items))

    n = 9
    runner.run(P.Generate(type="generate", prompt="Once upon", max_new_tokens=n, stop_on_eod=False), Sink(), [3])
    assert [type(p[0]).__name__ for p in posts] == ["RunStart", "ViewOut", "RunEnd"]  # one post for the run's body
    body = posts[1]
    assert [t.step for t in body if isinstance(t, TokenOut)] == list(range(n))
    assert [t.id for t in body if isinstance(t, TokenOut)] == posts[2][0].tokens
    assert all(len(t.topk) == 5 and len(t.lens) == runner.model.cfg.num_layers for t in body if isinstance(t, TokenOut))
    assert sorted({(v.site, v.step) for v in body if isinstance(v, ViewOut)}) == sorted(
        (site, s) for site in ("attn_probs", "residual") for s in range(n)
    )  # a forward step per token


def test_ui_captures_are_recordable_into_the_decode_graph(runner):
    from megatronapp.scope_ui.runner import stream_captures

    for cap in stream_captures(runner.model, [0, 2], True, 1 << 30):
        assert cap.graph_unsupported is None, cap.graph_unsupported


@pytest.mark.gpu
def test_ui_generation_on_cuda_keeps_graphs_and_tokens(caplog):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from megatronapp.config import model_preset
    from megatronapp.data.tokenizer import load_tokenizer
    from megatronapp.inference.generate import SamplingConfig, generate
    from megatronapp.inference.model import build_inference_model
    from megatronapp.parallel.groups import single_process_groups
    from megatronapp.scope_ui.runner import GenerationRunner

    model = build_inference_model(model_preset("tiny", seq_length=64), single_process_groups(), torch.device("cuda"))
    model.cuda_graphs = True
    tok = load_tokenizer(None)
    runner, got = GenerationRunner(model, tok, P.Limits()), []

    class Sink:
        def post(self, items):
            got.extend(items)

    msg = P.Generate(type="generate", prompt="Once upon a time", max_new_tokens=12, stop_on_eod=False)
    with caplog.at_level("WARNING"):
        runner.run(msg, Sink(), [1])
    assert not [r for r in caplog.records if "eagerly" in r.getMessage()]
    plain = generate(
        model,
        [tok.encode(msg.prompt)],
        SamplingConfig(max_new_tokens=12, stop_on_eod=False),
        eod_id=tok.eod_id,
        vocab_size=tok.vocab_size,
    ).tokens[0]
    assert [t.id for t in got if isinstance(t, TokenOut)] == plain
    assert {v.layer for v in got if isinstance(v, ViewOut)} == {1}


def test_token_work_runs_after_the_next_step_is_launched(runner, monkeypatch):
    """The model thread notes step s's token (and flushes) only once step s+1 has been launched,
    so that work overlaps the device's step instead of delaying its launch; tokens still
    equal the run's."""
    import megatronapp.scope_ui.runner as runner_mod

    monkeypatch.setattr(runner_mod, "FLUSH_S", 0.0)  # a flush with every token
    log, token = [], runner_mod._RunStream.token

    class Launches:  # an observer: step_begin runs just before a step's forward is launched
        def step_begin(self, model) -> None:
            log.append(("launch", model.step))

        def step_end(self, model, logits) -> None:
            pass

    def noted(self, step, token_id):
        log.append(("token", step))
        token(self, step, token_id)

    monkeypatch.setattr(runner_mod._RunStream, "token", noted)
    posts = []

    class Sink:
        def post(self, items):
            posts.extend(items)

    n = 6
    runner.model.observers.append(Launches())
    try:
        runner.run(P.Generate(type="generate", prompt="Once upon", max_new_tokens=n, stop_on_eod=False), Sink(), [0])
    finally:
        runner.model.observers.pop()
    assert [s for kind, s in log if kind == "token"] == list(range(n))
    for step in range(n - 1):  # the last token has no next step
        assert log.index(("launch", step + 1)) < log.index(("token", step))
        if step + 2 < n:
            assert log.index(("token", step)) < log.index(("launch", step + 2))
    assert [t.id for t in posts if isinstance(t, TokenOut)] == posts[-1].tokens


class _LaggingCapture:
    """A capture whose items land when the test says so."""

    def __init__(self, items):
        self.all, self.landed = items, 0

    def landed_items(self):
        return self.all[: self.landed]

    @property
    def items(self):
        return self.all


def test_a_token_waits_for_its_top_k_and_lens_to_land():
    from megatronapp.scope.compress import CapturedItem
    from megatronapp.scope_ui.runner import _RunStream

    def finals(step):
        top = CapturedItem(
            f"step{step}/topk",
            "topk",
            step,
            None,
            ("batch", "k"),
            {"data": torch.tensor([[0.5, 0.25]]), "indices": torch.tensor([[7 + step, 9]])},
        )
        lens = CapturedItem(
            f"step{step}/logit_lens",
            "logit_lens",
            step,
            None,
            ("layer", "batch", "k"),
            {"data": torch.full((3, 1, 1), -1.0), "indices": torch.full((3, 1, 1), step)},
        )
        return [top, lens]

    cap, posts = _LaggingCapture(finals(0) + finals(1)), []

    class Sink:
        def post(self, items):
            posts.append(items)

    stream = _RunStream([cap], "clean", 3, Sink(), with_tokens=True)
    stream.token(0, 100)
    stream.token(1, 101)
    cap.landed = 2  # step 0's top-k and lens
    stream.flush()
    cap.landed = 3  # step 1's top-k only: its lens is still in flight
    stream.flush()
    stream.flush(final=True)
    tokens = [[t for t in p if isinstance(t, TokenOut)] for p in posts]
    assert [[t.step for t in p] for p in tokens] == [[0], [1]]
    (first,), (second,) = tokens
    assert first.topk == ((7, 0.5), (9, 0.25)) and second.topk == ((8, 0.5), (9, 0.25))
    assert first.lens == ((0, pytest.approx(np.exp(-1.0))),) * 3 and second.lens[0][0] == 1
