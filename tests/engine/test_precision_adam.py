"""Precision-aware optimizer: fp32 master semantics from bf16 weights + 16-bit remainders,
low-precision Adam moments, sharded states, checkpoints, and the flags' one-line refusals."""

from __future__ import annotations

import pytest
import torch
from engine_jobs import RandomTokenBatches, make_job, train_and_report

from megatronapp.config import OptimizerConfig
from megatronapp.engine.checkpoint import load_checkpoint, save_checkpoint
from megatronapp.engine.precision_adam import PrecisionAwareAdamW, StatePrecision, join_master, split_master
from megatronapp.engine.trainer import Trainer
from megatronapp.parallel.groups import build_process_groups

REMAINDERS = StatePrecision(param_remainders=True)
BF16_MOMENTS = dict(use_precision_aware_optimizer=True, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def test_remainder_split_is_a_bijection_and_rounds_to_nearest_with_ties_away():
    gen = torch.Generator().manual_seed(0)
    patterns = torch.randint(-(2**31), 2**31 - 1, (200_000,), dtype=torch.int64, generator=gen).to(torch.int32)
    special = torch.tensor(
        [0.0, -0.0, 1.0, -1.0, 3.4e38, -3.4e38, 1e-45, -1e-45, float("inf"), float("-inf"), 1.00390625 + 2**-17]
    )
    ties = ((torch.arange(0x3F00, 0x3F40, dtype=torch.int32) << 16) | 0x8000).view(torch.float32)  # low half 0x8000
    masters = torch.cat([patterns.view(torch.float32), special, ties, -ties])
    weight, remainder = split_master(masters)
    assert weight.dtype == torch.bfloat16 and remainder.dtype == torch.int16
    assert torch.equal(_bits(join_master(weight, remainder)), _bits(masters))  # NaN payloads included
    finite = torch.isfinite(masters) & (masters.abs() < 3e38)
    tie = (_bits(masters) & 0xFFFF) == 0x8000
    nearest = masters.to(torch.bfloat16)
    assert torch.equal(weight[finite & ~tie].view(torch.int16), nearest[finite & ~tie].view(torch.int16))
    away = weight[finite & tie].float().abs()
    assert bool((away >= masters[finite & tie].abs()).all()) and int((finite & tie).sum()) >= 100


def _optimizers(params_fp32: list[torch.Tensor], precision: StatePrecision):
    """A PrecisionAwareAdamW with its own copies of `params_fp32` (bf16 weights for remainders)."""
    params = [p.to(torch.bfloat16) if precision.param_remainders else p.clone() for p in params_fp32]
    grads = [torch.zeros_like(p) for p in params_fp32]
    groups = [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}]
    opt = PrecisionAwareAdamW(
        groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, precision=precision, grad_of=dict(zip(map(id, params), grads))
    )
    return opt, params, grads


