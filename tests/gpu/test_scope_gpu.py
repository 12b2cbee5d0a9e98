"""MegaScope capture replayed inside the CUDA-graph decode step (needs a CUDA device)."""

from __future__ import annotations

import pytest
import torch

from megatronapp import scope
from megatronapp.config import model_preset
from megatronapp.inference.generate import SamplingConfig, generate
from megatronapp.inference.model import build_inference_model
from megatronapp.parallel.groups import single_process_groups
from megatronapp.scope.compress import DEFAULT_COMPRESS, reduce_equal_buckets
from megatronapp.scope.sites import DEFAULT_SITES
from megatronapp.scope.specs import Perturbation, Target
from megatronapp.scope.store import dequantized

pytestmark = pytest.mark.gpu

EOD, VOCAB = 256, 257
PROMPTS = [[5, 6, 7, 8, 9], [1, 2, 3], [10, 11, 12, 13, 14, 15, 16]]
SAMPLING = SamplingConfig(max_new_tokens=12, stop_on_eod=False)
CONFIGS = {
    "default": dict(sites=DEFAULT_SITES, compress=DEFAULT_COMPRESS),
    "rich": dict(
        sites=("q", "attn_probs", "fc1", "residual", "topk", "logit_lens"),
        heads=(0, 3),
        compress="slice:heads=1;quantize:dtype=int8",
        topk=4,
    ),
}


class LogitsTap:
    """Observer without hooks: keeps each step's logits."""

    def __init__(self):
        self.logits = []

    def step_begin(self, model) -> None:
        pass

    def step_end(self, model, logits) -> None:
        self.logits.append(logits.clone())


def build(dtype=torch.float32):
    cfg = model_preset("demo", vocab_size=VOCAB)
    return build_inference_model(cfg, single_process_groups(), "cuda", seed=5, dtype=dtype)


def run(model, config: dict | None, graphs: bool):
    """(tokens, logits per step, capture or None); graphs=False: the reference, i.e. the same
    static cache run eagerly with the capture on its hook path."""
    model.cuda_graphs = graphs
    tap, start = LogitsTap(), model.start
    model.observers.append(tap)
    if not graphs:
        model.start = lambda b, n, pad: start(b, n, pad, static=True)
    try:
        if config is None:
            return generate(model, PROMPTS, SAMPLING, eod_id=EOD, vocab_size=VOCAB).tokens, tap.logits, None
        with scope.capture(model, **config) as cap:
            if not graphs:
                cap.decode_key = None
            tokens = generate(model, PROMPTS, SAMPLING, eod_id=EOD, vocab_size=VOCAB).tokens
        return tokens, tap.logits, cap
    finally:
        model.observers.remove(tap)
        model.start = start


def assert_same_captures(got, want) -> None:
    assert [it.name for it in got.items] == [it.name for it in want.items]
    for a, b in zip(got.items, want.items):
        assert a.dims == b.dims and a.ops == b.ops, a.name
        if a.site in ("topk", "logit_lens"):
            assert torch.equal(a.tensors["indices"], b.tensors["indices"]), a.name
        quantum = float(b.tensors["scale"].max()) if "scale" in b.tensors else 0.0
        torch.testing.assert_close(dequantized(a), dequantized(b), rtol=1e-5, atol=1e-6 + quantum, msg=a.name)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_graph_capture_equals_eager_hook_capture(name):
    model = build()
    eager_tokens, _, eager = run(model, CONFIGS[name], graphs=False)
    assert eager.recorded_steps == []
    for _ in range(2):  # the second generation replays the first one's graph from its first step
        tokens, _, cap = run(model, CONFIGS[name], graphs=True)
        assert model._graph is not None and model.cache.static
        assert cap.recorded_steps == list(range(1, SAMPLING.max_new_tokens))
        assert tokens == eager_tokens
        assert_same_captures(cap, eager)
        assert cap.steps == eager.steps and cap.bytes_per_token == eager.bytes_per_token


