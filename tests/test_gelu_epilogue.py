"""--gelu-epilogue-fusion (parallel/gelu_epilogue.py): the fused MLP core against the torch MLP,
with and without fp32 main grads, its cuBLASLt path's layout algebra through a stand-in for
nvmath, in one compiled graph, and the pre-launch checks. Its parity inside the engine under
TP, SP and PP is in test_engine_features.py; on the GPU in test_gpu.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import nvmath_stand_in
from megatronapp.config import ConfigError, JobConfig, TrainConfig
from megatronapp.parallel import gelu_epilogue as ge
from megatronapp.parallel.layers import ColumnParallelLinear, RowParallelLinear

TOKENS, HIDDEN, FFN = 24, 8, 32


def _layers(dtype=torch.float64):
    kw = dict(tp_group=None, tp_size=1, tp_rank=0, seed=3)
    fc1 = ColumnParallelLinear("fc1", HIDDEN, FFN, std=0.3, **kw).to(dtype)
    fc2 = RowParallelLinear("fc2", FFN, HIDDEN, std=0.3, **kw).to(dtype)
    with torch.no_grad():
        fc1.bias.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    return fc1, fc2


def _torch_mlp(x, fc1, fc2):
    return F.linear(F.gelu(F.linear(x, fc1.weight, fc1.bias), approximate="tanh"), fc2.weight)


def _inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, TOKENS // 2, HIDDEN, generator=g, dtype=dtype), torch.randn(2, TOKENS // 2, HIDDEN,
                                                                                      generator=g, dtype=dtype)


def _grads(fn, x, dy, fc1, fc2):
    x = x.clone().requires_grad_()
    params = (fc1.weight, fc1.bias, fc2.weight)
    for p in params:
        p.grad = None
    y = fn(x, fc1, fc2)
    y.backward(dy)
    return y.detach(), [x.grad] + [p.grad for p in params]


def test_core_gives_the_torch_mlp_and_its_gradients():
    fc1, fc2 = _layers()
    x, dy = _inputs()
    want_y, want = _grads(_torch_mlp, x, dy, fc1, fc2)
    got_y, got = _grads(ge.epilogue_mlp_core, x, dy, fc1, fc2)
    torch.testing.assert_close(got_y, want_y)
    for g, w, name in zip(got, want, ("x", "w1", "b1", "w2")):
        torch.testing.assert_close(g, w, msg=name)


def test_with_main_grads_the_weight_gradients_accumulate_there():
    """Gradient-accumulation fusion: weight grads are added to the fp32 main grads (two
    microbatches here), and autograd gets placeholders."""
    fc1, fc2 = _layers(torch.float32)
    x, dy = _inputs(torch.float32)
    _, want = _grads(_torch_mlp, x, dy, fc1, fc2)
    for layer in (fc1, fc2):
        layer.weight.main_grad = torch.ones_like(layer.weight)
        layer.wgrad_fusion = True
    for _ in range(2):
        _grads(ge.epilogue_mlp_core, x, dy, fc1, fc2)
    torch.testing.assert_close(fc1.weight.main_grad, 1 + 2 * want[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fc2.weight.main_grad, 1 + 2 * want[3], rtol=1e-5, atol=1e-5)


def test_cublaslt_path_layout_algebra_through_a_stand_in(monkeypatch):
    """The nvmath path (transposed GEMMs, column-major results, the aux handed back) gives the
    torch path's numbers, plans each shape once and only resets operands afterwards."""
    stand_in = nvmath_stand_in.install(monkeypatch)
    lt = ge._CublasLtEpilogues()
    fc1, fc2 = _layers()
    x, dy = (t.reshape(TOKENS, HIDDEN) for t in _inputs())
    act, aux = lt.gelu_aux_bias(x, fc1.weight, fc1.bias)
    want_act, want_aux = ge.gelu_aux_bias(x, fc1.weight, fc1.bias)
    assert act.is_contiguous() and aux.is_contiguous()  # a column-major (F, T) is a row-major (T, F): no copy
    torch.testing.assert_close(act, want_act)
    torch.testing.assert_close(aux, want_aux)
    dpre, db1 = lt.dgelu_bgrad(dy, fc2.weight, aux)
    want_dpre, want_db1 = ge.dgelu_bgrad(dy, fc2.weight, want_aux)
    torch.testing.assert_close(dpre, want_dpre)
    torch.testing.assert_close(db1, want_db1)
    lt.gelu_aux_bias(x * 2, fc1.weight, fc1.bias)
    lt.dgelu_bgrad(dy, fc2.weight, aux)
    assert stand_in.plans == 2


def test_the_core_compiles_into_one_graph():
    fc1, fc2 = _layers(torch.float32)
    x, dy = _inputs(torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(ge.epilogue_mlp_core, backend="aot_eager", fullgraph=True)
    want_y, want = _grads(ge.epilogue_mlp_core, x, dy, fc1, fc2)
    got_y, got = _grads(compiled, x, dy, fc1, fc2)
    torch.testing.assert_close(got_y, want_y)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_cuda_needs_bf16_or_fp16_and_nvmath(monkeypatch):
    from megatronapp.cli.devices import _check_gelu_epilogue

    _check_gelu_epilogue(JobConfig(train=TrainConfig(gelu_epilogue_fusion=True)), "cpu")  # torch maths on CPU
    with pytest.raises(ConfigError, match="needs --bf16 or --fp16"):
        _check_gelu_epilogue(JobConfig(train=TrainConfig(gelu_epilogue_fusion=True)), "cuda")
    monkeypatch.setitem(__import__("sys").modules, "nvmath", None)
    with pytest.raises(ConfigError, match="needs nvmath-python"):
        _check_gelu_epilogue(JobConfig(train=TrainConfig(gelu_epilogue_fusion=True, bf16=True)), "cuda")