def test_remainder_masters_update_like_fp32_masters_bit_for_bit():
    """Same grads, five steps: the remainder form's rebuilt masters and its moments equal the
    fp32-master form's bit for bit, and the fp32 form equals torch's AdamW bit for bit."""
    torch.manual_seed(0)
    shapes = [(64, 48), (3000,), (48,), (7,)]
    start = [torch.randn(s).to(torch.bfloat16).float() for s in shapes]  # masters start at the bf16 weights
    fp32_opt, fp32_params, fp32_grads = _optimizers(start, StatePrecision())
    rem_opt, rem_params, rem_grads = _optimizers(start, REMAINDERS)
    ref = [p.clone() for p in start]
    torch_opt = torch.optim.AdamW(
        [{"params": ref[:2], "weight_decay": 0.1}, {"params": ref[2:], "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.95)
    )
    for step in range(5):
        for i, s in enumerate(shapes):
            g = torch.randn(s) * 10.0 ** (i - 2)
            fp32_grads[i].copy_(g)
            rem_grads[i].copy_(g)
            ref[i].grad = g.clone()
        fp32_opt.step()
        rem_opt.step()
        torch_opt.step()
        for p32, prem, pref in zip(fp32_params, rem_params, ref):
            assert torch.equal(_bits(p32), _bits(pref)), step
            assert torch.equal(_bits(rem_opt.master_value(prem)), _bits(p32)), step
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(rem_opt.state[prem][key], fp32_opt.state[p32][key])
                assert torch.equal(fp32_opt.state[p32][key], torch_opt.state[pref][key])
    moved = [(p - s).abs().max() for p, s in zip(fp32_params, start)]
    assert all(m > 0 for m in moved)
    low_bits = torch.cat([_bits(p).view(-1) & 0xFFFF for p in fp32_params])
    assert bool((low_bits != 0).any())  # the masters really use their low halves


def test_skip_flag_keeps_every_tensor_without_reading_it_on_the_host():
    torch.manual_seed(1)
    opt, params, grads = _optimizers([torch.randn(100) for _ in range(3)], REMAINDERS)
    for g in grads:
        g.normal_()
    opt.step()
    before = {k: v.clone() for k, v in opt.state[params[0]].items()}
    weight = params[0].clone()
    opt.step(torch.tensor(2.0), skip=torch.tensor(1.0))
    assert torch.equal(params[0], weight)
    assert all(torch.equal(before[k], opt.state[params[0]][k]) for k in before)


def _trainer(job, rank: int = 0):
    groups = build_process_groups(job.layout, rank)
    data = RandomTokenBatches(job, groups.dp_rank)
    return Trainer(job, groups, torch.device("cpu"), data), data


def test_all_fp32_precision_aware_equals_the_plain_optimizer_bit_for_bit():
    torch.set_num_threads(1)
    plain = train_and_report(0, 1, make_job(1, iters=3, bf16=True))
    aware = train_and_report(
        0, 1, make_job(1, iters=3, bf16=True, use_precision_aware_optimizer=True, store_param_remainders=False)
    )
    assert aware["losses"] == plain["losses"] and aware["norms"] == plain["norms"]


def test_remainders_and_bf16_moments_hold_2_plus_4_bytes_a_parameter_and_train_like_fp32_state():
    torch.set_num_threads(1)
    plain = train_and_report(0, 1, make_job(1, iters=4, bf16=True))
    aware_job = make_job(1, iters=4, bf16=True, **BF16_MOMENTS)
    trainer, _ = _trainer(aware_job)
    losses = [m.loss for m in trainer.train(4)]
    torch.testing.assert_close(losses, plain["losses"], rtol=2e-3, atol=0)
    numel = sum(p.numel() for c in trainer.chunks for p in c.parameters())
    held = trainer.optimizer.state_bytes()
    assert held["main_params"] == 2 * numel and held["adam"] == 4 * numel
    states = trainer.optimizer.optimizer.state.values()
    assert {st["exp_avg"].dtype for st in states} == {torch.bfloat16}


def test_bf16_main_grads_halve_the_grad_buffers_and_train_like_fp32_grads(cluster):
    """bf16 grads accumulate and reduce in bf16 (one process and DP2 with the distributed optimizer)."""
    torch.set_num_threads(1)
    fp32_grads = train_and_report(0, 1, make_job(1, iters=4, bf16=True, **BF16_MOMENTS))
    job = make_job(1, iters=4, bf16=True, main_grads_dtype="bf16", **BF16_MOMENTS)
    trainer, _ = _trainer(job)
    losses = [m.loss for m in trainer.train(4)]
    torch.testing.assert_close(losses, fp32_grads["losses"], rtol=5e-3, atol=0)
    assert {buf.grad_data.dtype for buf in trainer.reducer.buffers} == {torch.bfloat16}
    numel = sum(buf.grad_data.numel() for buf in trainer.reducer.buffers)
    assert trainer.optimizer.state_bytes()["main_grads"] == 2 * numel
    dp2 = make_job(2, iters=4, bf16=True, use_distributed_optimizer=True, main_grads_dtype="bf16", **BF16_MOMENTS)
    for rep in cluster.run(train_and_report, 2, dp2):
        torch.testing.assert_close(rep["losses"], losses, rtol=5e-3, atol=0)


def test_fp32_model_with_bf16_moments_trains_like_fp32_moments():
    """fp32 params are their own masters; only the moments are stored in bf16."""
    torch.set_num_threads(1)
    plain = train_and_report(0, 1, make_job(1, iters=4))["losses"]
    trainer, _ = _trainer(make_job(1, iters=4, **BF16_MOMENTS))
    losses = [m.loss for m in trainer.train(4)]
    torch.testing.assert_close(losses, plain, rtol=2e-3, atol=0)
    held = trainer.optimizer.state_bytes()
    numel = sum(p.numel() for c in trainer.chunks for p in c.parameters())
    assert held["main_params"] == 0 and held["adam"] == 4 * numel


def test_fp8_weight_gradients_accumulate_into_bf16_main_grads():
    torch.set_num_threads(1)
    aware = dict(bf16=True, fp8_format="hybrid", **BF16_MOMENTS)
    fp32_grads = train_and_report(0, 1, make_job(1, iters=3, **aware))["losses"]
    bf16_grads = train_and_report(0, 1, make_job(1, iters=3, main_grads_dtype="bf16", **aware))["losses"]
    torch.testing.assert_close(bf16_grads, fp32_grads, rtol=1e-3, atol=0)


def train_save_resume(rank: int, world: int, job, save_dir: str) -> dict:
    """4 uninterrupted steps, against 2 steps + save + load into a fresh trainer + 2 steps."""
    straight, _ = _trainer(job, rank)
    losses = [m.loss for m in straight.train(4)]
    first, data = _trainer(job, rank)
    head = [m.loss for m in first.train(2)]
    save_checkpoint(save_dir, first, data)
    resumed, data2 = _trainer(job, rank)
    load_checkpoint(save_dir, resumed, data2)
    tail = [m.loss for m in resumed.train(2)]
    masters = [resumed.optimizer._value(m, "main_param") for m in resumed.optimizer.mains]
    same = all(
        torch.equal(a, straight.optimizer._value(m, "main_param")) for a, m in zip(masters, straight.optimizer.mains)
    )
    return {"straight": losses, "resumed": head + tail, "masters_equal": same}


def load_and_train(rank: int, world: int, job, save_dir: str) -> list[float]:
    trainer, data = _trainer(job, rank)
    assert load_checkpoint(save_dir, trainer, data) == 2
    return [m.loss for m in trainer.train(2)]


def test_remainder_state_resumes_bit_exact_from_a_checkpoint(tmp_path):
    torch.set_num_threads(1)
    rep = train_save_resume(0, 1, make_job(1, iters=4, bf16=True, **BF16_MOMENTS), str(tmp_path))
    assert rep["resumed"] == rep["straight"] and rep["masters_equal"]
    plain = load_and_train(0, 1, make_job(1, iters=4, bf16=True), str(tmp_path))  # fp32 state, same values
    torch.testing.assert_close(plain, rep["straight"][2:], rtol=1e-3, atol=0)


def test_sharded_remainder_state_matches_one_process_and_reshards(cluster, tmp_path):
    """DP2 x TP2 and PP2 x DP2 with the distributed optimizer against one process; a DP2
    checkpoint resumes under DP1 without the distributed optimizer, bit for bit."""
    torch.set_num_threads(1)
    reference = train_and_report(0, 1, make_job(1, iters=3, bf16=True, **BF16_MOMENTS))
    for world, tp, pp in ((4, 2, 1), (4, 1, 2)):
        job = make_job(world, tp, pp, iters=3, bf16=True, use_distributed_optimizer=True, **BF16_MOMENTS)
        for rep in cluster.run(train_and_report, world, job):
            torch.testing.assert_close(rep["losses"], reference["losses"], rtol=1e-2, atol=0)
    dp2 = make_job(2, iters=4, bf16=True, use_distributed_optimizer=True, **BF16_MOMENTS)
    straight = cluster.run(train_save_resume, 2, dp2, str(tmp_path))[0]
    assert straight["resumed"] == straight["straight"] and straight["masters_equal"]
    single = load_and_train(0, 1, make_job(1, iters=4, bf16=True, **BF16_MOMENTS), str(tmp_path))
    torch.testing.assert_close(single, straight["straight"][2:], rtol=1e-3, atol=0)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--exp-avg-dtype", "bf16"], "--exp-avg-dtype bf16 needs --use-precision-aware-optimizer"),
        (["--use-precision-aware-optimizer", "--exp-avg-sq-dtype", "fp8"], "--exp-avg-sq-dtype fp8 is not supported"),
        (["--use-precision-aware-optimizer", "--main-grads-dtype", "bf16"], "--main-grads-dtype bf16 needs --bf16"),
        (["--main-grads-dtype", "bf16", "--bf16"], "--main-grads-dtype bf16 needs --use-precision-aware-optimizer"),
        (["--use-precision-aware-optimizer", "--main-params-dtype", "fp16"], "--main-params-dtype fp16 needs --bf16"),
        (["--exp-avg-dtype", "fp64"], "argument --exp-avg-dtype: invalid choice: 'fp64'"),
    ],
)
def test_bad_precision_aware_flags_fail_in_one_line_before_launch(train_before_launch, args, message):
    code, lines = train_before_launch(args)
    assert code == 2 and len(lines) == 1 and message in lines[0], lines


