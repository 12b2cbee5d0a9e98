"""MegaScope capture inside the decode step (the CUDA-graph path), run eagerly on CPU: the
recorded, packed captures equal the hook path's, step by step, for a left-padded batch."""

from __future__ import annotations

import pytest
import torch
from inference_jobs import PROMPTS, load_model, save_tiny_checkpoint
from torch.fx.experimental.proxy_tensor import make_fx

import megatronapp.inference.model as inference_model
from megatronapp import scope
from megatronapp.inference.generate import SamplingConfig, generate
from megatronapp.scope.compress import DEFAULT_COMPRESS
from megatronapp.scope.sites import DEFAULT_SITES
from megatronapp.scope.specs import Perturbation, Target
from megatronapp.scope.staging import HostStaging
from megatronapp.scope.store import dequantized

EOD, VOCAB = 256, 257
STEPS = 5
SAMPLING = SamplingConfig(max_new_tokens=STEPS, stop_on_eod=False)
CONFIGS = {
    "default": dict(sites=DEFAULT_SITES, compress=DEFAULT_COMPRESS),
    "heads_attn_int8": dict(
        sites=("q", "k", "v", "attn_probs", "attn_out", "fc1"),
        heads=(0, 2),
        compress="slice:heads=1;quantize:dtype=int8",
    ),
    "l2_topk": dict(
        sites=("residual", "fc1", "topk"), topk=3, compress="reduce:op=l2,width=5;topk:k=3;quantize:dtype=fp16"
    ),
    "layers_mean": dict(
        sites=("mlp_out", "q", "logit_lens"), layers=(1, 3), compress="slice:tokens=-1:,layers=1;reduce:op=mean,width=8"
    ),
    "ui_lens_top1": dict(
        sites=("attn_probs", "topk", "logit_lens"), layers=(1,), topk=5, lens_topk=1, compress="quantize:dtype=fp16"
    ),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("ckpt")
    save_tiny_checkpoint(str(path))
    return load_model(0, 1, 1, 1, str(path))


def run(model, config: dict, static: bool, record: bool = True, prompts=PROMPTS):
    """(generation, capture) with a static cache (as under CUDA graphs, but not replayed) or the
    dynamic one; record=False keeps a capturable configuration on the hook path."""
    start = model.start
    if static:
        model.start = lambda b, n, pad: start(b, n, pad, static=True)
    try:
        with scope.capture(model, **config) as cap:
            if not record:
                cap.decode_key = None
            res = generate(model, prompts, SAMPLING, eod_id=EOD, vocab_size=VOCAB)
    finally:
        model.start = start
    return res, cap


def assert_same_items(got, want, rtol: float, atol: float) -> None:
    assert [it.name for it in got.items] == [it.name for it in want.items]
    for a, b in zip(got.items, want.items):
        assert (a.site, a.step, a.layer, a.dims, a.ops) == (b.site, b.step, b.layer, b.dims, b.ops), a.name
        assert {k: (t.shape, t.dtype) for k, t in a.tensors.items()} == {
            k: (t.shape, t.dtype) for k, t in b.tensors.items()
        }, a.name
        if "indices" in a.tensors and a.site in ("topk", "logit_lens"):
            assert torch.equal(a.tensors["indices"], b.tensors["indices"]), a.name
        quantum = float(b.tensors["scale"].max()) if "scale" in b.tensors else 0.0  # int8: one step apart at most
        # fp16 storage rounds to 11 significant bits: inputs 1e-6 apart can land one fp16 step apart
        fp16_step = 2.0**-10 if any(op.get("dtype") == "fp16" for op in a.ops) else 0.0
        torch.testing.assert_close(
            dequantized(a), dequantized(b), rtol=rtol + fp16_step, atol=atol + quantum, msg=a.name
        )
    assert [s["bytes"] for s in got.steps] == [s["bytes"] for s in want.steps]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_recorded_decode_capture_equals_hook_capture(model, name):
    config = CONFIGS[name]
    recorded_res, recorded = run(model, config, static=True)
    hooked_res, hooked = run(model, config, static=True, record=False)
    dynamic_res, dynamic = run(model, config, static=False)
    assert recorded.recorded_steps == list(range(1, STEPS))  # every decode step; prefill on hooks
    assert hooked.recorded_steps == [] and dynamic.recorded_steps == []
    assert recorded_res.tokens == hooked_res.tokens == dynamic_res.tokens
    assert_same_items(recorded, hooked, rtol=1e-6, atol=1e-6)  # same cache: only the route differs
    assert_same_items(recorded, dynamic, rtol=1e-4, atol=1e-5)  # and the usual dynamic cache
    assert recorded.bytes_per_token == dynamic.bytes_per_token


def test_recorded_attention_maps_cover_the_keys_so_far(model):
    _, cap = run(model, dict(sites=("attn_probs",), layers=(2,)), static=True)
    width = max(map(len, PROMPTS))
    for it in cap.get("attn_probs"):
        p = it.tensors["data"]  # (B, heads, S, T): T = columns so far, not the static cache's length
        assert p.shape[-1] == width + it.step and it.ops == []
        torch.testing.assert_close(p.sum(-1), torch.ones(p.shape[:-1]))
        for b, prompt in enumerate(PROMPTS):  # decoded tokens never attend to left padding
            assert it.step not in cap.recorded_steps or float(p[b, ..., : width - len(prompt)].abs().sum()) == 0.0
    assert cap.recorded_steps == list(range(1, STEPS))


@pytest.mark.parametrize("k,lens_topk", [(6, None), (5, 1)])
def test_batched_logit_lens_equals_per_layer(model, k, lens_topk):
    """The recorded lens (one matmul for every layer, top-k of log-probabilities without ranking
    them in fp32; a max for the UI's top 1) equals each layer's residual through the final norm
    and output layer, log_softmax, topk."""
    _, cap = run(model, dict(sites=("residual", "logit_lens"), topk=k, lens_topk=lens_topk), static=True)
    assert cap.recorded_steps
    for step in cap.recorded_steps:
        lens = cap.get("logit_lens", step=step)[0].tensors
        assert lens["data"].shape == (model.cfg.num_layers, len(PROMPTS), lens_topk or k)
        for layer in range(model.cfg.num_layers):
            residual = cap.get("residual", layer, step)[0].tensors["data"][:, -1]  # (B, H)
            per_layer = model.compute_logits(residual)[..., :VOCAB].float().log_softmax(-1).topk(lens_topk or k)
            assert torch.equal(lens["indices"][layer], per_layer.indices.to(torch.int32))
            torch.testing.assert_close(lens["data"][layer], per_layer.values, rtol=1e-5, atol=1e-5)


def test_reconfiguration_and_cache_reuse(model):
    """Config A, B, off, A again on one static cache (reset in place between generations):
    each equals its hook-path reference; the record key follows the configuration."""
    keys, caches = [], []
    other = [PROMPTS[1], PROMPTS[0], PROMPTS[2]]
    plain = generate(model, other, SAMPLING, eod_id=EOD, vocab_size=VOCAB)  # dynamic cache, no capture
    for name in ("default", "l2_topk", None, "default"):
        if name is None:  # capture off, other prompts, on the same static cache
            start = model.start
            model.start = lambda b, n, pad: start(b, n, pad, static=True)
            try:
                off = generate(model, other, SAMPLING, eod_id=EOD, vocab_size=VOCAB)
            finally:
                model.start = start
            assert off.tokens == plain.tokens and not model.step_records
            caches.append(model.cache)
            continue
        res, cap = run(model, CONFIGS[name], static=True)
        _, ref = run(model, CONFIGS[name], static=True, record=False)
        assert cap.recorded_steps and res.tokens
        assert_same_items(cap, ref, rtol=1e-6, atol=1e-6)
        keys.append(cap.decode_key)
        caches.append(model.cache)
    assert keys[0] == keys[2] != keys[1]
    assert all(c is caches[0] for c in caches)  # same shape: one static cache, reset in place


def test_unsupported_configuration_stays_on_hooks_and_says_why(model):
    config = dict(sites=("attn_probs", "residual"), compress="reduce:op=max,width=4")
    res, cap = run(model, config, static=True)
    _, dynamic = run(model, config, static=False)
    assert cap.recorded_steps == [] and "attn_probs with reduce" in cap.graph_unsupported
    assert "\n" not in cap.graph_unsupported
    assert_same_items(cap, dynamic, rtol=1e-4, atol=1e-5)
    with scope.capture(model, **config):
        assert "attn_probs with reduce" in model.replay_blocker()
    with scope.capture(model, **CONFIGS["default"]):
        assert model.replay_blocker() is None
        with scope.perturb(model, Perturbation("offset", Target("residual", layers=(0,)), value=1.0)):
            assert "perturbation" in model.replay_blocker()
    assert model.replay_blocker() is None and not model.observers


def test_graphs_requested_without_cuda_log_one_line(model, caplog):
    model.cuda_graphs = True
    try:
        with caplog.at_level("WARNING", logger="megatronapp.inference"):
            generate(model, PROMPTS, SAMPLING, eod_id=EOD, vocab_size=VOCAB)
            generate(model, PROMPTS, SAMPLING, eod_id=EOD, vocab_size=VOCAB)
    finally:
        model.cuda_graphs = False
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "CUDA device" in lines[0] and "\n" not in lines[0]
    assert not model.cache.static  # eager, dynamic cache


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sites": ("resid",)}, "unknown capture site"),
        ({"sites": ("attn_probs",), "layers": (9,)}, "layer 9 is out of range"),
        ({"sites": ("residual",), "compress": "reduce:op=median,width=4"}, "reduce op must be"),
        (
            {"sites": ("residual",), "compress": "quantize:dtype=fp16;reduce:op=max,width=4"},
            "quantize must be the last",
        ),
    ],
)
def test_bad_configurations_rejected_in_one_line_before_anything_is_installed(model, kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        scope.capture(model, **kwargs)
    assert "\n" not in str(err.value)
    assert not model.observers and model.replay_blocker() is None
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.chunk.modules()) == 0


