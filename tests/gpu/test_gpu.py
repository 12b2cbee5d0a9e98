"""CUDA paths: bf16 + compiled engine against the eager reference, fault injection, tracer clock.

Skipped on CPU (see conftest); run on the GPU machine with `pytest -m gpu`.
"""

from __future__ import annotations

import pytest
import torch
from engine_jobs import RandomTokenBatches, compiled_frames

from megatronapp.config import JobConfig, build_layout, model_preset
from megatronapp.engine.trainer import Trainer
from megatronapp.injection.inject import FaultInjector, FaultPlan
from megatronapp.job import build_job
from megatronapp.parallel.groups import single_process_groups

pytestmark = pytest.mark.gpu


def _job(model_kw=None, **train_kw) -> JobConfig:
    model = model_preset("small", **{"num_layers": 4, "seq_length": 128, **(model_kw or {})})
    return build_job(
        model,
        build_layout(1, 1, 1),
        micro_batch_size=2,
        global_batch_size=8,
        train_iters=4,
        lr=1e-3,
        lr_warmup_iters=0,
        **train_kw,
    )


def _losses(job: JobConfig) -> list[float]:
    trainer = Trainer(job, single_process_groups(), torch.device("cuda"), RandomTokenBatches(job, 0))
    return [m.loss for m in trainer.train(4)]


def test_fp32_cuda_matches_cpu():
    job = _job()
    cuda = _losses(job)
    cpu_trainer = Trainer(job, single_process_groups(), torch.device("cpu"), RandomTokenBatches(job, 0))
    cpu = [m.loss for m in cpu_trainer.train(4)]
    # Same initial weights on both devices (generated on the CPU), so the same numbers.
    torch.testing.assert_close(cuda, cpu, rtol=1e-4, atol=1e-5)
    assert cuda[-1] < cuda[0]


def test_initial_weights_equal_on_cpu_and_cuda():
    job = _job()
    cuda = Trainer(job, single_process_groups(), torch.device("cuda"), RandomTokenBatches(job, 0))
    cpu = Trainer(job, single_process_groups(), torch.device("cpu"), RandomTokenBatches(job, 0))
    pairs = list(zip(cuda.chunks[0].named_parameters(), cpu.chunks[0].named_parameters()))
    assert pairs and all(a.is_cuda and not b.is_cuda for (_, a), (_, b) in pairs)
    for (name, a), (_, b) in pairs:
        assert torch.equal(a.cpu(), b), name


def test_bf16_compiled_matches_eager():
    eager = _losses(_job(bf16=True))
    compiled = _losses(_job(bf16=True, compile=True))
    torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=2e-2)
    fp32 = _losses(_job())
    torch.testing.assert_close(eager, fp32, rtol=3e-2, atol=3e-2)


def test_fp8_linear_on_cuda_is_exact_where_fp8_holds_the_values():
    """cuBLASLt's FP8 GEMMs (fast accumulation in the forward) on small integers: exact,
    as the CPU reference kernel is in tests/parallel/test_fp8.py."""
    from megatronapp.parallel.fp8 import E5M2, FP8Spec, fp8_linear

    gen = torch.Generator().manual_seed(0)
    x, w, b, g = (torch.randint(-8, 9, shape, generator=gen).float() for shape in ((64, 32), (48, 32), (48,), (64, 48)))
    xc, wc = x.cuda().bfloat16().requires_grad_(), w.cuda().bfloat16().requires_grad_()
    y = fp8_linear(xc, wc, b.cuda().bfloat16(), FP8Spec(E5M2))
    y.backward(g.cuda().bfloat16())
    assert torch.equal(y.float().cpu(), (x @ w.t() + b).bfloat16().float())
    assert torch.equal(xc.grad.float().cpu(), (g @ w).bfloat16().float())
    assert torch.equal(wc.grad.float().cpu(), (g.t() @ x).bfloat16().float())


# A tiny model: the CPU side may run oneDNN's FP8 matmul, which is far slower on hosts without
# native FP8 (at the "small" preset's shapes this test outran a 100 s timeout on the H200's host).
_TINY = {"num_layers": 2, "hidden_size": 128, "num_attention_heads": 2, "seq_length": 64}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fp8_training_on_cuda_follows_cpu_and_compiles(recipe):
    """The same bf16 + FP8 job on CUDA (eager and compiled) and on the CPU."""
    job = _job(_TINY, bf16=True, fp8_format="hybrid", fp8_recipe=recipe)
    eager = _losses(job)
    compiled = _losses(_job(_TINY, bf16=True, fp8_format="hybrid", fp8_recipe=recipe, compile=True))
    cpu = [
        m.loss for m in Trainer(job, single_process_groups(), torch.device("cpu"), RandomTokenBatches(job, 0)).train(4)
    ]
    torch.testing.assert_close(eager, cpu, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=2e-2)
    assert eager[-1] < eager[0]


