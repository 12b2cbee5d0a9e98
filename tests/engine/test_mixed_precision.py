"""Megatron mixed precision: bf16 main grads and training, fp16 loss scaling and overflow skips."""

from __future__ import annotations

import pytest
import torch
from engine_jobs import RandomTokenBatches, make_job, train_and_report

from megatronapp.config import ConfigError, PrecisionConfig
from megatronapp.engine.checkpoint import load_checkpoint, save_checkpoint
from megatronapp.engine.grad_scaler import DynamicGradScaler
from megatronapp.engine.trainer import Trainer
from megatronapp.parallel.groups import build_process_groups, single_process_groups

CPU = torch.device("cpu")


def _trainer(job, rank=0):
    groups = build_process_groups(job.layout, rank) if job.layout.world_size > 1 else single_process_groups()
    data = RandomTokenBatches(job, groups.dp_rank)
    return Trainer(job, groups, CPU, data), data


def _params(trainer) -> dict:
    return {n: p for c in trainer.chunks for n, p in c.named_parameters()}


def test_dynamic_scaler_follows_megatron_rule():
    s = DynamicGradScaler(2.0**10, 2.0**8, CPU, growth_interval=3, hysteresis=2)
    s.update(True)  # first overflow uses up hysteresis only
    assert float(s.scale) == 2.0**10
    s.update(True)
    assert float(s.scale) == 2.0**9
    s.update(True)  # hysteresis stays used up until the scale grows again
    assert float(s.scale) == 2.0**8
    s.update(True)  # not below min_scale
    assert float(s.scale) == 2.0**8
    for _ in range(3):
        s.update(False)
    assert float(s.scale) == 2.0**9
    s.update(True)  # hysteresis was refilled by the growth
    assert float(s.scale) == 2.0**9


def test_bad_precision_config_is_refused():
    with pytest.raises(ConfigError, match="mutually exclusive"):
        PrecisionConfig(bf16=True, fp16=True)
    with pytest.raises(ConfigError, match="hysteresis"):
        PrecisionConfig(fp16=True, hysteresis=0)


