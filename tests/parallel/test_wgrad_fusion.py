"""Gradient-accumulation fusion: weight-gradient GEMMs accumulate into the fp32 main grads."""

from __future__ import annotations

import pytest
import torch
from engine_jobs import RandomTokenBatches, make_job

from megatronapp.engine.trainer import Trainer
from megatronapp.parallel.groups import single_process_groups
from megatronapp.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatronapp.parallel.wgrad_fusion import enable_grad_accumulation_fusion


def _layer(cls, dtype):
    layer = cls("l", 16, 8, tp_group=None, tp_size=1, tp_rank=0, std=0.5, seed=3).to(dtype)
    for p in layer.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
    return layer


@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear])
def test_fused_layer_accumulates_fp32_weight_grads_over_microbatches(cls):
    torch.manual_seed(0)
    layer = _layer(cls, torch.bfloat16)
    assert enable_grad_accumulation_fusion(layer.modules()) == 1
    xs = [torch.randn(2, 5, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
    gys = [torch.randn(2, 5, 8, dtype=torch.bfloat16) for _ in range(2)]
    want = torch.zeros(8, 16)
    for x, gy in zip(xs, gys):
        layer(x).backward(gy)
        want += gy.float().reshape(-1, 8).t() @ x.detach().float().reshape(-1, 16)
        # the input gradient is the plain linear's
        torch.testing.assert_close(x.grad, (gy.float() @ layer.weight.float()).to(torch.bfloat16), rtol=1e-2, atol=1e-2)
        x.grad = None
        layer.weight.grad = None  # what the main-grad hook does with the placeholder
        assert layer.weight.grad_added_to_main_grad
    # fp32 accumulation of exact bf16 products: only fp32 rounding differs from the reference
    torch.testing.assert_close(layer.weight.main_grad, want, rtol=1e-5, atol=1e-5)


def test_fp32_layers_are_left_alone():
    layer = _layer(ColumnParallelLinear, torch.float32)
    assert enable_grad_accumulation_fusion(layer.modules()) == 0 and not layer.wgrad_fusion


def _first_step_main_grads(fusion: bool) -> tuple[dict, list[float]]:
    torch.manual_seed(0)
    job = make_job(1, bf16=True, clip_grad=0.0, gradient_accumulation_fusion=fusion, global_batch=4)
    trainer = Trainer(job, single_process_groups(), torch.device("cpu"), RandomTokenBatches(job, 0))
    fused = [m for c in trainer.chunks for m in c.modules() if getattr(m, "wgrad_fusion", False)]
    assert bool(fused) == fusion
    losses = [trainer.train_step().loss]
    grads = {n: p.main_grad.clone() for c in trainer.chunks for n, p in c.named_parameters()}
    losses += [m.loss for m in trainer.train(2)]
    for c in trainer.chunks:
        for p in c.parameters():
            assert p.grad is None  # neither path keeps a bf16 .grad
    return grads, losses


def test_trainer_with_fusion_matches_the_hook_path():
    """Same model and data, 4 microbatches: main grads agree to bf16 rounding of the per-
    microbatch weight grads (the fused path skips that rounding), losses agree over 3 steps."""
    torch.set_num_threads(1)
    fused, fused_losses = _first_step_main_grads(True)
    hooked, hooked_losses = _first_step_main_grads(False)
    for name, g in hooked.items():
        err = (fused[name] - g).norm() / g.norm().clamp(min=1e-12)
        assert err < 1e-2, (name, float(err))
    torch.testing.assert_close(fused_losses, hooked_losses, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_first_write_replaces_zeroing_and_a_weight_without_gradient_reads_zero(device):
    """GradReducer.zero_grad leaves fused weights' main grads alone (their first weight-gradient
    GEMM of the step overwrites them) and zeroes everything else; after finish() the used
    weight holds exactly this step's sum and the unused one reads zero, whatever was there."""
    from torch import nn

    from megatronapp.engine.grads import GradReducer

    torch.manual_seed(0)
    layers = nn.ModuleList(
        [
            ColumnParallelLinear(n, 16, 8, tp_group=None, tp_size=1, tp_rank=0, std=0.5, seed=3)
            for n in ("used", "unused")
        ]
    ).to(device=device, dtype=torch.bfloat16)
    reducer = GradReducer([layers], None, 1, overlap=False, bucket_mb=1.0)
    assert enable_grad_accumulation_fusion(layers.modules()) == 2
    used, unused = layers
    for p in layers.parameters():
        p.main_grad.fill_(7.0)  # the previous step's sums
    reducer.zero_grad()
    assert torch.all(used.weight.main_grad == 7.0)  # no zeroing pass over fused weights
    assert torch.all(used.bias.main_grad == 0.0) and torch.all(unused.bias.main_grad == 0.0)
    want = torch.zeros(8, 16, device=device)
    for _ in range(2):
        x = torch.randn(2, 5, 16, dtype=torch.bfloat16, device=device)
        gy = torch.randn(2, 5, 8, dtype=torch.bfloat16, device=device)
        used(x).backward(gy)
        want += gy.float().reshape(-1, 8).t() @ x.float().reshape(-1, 16)
    reducer.finish()
    torch.testing.assert_close(used.weight.main_grad, want, rtol=1e-5, atol=1e-5)
    assert torch.all(unused.weight.main_grad == 0.0)
    for p in layers.parameters():
        assert p.grad is None