class EmulatedDecodeGraph:
    """CPU stand-in for inference.graphs.DecodeGraph that replays like a CUDA graph: the step
    is run once (warm-up), then traced into an FX graph of ATen ops (make_fx; the model's
    weights, the KV cache and the hooks' kernels are baked in, tensors it closes over are the
    real ones), and every `run` replays that trace: the recorded kernels run again, the Python
    does not (no hook, no cache.prepare, no record_decode). The results are copied into the
    tensors of the recorded output, which `run` returns each time, as DecodeGraph does."""

    def __init__(self, step_fn, batch: int, device):
        self.tokens = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.out = step_fn(self.tokens)
        self.trace = make_fx(lambda t: _tensors(step_fn(t)))(self.tokens)
        self.replays = 0

    def run(self, tokens: torch.Tensor):
        self.tokens.copy_(tokens)
        for recorded, fresh in zip(_tensors(self.out), self.trace(self.tokens), strict=True):
            recorded.copy_(fresh)
        self.replays += 1
        return self.out


def _tensors(tree) -> list[torch.Tensor]:
    """The tensors of nested tuples / lists / dicts (other objects, e.g. items, skipped)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    values = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (tuple, list)) else ()
    return [t for v in values for t in _tensors(v)]


@pytest.mark.parametrize("name", ["default", "heads_attn_int8"])
def test_replayed_capture_equals_hook_capture_and_counts_each_steps_tokens(model, monkeypatch, name):
    """Two generations on emulated graph replays (the second replays the first's graph): steps,
    bytes per token and items equal the dynamic hook path's. A step's token count once came
    from cache.positions, which a replay leaves at the prefill's (B, prompt) tensor: the H200
    run reported 459 instead of ~9,900 bytes per token."""
    _, reference = run(model, CONFIGS[name], static=False)
    assert not reference.recorded_steps
    monkeypatch.setattr(inference_model, "DecodeGraph", EmulatedDecodeGraph)
    monkeypatch.setattr(model, "_graph_device", lambda: True)
    monkeypatch.setattr(HostStaging, "copy", lambda self, buffer: (buffer.clone(), None))  # the D2H copy
    monkeypatch.setattr(model, "cuda_graphs", True)
    for generation in range(2):
        with scope.capture(model, **CONFIGS[name]) as cap:
            generate(model, PROMPTS, SAMPLING, eod_id=EOD, vocab_size=VOCAB)
        assert cap.recorded_steps == list(range(1, STEPS))
        assert model._graph.replays == (generation + 1) * (STEPS - 1)
        tokens = [s["tokens"] for s in cap.steps]
        assert tokens == [len(PROMPTS) * max(map(len, PROMPTS))] + [len(PROMPTS)] * (STEPS - 1), generation
        assert cap.steps == reference.steps and cap.bytes_per_token == reference.bytes_per_token
        assert_same_items(cap, reference, rtol=1e-4, atol=1e-5)


class _CopyInFlight:
    """A host copy's event that lands when the test says so (or when waited on)."""

    def __init__(self):
        self.landed, self.waited = False, False

    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:
        self.landed = self.waited = True


def test_landed_items_never_wait_and_keep_step_order(model, monkeypatch):
    """landed_items builds the steps whose copies have landed, up to the first still in flight,
    without waiting on any; `items` then waits for the rest. Items equal a plain capture's."""
    _, reference = run(model, CONFIGS["default"], static=False)
    events = []

    def copy(self, buffer):
        events.append(_CopyInFlight())
        return buffer.clone(), events[-1]

    monkeypatch.setattr(HostStaging, "copy", copy)
    with scope.capture(model, **CONFIGS["default"]) as cap:
        generate(model, PROMPTS, SAMPLING, eod_id=EOD, vocab_size=VOCAB)
        assert len(events) == STEPS and cap.landed_items() == []
        events[0].landed = events[1].landed = events[3].landed = True
        assert sorted({it.step for it in cap.landed_items()}) == [0, 1]  # step 3 waits for step 2
        assert not any(e.waited for e in events)
        assert sorted({it.step for it in cap.items}) == list(range(STEPS))
        assert events[2].waited and events[4].waited
    assert_same_items(cap, reference, rtol=0, atol=0)
