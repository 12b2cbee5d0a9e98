"""MegaScope's batched compression and packing: a block of many items is compressed and packed
exactly as the items one by one would be, and the work a capture adds to a recorded decode
step does not grow with the number of layers."""

from __future__ import annotations

import pytest
import torch
from op_count import count_decode_step

from megatronapp.config import model_preset
from megatronapp.inference.model import build_inference_model
from megatronapp.parallel.groups import single_process_groups
from megatronapp.scope import compress
from megatronapp.scope.batching import compress_step, compute_top_probs
from megatronapp.scope.compress import (
    DEFAULT_COMPRESS,
    CapturedItem,
    apply_pipeline,
    parse_pipeline,
    reduce_equal_buckets,
)
from megatronapp.scope.sites import DEFAULT_SITES
from megatronapp.scope.staging import pack_blocks, view_items

PIPELINES = [
    "",
    "reduce:op=absmax,width=64;quantize:dtype=fp16",
    "reduce:op=max,width=8",
    "reduce:op=mean,width=7;quantize:dtype=int8",
    "reduce:op=l2,width=5;topk:k=3;quantize:dtype=fp16",
    "slice:tokens=-2:,heads=1;reduce:op=absmax,width=3",
    "topk:k=4;quantize:dtype=int8",
]


def special_values(shape, dtype, seed: int) -> torch.Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    flat = x.view(-1)
    flat[3], flat[17], flat[40], flat[41] = float("nan"), float("inf"), -0.0, float("-inf")
    return x


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), what


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", ["max", "absmax"])
@pytest.mark.parametrize("width", [1, 4, 64, 128])
@pytest.mark.parametrize("fused", [False, True])
def test_equal_bucket_reduction_is_the_fp32_scatter_bit_for_bit(dtype, op, width, fused, monkeypatch):
    monkeypatch.setattr(compress, "FUSED_ABSMAX_DEVICES", ("cpu",) if fused else ())  # norm kernel / abs + amax
    x = special_values((3, 2, 128), dtype, seed=width)
    fast = reduce_equal_buckets(x, op, width).float()
    bucket = torch.arange(128) // (128 // width)
    src = x.float().abs() if op == "absmax" else x.float()
    scatter = torch.zeros(3, 2, width).scatter_reduce(-1, bucket.expand(3, 2, 128), src, "amax", include_self=False)
    assert_bitwise(fast, scatter, f"{op} {width}")


def per_item(step: int, gathered, ops) -> list[CapturedItem]:
    """Each item compressed on its own (fp32, as before batching): the reference."""
    out = []
    for name, layer, site, data in gathered:
        dims = ("batch", "head", "token", "dim") if data.dim() == 4 else ("batch", "token", "hidden")
        item = apply_pipeline(CapturedItem(f"step{step}/{name}", site, step, layer, dims, {"data": data.float()}), ops)
        out.append(item)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("text", PIPELINES)
def test_a_block_compresses_as_its_items_one_by_one(dtype, text):
    ops = parse_pipeline(text)
    gathered = [
        (f"layer{layer}/{site}", layer, site, special_values(shape, dtype, seed=10 * layer + i))
        for layer in range(3)
        for i, (site, shape) in enumerate(
            [("q", (2, 4, 3, 8)), ("attn_out", (2, 3, 16)), ("mlp_out", (2, 3, 16)), ("residual", (2, 3, 16))]
        )
    ]
    items, blocks = compress_step(5, gathered, ops, None, topk=3)
    assert len(blocks) == 2  # q alone; attn_out, mlp_out and residual of every layer together
    assert [it.name for it in items] == [f"step5/{n}" for n, *_ in gathered]
    for got, want in zip(items, per_item(5, gathered, ops)):
        assert (got.site, got.layer, got.dims, got.ops) == (want.site, want.layer, want.dims, want.ops), got.name
        assert got.tensors.keys() == want.tensors.keys()
        for key in got.tensors:
            assert_bitwise(got.tensors[key], want.tensors[key], f"{got.name} {key}")