def test_graph_capture_leaves_logits_bitwise_identical():
    model = build(torch.bfloat16)
    off_tokens, off_logits, _ = run(model, None, graphs=True)
    on_tokens, on_logits, cap = run(model, CONFIGS["default"], graphs=True)
    assert cap.recorded_steps and on_tokens == off_tokens
    for a, b in zip(on_logits, off_logits):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_reconfiguration_recaptures_and_reuses_graphs(caplog):
    model = build()
    refs = {name: run(model, config, graphs=False)[2] for name, config in CONFIGS.items()}
    graphs = {}
    for name in ("default", "rich", None, "default"):
        tokens, _, cap = run(model, None if name is None else CONFIGS[name], graphs=True)
        key = () if cap is None else (cap.decode_key,)
        assert model._graph is model._graphs[key]
        graphs.setdefault(key, model._graph)
        assert graphs[key] is model._graph  # the same configuration replays its graph again
        if cap is not None:
            assert_same_captures(cap, refs[name])
    assert len(model._graphs) == 3
    spec = Perturbation("offset", Target("residual", layers=(0,)), value=1.0)
    with caplog.at_level("WARNING", logger="megatronapp.inference"), scope.perturb(model, spec):
        _, _, cap = run(model, CONFIGS["default"], graphs=True)
    assert model._graph is None and cap.recorded_steps  # eager (recorded without a graph)
    assert model.cache is model._static_cache and len(model._graphs) == 3  # kept for the next graph run
    assert any("perturbation" in r.getMessage() for r in caplog.records)


def test_perturbed_eager_fallback_runs_the_replayed_kernels():
    """A perturbation hook forces eager decode, on the same static cache: with a perturbation
    that changes nothing, the logits equal the graph replay's bit for bit (so the UI's clean
    vs perturbed comparison shows only the perturbation)."""
    model = build(torch.bfloat16)
    _, replayed, _ = run(model, None, graphs=True)
    with scope.perturb(model, Perturbation("offset", Target("residual", layers=(1,)), value=0.0)):
        _, fallback, _ = run(model, None, graphs=True)
        assert model._graph is None
    assert len(fallback) == len(replayed)
    for a, b in zip(fallback, replayed):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", ["max", "absmax"])
def test_equal_bucket_reduction_is_the_fp32_scatter_on_cuda(dtype, op):
    """Bit for bit with the scatter it replaces, except that a NaN now shows in its bucket as on
    the CPU (CUDA's atomic fmax in scatter_reduce drops it: an injected NaN went unseen)."""
    x = torch.randn(4, 3, 2048, generator=torch.Generator().manual_seed(1)).to(dtype)
    x.view(-1)[[700, 701, 9000]] = torch.tensor([float("inf"), -0.0, float("-inf")]).to(dtype)
    x = x.cuda()
    bucket = (torch.arange(2048, device="cuda") // 32).expand_as(x)
    src = x.float().abs() if op == "absmax" else x.float()
    scatter = torch.zeros(4, 3, 64, device="cuda").scatter_reduce(-1, bucket, src, "amax", include_self=False)
    assert torch.equal(reduce_equal_buckets(x, op, 64).float().view(torch.int32), scatter.view(torch.int32))
    x.view(-1)[5] = float("nan")
    with_nan = reduce_equal_buckets(x, op, 64).float()
    assert with_nan.isnan().sum() == 1 and with_nan[0, 0, 0].isnan()


@pytest.mark.parametrize("log", [True, False])
def test_top_probabilities_on_cuda_are_the_fp32_reference(log):
    """compute_top_probs on CUDA (softmax with the cast fused, a max for k = 1, a bf16 top-k and
    a gather for k > 1) over the 1.3B preset's vocabulary: the fp32 reference's probabilities,
    each that of the entry returned with it."""
    from megatronapp.scope.batching import compute_top_probs

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (4 * torch.randn(24, 1, 50304, generator=g, device="cuda")).to(torch.bfloat16)[..., :50257]
    reference = logits.float().log_softmax(-1) if log else logits.float().softmax(-1)
    for k in (1, 5):
        values, indices = compute_top_probs(logits, k, log=log)
        torch.testing.assert_close(values, reference.topk(k, dim=-1).values, rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(values, reference.gather(-1, indices), rtol=1e-6, atol=1e-8)