def test_bf16_trains_and_follows_fp32():
    torch.set_num_threads(1)
    bf16 = train_and_report(0, 1, make_job(1, bf16=True, iters=8))["losses"]
    fp32 = train_and_report(0, 1, make_job(1, iters=8))["losses"]
    assert bf16[-1] < bf16[0] - 0.05, bf16
    torch.testing.assert_close(bf16, fp32, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    "layout", [(2, 1, {}), (1, 2, {}), (1, 1, {"use_distributed_optimizer": True})], ids=["tp2", "pp2", "dp2_distopt"]
)
def test_bf16_layouts_follow_single_process(cluster, layout):
    """bf16 activations cross TP collectives and PP sends; reduction orders differ, so bf16 tolerance."""
    tp, pp, kw = layout
    single = train_and_report(0, 1, make_job(1, bf16=True))
    reports = cluster.run(train_and_report, 2, make_job(2, tp, pp, bf16=True, **kw))
    for rep in reports:
        torch.testing.assert_close(rep["losses"], single["losses"], rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(rep["norms"], single["norms"], rtol=3e-2, atol=1e-3)


def test_bf16_main_grads_match_fp32_grads_of_the_same_weights():
    """fp32 main grads of the bf16 model vs an fp32 model holding the same (bf16) values."""
    torch.set_num_threads(1)
    bf16, _ = _trainer(make_job(1, bf16=True, clip_grad=0.0))
    ref, _ = _trainer(make_job(1, clip_grad=0.0))
    with torch.no_grad():
        for name, p in _params(ref).items():
            p.copy_(_params(bf16)[name])
    bf16.train_step()
    ref.train_step()
    for name, p in _params(bf16).items():
        assert p.dtype == torch.bfloat16 and p.grad is None  # no bf16 .grad kept after backward
        assert p.main_grad.dtype == torch.float32
        want = _params(ref)[name].main_grad
        err = (p.main_grad - want).norm() / want.norm().clamp(min=1e-12)
        assert err < 2e-2, (name, float(err))


def test_bf16_checkpoint_resume_is_bit_exact(tmp_path):
    torch.set_num_threads(1)
    job = make_job(1, iters=4, bf16=True)
    straight, _ = _trainer(job)
    want = [m.loss for m in straight.train(4)]
    first, data = _trainer(job)
    head = [m.loss for m in first.train(2)]
    save_checkpoint(tmp_path, first, data)
    resumed, data2 = _trainer(job)
    load_checkpoint(tmp_path, resumed, data2)
    assert head + [m.loss for m in resumed.train(2)] == want
    for name, p in _params(resumed).items():
        assert torch.equal(p, _params(straight)[name])


def fp16_with_injected_overflow(rank: int, world: int, job, bad_step: int) -> list[dict]:
    """Train; at `bad_step`, after the DP reduction, write inf into one main grad on DP rank 1."""
    trainer, _ = _trainer(job, rank)
    finish = trainer.reducer.finish

    def finish_then_inject():
        finish()
        if trainer.iteration == bad_step and trainer.groups.dp_rank == world - 1:
            trainer.optimizer.mains[0].main_param.grad.view(-1)[0] = float("inf")

    trainer.reducer.finish = finish_then_inject
    records = []
    for _ in range(job.train.train_iters):
        before = {n: p.detach().clone() for n, p in _params(trainer).items()}
        m = trainer.train_step()
        changed = any(not torch.equal(before[n], p) for n, p in _params(trainer).items())
        records.append(
            {
                "iteration": m.iteration,
                "scale": m.loss_scale,
                "skipped": m.skipped_iterations,
                "changed": changed,
                "lr": m.lr,
                "loss": m.loss,
            }
        )
    return records


@pytest.mark.parametrize("distopt", [False, True], ids=["dp2", "dp2_distopt"])
def test_fp16_overflow_skips_exactly_one_step_and_lowers_the_scale(cluster, distopt):
    job = make_job(
        2,
        iters=5,
        fp16=True,
        initial_loss_scale=2.0**12,
        hysteresis=1,
        lr_warmup_iters=10,
        use_distributed_optimizer=distopt,
    )
    for records in cluster.run(fp16_with_injected_overflow, 2, job, 2):
        assert [r["iteration"] for r in records] == [1, 2, 3, 4, 5]  # the skipped step counts
        assert [r["changed"] for r in records] == [True, True, False, True, True]
        assert [r["skipped"] for r in records] == [0, 0, 1, 1, 1]
        assert [r["scale"] for r in records] == [2.0**12] * 3 + [2.0**11] * 2
        lrs = [r["lr"] for r in records]
        assert lrs[3] == lrs[2] and lrs[4] > lrs[3] > lrs[1]  # the skip does not advance the LR schedule


def test_fp16_without_overflow_follows_fp32():
    torch.set_num_threads(1)
    fp16 = train_and_report(0, 1, make_job(1, fp16=True, initial_loss_scale=2.0**12))
    fp32 = train_and_report(0, 1, make_job(1))
    torch.testing.assert_close(fp16["losses"], fp32["losses"], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(fp16["norms"], fp32["norms"], rtol=2e-2, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kw",
    [{"bf16": True}, {"bf16": True, "use_distributed_optimizer": True}, {"fp16": True, "initial_loss_scale": 2.0**16}],
    ids=["bf16", "bf16_distopt", "fp16"],
)
def test_low_precision_on_cuda_is_close_to_fp32(kw):
    from megatronapp.config import build_layout, model_preset
    from megatronapp.job import build_job

    def losses(**train_kw):
        job = build_job(
            model_preset("small", num_layers=4, seq_length=128),
            build_layout(1, 1, 1),
            micro_batch_size=2,
            global_batch_size=8,
            train_iters=6,
            lr=1e-3,
            **train_kw,
        )
        torch.manual_seed(0)
        trainer = Trainer(job, single_process_groups(), torch.device("cuda"), RandomTokenBatches(job, 0))
        return [m.loss for m in trainer.train(6)]

    low, fp32 = losses(**kw), losses()
    assert low[-1] < low[0]
    torch.testing.assert_close(low, fp32, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_fused_adamw_folds_clipping_into_its_grad_scale(bf16):
    """The GPU path (fused AdamW, clip factor passed as grad_scale) against explicit clipping
    then unfused AdamW, with a clip that binds: same params, same (clipped) main grads."""
    from megatronapp.engine.mixed_precision import MixedPrecisionOptimizer

    torch.set_num_threads(1)
    runs = []
    for fused in (False, True):
        trainer, _ = _trainer(make_job(1, bf16=bf16, clip_grad=0.05))
        trainer.optimizer = MixedPrecisionOptimizer(
            trainer.reducer, trainer.job.optimizer, trainer.job.precision, trainer.groups, CPU, fused=fused
        )
        trainer.runtime.grad_scale_func = trainer.optimizer.scale_loss
        norms = [trainer.train_step().grad_norm for _ in range(3)]
        runs.append((norms, _params(trainer)))
    (norms, ref), (fused_norms, got) = runs
    assert min(norms) > 0.05 * 2  # the clip really scaled the grads
    torch.testing.assert_close(fused_norms, norms, rtol=1e-5, atol=0)
    for name, p in got.items():
        # 3 steps of Adam with the clip folded into the grad scale round differently: one fp32 weight
        # of 12,288 lands 1.2e-6 away (a few ulps of the update, not a wrong one)
        torch.testing.assert_close(p, ref[name], rtol=1e-5, atol=2e-6)
        torch.testing.assert_close(p.main_grad, ref[name].main_grad, rtol=1e-5, atol=1e-8)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "model_dtype,shapes,block",
    [
        (torch.bfloat16, [(513, 77), (4097,), (3,), (8192,)], 4096),  # odd sizes: the scalar path
        (torch.float16, [(513, 77), (4097,), (3,), (8192,)], 4096),
        (torch.bfloat16, [(640, 48), (12288,), (16,), (8192,)], 4096),  # aligned: the vector path
        (torch.bfloat16, [(640, 48), (12288,), (16,), (8192,)], 8192),
        (torch.bfloat16, [(640, 48), (12288,), (16,), (8192,)], 1024),
    ],
    ids=["bf16", "fp16", "aligned", "aligned-8192", "aligned-1024"],
)
def test_master_adamw_kernel_equals_torch_adamw_then_copy(model_dtype, shapes, block):
    """The Triton kernel on fixed inputs against torch's AdamW on pre-divided grads, 3 steps,
    two param groups (with and without weight decay), masked tails; one launch per group over
    tables built once (grads written in place, as the engine's main-grad buffers); every
    element is updated, on the scalar and the vector path and for several launch shapes."""
    from megatronapp.engine import master_adam

    torch.manual_seed(0)
    dev = torch.device("cuda")
    ref = [torch.randn(s, device=dev) for s in shapes]
    mains = [r.clone() for r in ref]
    models = [m.to(model_dtype) for m in mains]
    for m in mains:
        m.grad = torch.zeros_like(m)

    def adamw(ps):
        return torch.optim.AdamW(
            [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}],
            lr=1e-2,
            betas=(0.9, 0.95),
            eps=1e-8,
        )

    torch_opt, kernel_opt = adamw(ref), adamw(mains)
    kernel = master_adam.MasterAdamW(kernel_opt, {id(m): v for m, v in zip(mains, models)}, block=block)
    before = [m.clone() for m in mains]
    for _ in range(3):
        grads = [torch.randn_like(r) for r in ref]
        for r, g in zip(ref, grads):
            r.grad = g / 4.0
        for m, g in zip(mains, grads):
            m.grad.copy_(g)
        torch_opt.step()
        kernel.step(torch.tensor(4.0, device=dev))
    aligned = shapes[0] == (640, 48)
    assert [plan.aligned for plan in kernel._plans] == [aligned, aligned]
    for r, m, v, b in zip(ref, mains, models, before):
        assert bool((m != b).all())  # no element skipped
        torch.testing.assert_close(m, r, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(
            kernel_opt.state[m]["exp_avg_sq"], torch_opt.state[r]["exp_avg_sq"], rtol=1e-6, atol=0
        )
        assert torch.equal(v, m.to(model_dtype))  # rounded to nearest even, as .to() does
        assert float(kernel_opt.state[m]["step"]) == 3.0


@pytest.mark.gpu
@pytest.mark.parametrize("distopt", [False, True], ids=["plain", "distopt"])
def test_fused_master_adamw_matches_torch_adamw_then_copy(distopt):
    """The engine with the Triton master-weight kernel (AdamW + clip + model-weight write) against
    torch's fused AdamW + clip + master->bf16 copy: the kernel is used, trains the same, and the
    model weights are exactly the rounded masters."""
    from megatronapp.config import build_layout, model_preset
    from megatronapp.engine import master_adam
    from megatronapp.job import build_job

    assert master_adam.available(torch.device("cuda"))
    runs = []
    for kernel in (False, True):
        job = build_job(
            model_preset("small", num_layers=2, seq_length=128),
            build_layout(1, 1, 1),
            micro_batch_size=2,
            global_batch_size=4,
            train_iters=3,
            lr=1e-3,
            clip_grad=0.05,
            bf16=True,
            use_distributed_optimizer=distopt,
            fused_master_adamw=kernel,
        )
        torch.manual_seed(0)
        trainer = Trainer(job, single_process_groups(), torch.device("cuda"), RandomTokenBatches(job, 0))
        assert trainer.optimizer.master_kernel == kernel
        metrics = trainer.train(3)
        opt = trainer.optimizer
        rounded = all(torch.equal(opt._model_view(m), m.main_param.to(torch.bfloat16)) for m in opt.mains)
        runs.append(([m.grad_norm for m in metrics], [m.loss for m in metrics], rounded))
    (norms, losses, rounded), (k_norms, k_losses, k_rounded) = runs
    # GPU backward is not bit-deterministic and Adam turns tiny grad differences into lr-sized
    # steps where |grad| ~ 0, so compare trajectories loosely; the kernel's exactness is the test above
    assert min(norms) > 0.1  # the clip binds
    torch.testing.assert_close(k_norms, norms, rtol=1e-3, atol=0)
    torch.testing.assert_close(k_losses, losses, rtol=1e-3, atol=0)
    assert rounded and k_rounded  # model weights = masters rounded to nearest even


@pytest.mark.gpu
def test_master_adamw_kernel_resumes_into_a_trainer_that_already_stepped(tmp_path):
    """Loading a checkpoint replaces the Adam state the kernel's address tables point at: the
    tables are rebuilt, so the loaded state is the one stepped (step count 2 + 1, same weights)."""
    from megatronapp.config import build_layout, model_preset
    from megatronapp.job import build_job

    job = build_job(
        model_preset("small", num_layers=2, seq_length=128),
        build_layout(1, 1, 1),
        micro_batch_size=2,
        global_batch_size=4,
        train_iters=3,
        lr=1e-3,
        bf16=True,
    )

    def trainer():
        torch.manual_seed(0)
        t = Trainer(job, single_process_groups(), torch.device("cuda"), RandomTokenBatches(job, 0))
        assert t.optimizer.master_kernel
        return t

    source = trainer()
    source.train(2)
    save_checkpoint(tmp_path, source, source.data)
    source.train(1)
    target = trainer()
    target.train(1)  # builds the kernel's tables over its own state
    load_checkpoint(tmp_path, target, target.data)
    target.train(1)
    for m in target.optimizer.mains:
        assert float(target.optimizer.optimizer.state[m.main_param]["step"]) == 3.0
    for (name, p), q in zip(target.chunks[0].named_parameters(), source.chunks[0].parameters()):
        torch.testing.assert_close(p.float(), q.float(), rtol=1e-2, atol=1e-3, msg=name)


def test_small_params_main_grad_adds_are_deferred_and_land_exactly():
    """bf16 biases/norms: each microbatch's grad is added to the fp32 main grad in a batched
    foreach (pending until a flush), and after finish() the main grads equal the fp32 sums of
    the per-microbatch bf16 grads, bit for bit; a large parameter is added at once."""
    from torch import nn

    from megatronapp.engine import grads as grads_mod

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.LayerNorm(6)).to(torch.bfloat16)
    twin = nn.Sequential(nn.Linear(8, 6), nn.LayerNorm(6)).to(torch.bfloat16)
    twin.load_state_dict(model.state_dict())
    inputs = [torch.randn(5, 8, dtype=torch.bfloat16) for _ in range(3)]
    want = {n: torch.zeros(p.shape) for n, p in twin.named_parameters()}
    for x in inputs:
        twin.zero_grad(set_to_none=True)
        twin(x).square().sum().backward()
        for n, p in twin.named_parameters():
            want[n] += p.grad.float()
    old_limit = grads_mod.DEFERRED_ADD_MAX_NUMEL
    grads_mod.DEFERRED_ADD_MAX_NUMEL = 20  # the 48-element weight is "large": added at once
    try:
        reducer = grads_mod.GradReducer([model], None, 1, overlap=False, bucket_mb=1.0)
        for x in inputs:
            model(x).square().sum().backward()
        assert len(reducer._deferred.mains) == 3  # the last microbatch's bias, norm weight, norm bias
        assert float(model[0].weight.main_grad.abs().sum()) > 0  # the large one is already in
        reducer.finish()
    finally:
        grads_mod.DEFERRED_ADD_MAX_NUMEL = old_limit
    for n, p in model.named_parameters():
        assert p.grad is None
        assert torch.equal(p.main_grad, want[n]), n