@pytest.mark.timeout(600)
def test_fp8_delayed_engine_compiles_once_per_block_kind_not_per_layer():
    """tests/parallel/test_fp8.py's CPU test on the device's torch: five frames for ten layers. A torch
    that compiled per layer would, past dynamo's limit of 8, run the other blocks eager (it passes
    on torch 2.11, so that is not why the delayed recipe runs slow there)."""
    job = _job(
        {"num_layers": 10, "hidden_size": 64, "num_attention_heads": 2, "seq_length": 32},
        bf16=True,
        fp8_format="hybrid",
        fp8_recipe="delayed",
        compile=True,
    )
    assert compiled_frames(job, "cuda") == {"frames": 5, "graph_breaks": 0}


def test_injected_slowdown_scales_gpu_compute():
    x = torch.randn(4096, 4096, device="cuda")
    inj = FaultInjector(FaultPlan({0: 2.0}), rank=0, device=torch.device("cuda"))

    def work():
        for _ in range(5):
            x @ x

    def time_it(ctx_factory):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        with ctx_factory():
            work()
        e.record()
        e.synchronize()
        return s.elapsed_time(e)

    import contextlib

    base = min(time_it(contextlib.nullcontext) for _ in range(5))
    for _ in range(5):  # let the injector's running estimate settle
        time_it(inj.compute)
    slowed = min(time_it(inj.compute) for _ in range(5))
    assert 1.6 < slowed / base < 2.5, (base, slowed)


def test_tracer_cuda_spans_are_ordered(tmp_path):
    from megatronapp.scan.record.format import build_rank_meta, load_rank_trace
    from megatronapp.scan.record.tracer import TraceConfig, Tracer

    job = _job(bf16=True)
    trainer = Trainer(job, single_process_groups(), torch.device("cuda"), RandomTokenBatches(job, 0))
    meta = build_rank_meta(
        rank=0,
        world_size=1,
        coords={"tp": 0, "dp": 0, "pp": 0},
        layout={"tp_size": 1, "pp_size": 1, "dp_size": 1, "virtual_pp_size": 1},
        host="gpu",
        device="cuda",
        run_id="t",
        clock="cuda",
    )
    tracer = Tracer(TraceConfig(enabled=True, trace_dir=str(tmp_path), interval=1, granularity="full"), meta, "cuda")
    trainer.set_tracer(tracer)
    trainer.train(3)
    tracer.close()
    ev = load_rank_trace(tmp_path / "rank00000.mscan").events.to_pydict()
    names = set(ev["name"])
    assert {"iteration", "forward", "backward", "optimizer", "attention", "mlp", "loss"} <= names
    it = [(s, e) for n, s, e in zip(ev["name"], ev["start_ns"], ev["end_ns"]) if n == "iteration"]
    fw = [(s, e) for n, s, e in zip(ev["name"], ev["start_ns"], ev["end_ns"]) if n == "forward"]
    assert all(e > s for s, e in it + fw)
    assert it[0][0] <= fw[0][0] and fw[0][1] <= it[0][1]  # forward nested in its iteration


def test_cudnn_attention_backend_trains_like_default():
    default = _losses(_job(bf16=True))
    cudnn = _losses(_job(bf16=True, attention_backend="cudnn"))
    torch.testing.assert_close(cudnn, default, rtol=2e-2, atol=2e-2)


def test_fused_weight_grad_accumulation_on_cuda_matches_fp32_reference():
    """The CUDA path (addmm with out_dtype=float32 into main_grad) accumulates exact bf16
    products in fp32, like the CPU path."""
    from megatronapp.parallel.wgrad_fusion import accumulate_weight_grad

    torch.manual_seed(0)
    gy = torch.randn(512, 96, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(512, 64, device="cuda", dtype=torch.bfloat16)
    main = torch.randn(96, 64, device="cuda")
    want = main + gy.float().t() @ x.float()
    accumulate_weight_grad(main, gy, x)
    torch.testing.assert_close(main, want, rtol=1e-4, atol=1e-4)