def test_packed_buffer_views_back_every_item_exactly():
    gathered = [
        (f"layer{layer}/{site}", layer, site, torch.randn(1, 3, 16))
        for layer in range(2)
        for site in ("attn_out", "residual")
    ]
    values, indices = torch.randn(2, 3), torch.randint(0, 9, (2, 3))
    gathered.append(("topk", None, "topk", torch.return_types.topk((values, indices))))
    items, blocks = compress_step(
        0, gathered, parse_pipeline("reduce:op=absmax,width=5;quantize:dtype=int8"), None, topk=3
    )
    buffer, offsets = pack_blocks(blocks, items, "cpu")
    assert buffer.dtype == torch.uint8 and buffer.numel() == sum(it.nbytes for it in items)  # no padding
    host = buffer.clone()
    viewed = [CapturedItem(it.name, it.site, it.step, it.layer, it.dims, dict(it.tensors)) for it in items]
    view_items(host, viewed, offsets)
    for got, want in zip(viewed, items):
        for key, t in want.tensors.items():
            assert got.tensors[key].untyped_storage().data_ptr() == host.untyped_storage().data_ptr()
            assert_bitwise(got.tensors[key], t, f"{got.name} {key}")


def test_recorded_capture_adds_the_same_kernels_for_any_depth():
    """The default capture's device work per recorded decode step is a fixed chain of ops (one
    cat, reduction and cast for all per-layer sites, one logit-lens matmul, ...), not per layer."""
    added = []
    for layers in (2, 5):
        cfg = model_preset("demo", num_layers=layers, vocab_size=257)
        model = build_inference_model(cfg, single_process_groups(), "cpu", seed=0, dtype=torch.bfloat16)
        off = count_decode_step(model, None)
        on = count_decode_step(model, dict(sites=DEFAULT_SITES, compress=DEFAULT_COMPRESS))
        added.append(sum(on.kernels.values()) - sum(off.kernels.values()))
    assert added[0] == added[1] > 0


@pytest.mark.parametrize("log", [True, False])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_top_probabilities_equal_softmax_then_topk(k, log):
    """compute_top_probs (cast fused into the softmax, max for k = 1, ranking the logits) gives
    the unfused reference's entries and probabilities: fp32 (L, B, V) logits without ties."""
    logits = 4 * torch.randn(6, 2, 1000, generator=torch.Generator().manual_seed(k))
    probs = logits.log_softmax(-1) if log else logits.softmax(-1)
    want = probs.topk(k, dim=-1)
    values, indices = compute_top_probs(logits, k, log=log)
    assert values.dtype == torch.float32 and values.shape == indices.shape == (6, 2, k)
    assert torch.equal(indices, want.indices)
    torch.testing.assert_close(values, want.values, rtol=1e-6, atol=1e-7)


def test_top_probabilities_of_bf16_logits_are_those_of_their_fp32_values():
    """bf16 logits (ties are common): the probabilities are the fp32 reference's, each the
    probability of the entry returned with it, largest first."""
    logits = (3 * torch.randn(4, 1, 300, generator=torch.Generator().manual_seed(0))).to(torch.bfloat16)
    reference = logits.float().softmax(-1)
    for k in (1, 5):
        values, indices = compute_top_probs(logits, k, log=False)
        torch.testing.assert_close(values, reference.topk(k, dim=-1).values, rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(values, reference.gather(-1, indices), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 4, 64])
def test_equal_bucket_mean_is_the_fp32_scatter_mean(dtype, width):
    """The one-kernel mean of equal buckets (fp32 accumulation) equals the fp32 scatter mean
    to rounding; NaN / inf land in the same buckets."""
    x = special_values((3, 2, 128), dtype, seed=width)
    fast = reduce_equal_buckets(x, "mean", width)
    bucket = torch.arange(128) // (128 // width)
    scatter = torch.zeros(3, 2, width).scatter_reduce(
        -1, bucket.expand(3, 2, 128), x.float(), "mean", include_self=False
    )
    assert fast.dtype == torch.float32
    torch.testing.assert_close(fast, scatter, rtol=1e-6, atol=1e-7, equal_nan=True)