def test_precision_aware_flags_reach_the_config_and_defaults_come_from_the_dataclass():
    import json

    from test_cli import run_cli

    res = run_cli(
        ["--print-config", "--bf16", "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16"], timeout=60
    )
    assert res.returncode == 0, res.stderr
    cfg = json.loads(res.stdout)["optimizer"]
    want = {"use_precision_aware_optimizer": True, "exp_avg_dtype": "bf16"}
    assert {k: cfg[k] for k in want} == want
    defaults = OptimizerConfig()
    for name in ("main_params_dtype", "main_grads_dtype", "exp_avg_sq_dtype", "store_param_remainders"):
        assert cfg[name] == getattr(defaults, name)
    assert not OptimizerConfig(**want).state_is_fp32 and defaults.state_is_fp32


@pytest.mark.gpu
def test_master_kernel_with_remainders_equals_its_fp32_master_form_on_the_gpu():
    """The compiled kernel (engine/master_adam.py): remainders rebuild the fp32-master kernel's
    masters bit for bit; bf16 moments round to nearest even as the torch path does."""
    from megatronapp.engine.master_adam import MasterAdamW

    dev = torch.device("cuda")
    torch.manual_seed(0)
    shapes = [(640, 48), (12288,), (16,), (4097,)]
    start = [torch.randn(s, device=dev).to(torch.bfloat16).float() for s in shapes]

    def setup(precision: StatePrecision):
        opt, params, grads = _optimizers(start, precision)
        models = {id(p): p if precision.param_remainders else p.to(torch.bfloat16) for p in params}
        kernel = MasterAdamW(opt, models, grad_of=opt.grad_of, remainders=precision.param_remainders)
        return opt, params, grads, kernel

    fp32, rem = setup(StatePrecision()), setup(REMAINDERS)
    for _ in range(5):
        for i, s in enumerate(shapes):
            g = torch.randn(s, device=dev) * 10.0 ** (i - 2)
            fp32[2][i].copy_(g)
            rem[2][i].copy_(g)
        fp32[3].step(torch.tensor(2.0, device=dev))
        rem[3].step(torch.tensor(2.0, device=dev))
    for p32, prem in zip(fp32[1], rem[1]):
        assert torch.equal(_bits(rem[0].master_value(prem)), _bits(p32))
