"""FP8 GEMMs (--fp8-format): exact where FP8 can be exact, the format's rounding otherwise,
the same numbers at TP2 (± sequence parallelism) as in one process, and refused shapes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from engine_jobs import compiled_frames, make_job, train_and_report

from megatronapp.config import ConfigError, PrecisionConfig, build_layout, model_preset
from megatronapp.job import build_job, validate_job
from megatronapp.parallel.fp8 import (
    E4M3,
    E5M2,
    DelayedScaling,
    FP8Spec,
    compute_delayed_scales,
    enable_fp8,
    fp8_linear,
    power_of_two_scale,
    quantize,
    tensor_amax,
    update_delayed_scaling,
)
from megatronapp.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatronapp.parallel.wgrad_fusion import mark_first_write


def _small_ints(shape, high: int, seed: int) -> torch.Tensor:
    return torch.randint(-high, high + 1, shape, generator=torch.Generator().manual_seed(seed)).float()


def test_power_of_two_scale_maps_amax_under_the_format_max():
    amax = torch.tensor([448.0, 1.0, 3.0, 1000.0, 0.0])
    scale = torch.stack([power_of_two_scale(a, E4M3) for a in amax])
    torch.testing.assert_close(scale, torch.tensor([1.0, 256.0, 128.0, 0.25, 2.0**48]))
    assert float(power_of_two_scale(torch.tensor(7.0), E5M2)) == 2.0**13  # 7 * 8192 = 57344, E5M2's max
    assert float(power_of_two_scale(torch.tensor(float("inf")), E4M3)) == 0.0  # the GEMM then shows nan


@pytest.mark.parametrize("fused", [False, True], ids=["weight_grad", "main_grad"])
def test_fp8_linear_is_exact_on_values_fp8_holds(fused):
    """Small integers survive E4M3/E5M2 at the power-of-two scales exactly, so the forward,
    both gradients and the main-grad write-then-add must equal fp32 maths exactly; a wrong
    scale, a transposed operand or a lost accumulation shows as a large error."""
    x = _small_ints((2, 16, 32), 8, 0).requires_grad_()
    w = _small_ints((48, 32), 8, 1).requires_grad_()
    b = _small_ints((48,), 8, 2).requires_grad_()
    g = _small_ints((2, 16, 48), 7, 3)
    main_grad = torch.full((48, 32), float("nan")) if fused else None
    if fused:
        mark_first_write([main_grad])  # the first accumulation writes: the nan must not survive
    spec = FP8Spec(E5M2)
    for _ in range(2 if fused else 1):
        y = fp8_linear(x, w, b, spec, main_grad=main_grad)
        y.backward(g)
    torch.testing.assert_close(y, x.detach() @ w.detach().t() + b.detach(), rtol=0, atol=0)
    runs = 2 if fused else 1
    torch.testing.assert_close(x.grad, runs * (g @ w.detach()), rtol=0, atol=0)
    torch.testing.assert_close(b.grad, runs * g.sum((0, 1)), rtol=0, atol=0)
    expected_w = runs * (g.reshape(-1, 48).t() @ x.detach().reshape(-1, 32))
    torch.testing.assert_close(main_grad if fused else w.grad, expected_w, rtol=0, atol=0)


def _relative_errors(fmt_grad_dtype) -> tuple[float, float, float]:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(64, 128, generator=gen).requires_grad_()
    w = (torch.randn(96, 128, generator=gen) * 0.02).requires_grad_()
    g = torch.randn(64, 96, generator=gen) * 1e-3
    y = fp8_linear(x, w, None, FP8Spec(fmt_grad_dtype))
    y.backward(g)

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    return rel(y, x.detach() @ w.detach().t()), rel(x.grad, g @ w.detach()), rel(w.grad, g.t() @ x.detach())


def test_fp8_rounding_is_the_formats():
    """Random operands: errors of FP8's size (E4M3 ~2^-4 per element, averaged down by the
    sums), not zero (something was cast) and larger for E5M2 gradients than E4M3 ones."""
    fwd, dgrad_e4m3, wgrad_e4m3 = _relative_errors(E4M3)
    _, dgrad_e5m2, wgrad_e5m2 = _relative_errors(E5M2)
    for err in (fwd, dgrad_e4m3, wgrad_e4m3):
        assert 1e-3 < err < 4e-2, (fwd, dgrad_e4m3, wgrad_e4m3)
    assert dgrad_e5m2 > 1.5 * dgrad_e4m3 and wgrad_e5m2 > 1.5 * wgrad_e4m3, (dgrad_e5m2, dgrad_e4m3)


def _half_factor(size: int, world: int, rank: int) -> torch.Tensor:
    full = torch.cat([torch.ones(size // 2), torch.full((size // 2,), 0.1)])
    return full.chunk(world)[rank]


def _mlp_outputs(rank: int, world: int, sequence_parallel: bool) -> dict:
    """A column- then row-parallel pair in fp32 with FP8 GEMMs: output and full gradients."""
    from megatronapp.parallel.mappings import scatter_to_sequence_parallel

    group = dist.new_group(list(range(world))) if world > 1 else None
    kw = dict(tp_group=group, tp_size=world, tp_rank=rank, std=0.5, seed=7, sequence_parallel=sequence_parallel)
    fc1 = ColumnParallelLinear("fc1", 32, 64, **kw)
    fc2 = RowParallelLinear("fc2", 64, 32, **kw)
    # the second half of fc1's rows and fc2's columns 1/10 the size: with scales from their own
    # shard, TP2's rank 1 would cast its weights, its fc2 input and its fc1 output gradient
    # at a scale 8-16x finer than one process does
    with torch.no_grad():
        fc1.weight.mul_(_half_factor(64, world, rank).unsqueeze(1))
        fc2.weight.mul_(_half_factor(64, world, rank).unsqueeze(0))
    assert enable_fp8([torch.nn.ModuleList([fc1, fc2])], "hybrid") == 2
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(8)).requires_grad_()
    grad_y = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(9))
    local_x = scatter_to_sequence_parallel(x, group) if sequence_parallel else x
    y = fc2(torch.nn.functional.gelu(fc1(local_x)))
    if sequence_parallel:  # y is this rank's sequence shard: its share of the gradient, then the whole y
        y.backward(grad_y.chunk(world, dim=1)[rank])
        parts = [torch.empty_like(y) for _ in range(world)]
        dist.all_gather(parts, y.detach().contiguous(), group=group)
        y = torch.cat(parts, dim=1)
    else:
        y.backward(grad_y)

    def full(p, dim):
        if group is None or dim is None:
            return p.grad
        parts = [torch.empty_like(p.grad) for _ in range(world)]
        dist.all_gather(parts, p.grad.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    return {
        "y": y.detach(),
        "x": x.grad,  # x.grad is whole: copy_to_tp / the scatter's backward
        "fc1": full(fc1.weight, 0),
        "fc2": full(fc2.weight, 1),
        "fc1_bias": full(fc1.bias, 0),
    }


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2_sp"])
def test_fp8_tp2_computes_what_one_process_computes(cluster, sequence_parallel):
    """The amax of every sharded operand is reduced over TP, so each shard is cast exactly as
    the whole tensor is in one process: only summation order differs (fp32 tolerance). With
    per-shard scales the weights would round differently, an FP8 ulp (~6%) apart."""
    single = _mlp_outputs(0, 1, False)
    for rep in cluster.run(_mlp_outputs, 2, sequence_parallel):
        for key, value in single.items():
            torch.testing.assert_close(rep[key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize(
    "layout",
    [(2, 1, {}), (2, 1, {"sequence_parallel": True}), (1, 2, {}), (1, 1, {"use_distributed_optimizer": True})],
    ids=["tp2", "tp2_sp", "pp2", "dp2_distopt"],
)
def test_fp8_training_layouts_follow_single_process(cluster, layout):
    """bf16 + FP8 training at TP2 / TP2+SP / PP2 against one process with the same flags
    (bf16 reduction orders differ, so bf16 tolerance, as test_mixed_precision's layouts)."""
    tp, pp, kw = layout
    single = train_and_report(0, 1, make_job(1, bf16=True, fp8_format="hybrid"))
    for rep in cluster.run(train_and_report, 2, make_job(2, tp, pp, bf16=True, fp8_format="hybrid", **kw)):
        torch.testing.assert_close(rep["losses"], single["losses"], rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(rep["norms"], single["norms"], rtol=3e-2, atol=1e-3)


def test_fp8_trains_and_follows_bf16():
    torch.set_num_threads(1)
    fp8 = train_and_report(0, 1, make_job(1, bf16=True, fp8_format="hybrid", iters=8))["losses"]
    bf16 = train_and_report(0, 1, make_job(1, bf16=True, iters=8))["losses"]
    assert fp8[-1] < fp8[0] - 0.05, fp8
    assert fp8 != bf16  # the GEMMs did run in FP8
    torch.testing.assert_close(fp8, bf16, rtol=1e-2, atol=1e-2)


def test_fp8_compiles_into_the_block_graph():
    """torch.compile of an FP8 linear: one graph, the same numbers as eager."""
    torch.set_num_threads(1)
    x = torch.randn(2, 16, 32, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(5))
    w = (torch.randn(48, 32, generator=torch.Generator().manual_seed(6)) * 0.1).bfloat16()
    spec = FP8Spec(E5M2)
    eager = fp8_linear(x, w, None, spec)
    compiled = torch.compile(lambda a, b: fp8_linear(a, b, None, spec), fullgraph=True)(x, w)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_bad_fp8_configs_are_refused():
    with pytest.raises(ConfigError, match="needs --bf16 or --fp16"):
        PrecisionConfig(fp8_format="hybrid")
    with pytest.raises(ConfigError, match="unknown fp8 format"):
        PrecisionConfig(bf16=True, fp8_format="e5m2")
    with pytest.raises(ConfigError, match="recipe 'mxfp8' is not built"):
        PrecisionConfig(bf16=True, fp8_format="hybrid", fp8_recipe="mxfp8")
    with pytest.raises(ConfigError, match="unknown fp8 amax compute algo 'mean'"):
        PrecisionConfig(bf16=True, fp8_format="hybrid", fp8_recipe="delayed", fp8_amax_compute_algo="mean")
    with pytest.raises(ConfigError, match="need fp8_amax_history_len >= 1"):
        PrecisionConfig(bf16=True, fp8_format="hybrid", fp8_recipe="delayed", fp8_amax_history_len=0)
    odd_tokens = build_job(
        model_preset("tiny", seq_length=24), build_layout(1, 1, 1), bf16=True, fp8_format="hybrid", micro_batch_size=1
    )
    with pytest.raises(ConfigError, match=r"tokens per microbatch .* \(24\) to be a multiple of 16"):
        validate_job(odd_tokens)
    with pytest.raises(ConfigError, match=r"hidden size / tensor-parallel size \(8\)"):
        make_job(4, 4, bf16=True, fp8_format="hybrid")


def test_quantized_operands_are_row_major_even_from_a_transposed_tensor():
    """cuBLASLt takes `_scaled_mm`'s first operand row-major only; a gradient can arrive
    transposed, and a cast keeps its strides."""
    g = torch.randn(48, 32).t()
    q, inv = quantize(g, E5M2, tensor_amax(g))
    assert q.is_contiguous() and q.dtype == E5M2
    torch.testing.assert_close(q.float() * inv, g, rtol=0.25, atol=0.0)


def test_first_and_last_layers_can_stay_bf16():
    """Megatron's --first-last-layers-bf16: only the middle layers' linears are switched."""
    from engine_jobs import RandomTokenBatches

    from megatronapp.engine.trainer import Trainer
    from megatronapp.parallel.groups import single_process_groups

    torch.set_num_threads(1)
    job = make_job(1, bf16=True, fp8_format="hybrid", first_last_layers_bf16=True, num_layers_at_end_in_bf16=2)
    trainer = Trainer(job, single_process_groups(), torch.device("cpu"), RandomTokenBatches(job, 0))
    in_fp8 = {
        i
        for i, block in trainer.chunks[0].layers.items()
        if all(m.fp8_spec is not None for m in block.modules() if hasattr(m, "fp8_spec"))
    }
    assert in_fp8 == {"1"}  # 4 layers: the first and the last two stay bf16
    assert trainer.chunks[0].output.fp8_spec is None
    with pytest.raises(ConfigError, match="leave none of the 4 layers in FP8"):
        make_job(
            1,
            bf16=True,
            fp8_format="hybrid",
            first_last_layers_bf16=True,
            num_layers_at_start_in_bf16=2,
            num_layers_at_end_in_bf16=2,
        )
    with pytest.raises(ConfigError, match="--first-last-layers-bf16 needs --fp8-format"):
        PrecisionConfig(bf16=True, first_last_layers_bf16=True)


@pytest.mark.parametrize(
    "recompute",
    [{"recompute_granularity": "selective"}, {"recompute_granularity": "full", "recompute_num_layers": 2}],
    ids=["selective", "full"],
)
def test_fp8_recompute_is_bit_identical(recompute):
    """A recomputed forward casts the same values with the same scales: the same FP8 operands."""
    torch.set_num_threads(1)
    plain = train_and_report(0, 1, make_job(1, bf16=True, fp8_format="hybrid"))
    again = train_and_report(0, 1, make_job(1, bf16=True, fp8_format="hybrid", **recompute))
    assert again["losses"] == plain["losses"]
    for key, (g, _, _) in plain["grads"].items():
        assert torch.equal(again["grads"][key][0], g), key


def test_fp8_resume_is_bit_identical(tmp_path):
    """Current scaling keeps no state, so a checkpoint resumes FP8 training exactly."""
    from test_checkpoint import train_save_resume

    torch.set_num_threads(1)
    rep = train_save_resume(0, 1, make_job(1, bf16=True, fp8_format="hybrid", iters=4), str(tmp_path))
    assert rep["resumed"] == rep["straight"] and rep["params_equal"]


# -- the delayed recipe -------------------------------------------------------------------------


def test_delayed_scales_come_from_the_history_and_keep_the_old_one_on_bad_amaxes():
    fmax = torch.tensor([448.0, 448.0, 57344.0])
    history = torch.tensor([[2.0, float("inf"), 0.0], [8.0, 0.25, 4.0]])  # newest first
    old = torch.tensor([3.0, 5.0, 7.0])
    recent = compute_delayed_scales(history, old, fmax, "most_recent", 0)
    assert recent.tolist() == [128.0, 5.0, 7.0]  # 448 / 2 -> 2^7; inf and 0 keep the old scale
    assert compute_delayed_scales(history, old, fmax, "max", 1).tolist() == [16.0, 5.0, 4096.0]  # 2^5 / 2 etc.


def _linear_step(x, w, g, state):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_linear(x, w, None, FP8Spec(E5M2), state=state)
    y.backward(g)
    return y.detach(), x.grad, w.grad


def test_delayed_linear_starts_in_current_scaling_then_casts_with_the_recorded_amaxes():
    """Step 1 (no history) is current scaling exactly and records the three amaxes; after the
    update, the same operands cast with scales from those amaxes: again exact on small
    integers. A grown operand is clamped to the format's range (a plain cast would give NaN)."""
    from megatronapp.parallel.groups import single_process_groups

    x, w, g = (
        _small_ints((16, 32), 4, 1).float(),
        _small_ints((48, 32), 3, 2).float(),
        _small_ints((16, 48), 2, 3).float(),
    )
    state = DelayedScaling(E5M2, history_len=2, device="cpu")
    current = _linear_step(x, w, g, None)
    first = _linear_step(x, w, g, state)
    for a, b in zip(first, current):
        assert torch.equal(a, b)
    assert state.amax_step.tolist() == [x.abs().max().item(), w.abs().max().item(), g.abs().max().item()]
    update_delayed_scaling([state], single_process_groups(), "most_recent", 0)
    assert state.ready and state.amax_step.tolist() == [0.0, 0.0, 0.0]
    assert state.scale.tolist() == [64.0, 128.0, 16384.0]  # 448/4 -> 2^6, 448/3 -> 2^7, 57344/2 -> 2^14
    second = _linear_step(x, w, g, state)
    for a, b in zip(second, current):
        assert torch.equal(a, b)
    grown, _, _ = _linear_step(x * 16, w, g, state)  # 16 x the recorded amax: 4096 > 448 before the clamp
    assert torch.isfinite(grown).all() and not torch.equal(grown, current[0] * 16)


@pytest.mark.parametrize("algo", ["most_recent", "max"])
def test_the_stacked_update_rolls_each_linears_history_as_a_loop_over_linears_would(algo):
    """Four steps of three linears (history 3, margin 1; one step's amax inf, one zero): each
    linear's history, scales and reset amaxes equal the one-linear rule applied by hand."""
    from megatronapp.parallel.groups import single_process_groups

    gen = torch.Generator().manual_seed(0)
    states = [DelayedScaling(E5M2, 3, "cpu") for _ in range(3)]
    hist = [torch.zeros(3, 3) for _ in states]
    scale = [torch.ones(3) for _ in states]
    for step in range(4):
        for k, st in enumerate(states):
            amax = torch.rand(3, generator=gen) * 10.0 ** (k + step - 2)
            if (step, k) == (1, 2):
                amax[0] = float("inf")
            if (step, k) == (2, 0):
                amax[2] = 0.0
            st.amax_step.copy_(amax)
            hist[k] = torch.cat([amax[None], hist[k][:-1]])
            scale[k] = compute_delayed_scales(hist[k], scale[k], st.fmax, algo, 1)
        update_delayed_scaling(states, single_process_groups(), algo, 1)
        for k, st in enumerate(states):
            assert torch.equal(st.history, hist[k]) and torch.equal(st.scale, scale[k]), (step, k)
            assert st.ready and not st.amax_step.any()
    assert len({tuple(s.tolist()) for s in scale}) == 3  # the linears' scales differ: no cross-talk hidden


def _reduce_delayed_amaxes(rank: int, world: int) -> list[float]:
    from megatronapp.parallel.groups import build_process_groups

    groups = build_process_groups(build_layout(world, 2, 1), rank)  # TP2 x DP2
    states = [DelayedScaling(E4M3, 1, "cpu") for _ in range(2)]
    for k, st in enumerate(states):
        st.amax_step.copy_(torch.tensor([1.0 + rank, 8.0 - rank, 0.5 * (rank + 1)]) * (k + 1))
    update_delayed_scaling(states, groups, "most_recent", 0)
    return [st.scale.tolist() for st in states]


def test_delayed_amaxes_are_reduced_over_tp_and_dp(cluster):
    """Every rank of TP2 x DP2 ends with the scales of the max over all four ranks' amaxes."""
    fmax = torch.tensor([448.0, 448.0, 448.0])
    want = [
        compute_delayed_scales(
            torch.tensor([[4.0, 8.0, 2.0]]) * (k + 1), torch.ones(3), fmax, "most_recent", 0
        ).tolist()
        for k in range(2)
    ]
    for scales in cluster.run(_reduce_delayed_amaxes, 4):
        assert scales == want


DELAYED = {"bf16": True, "fp8_format": "hybrid", "fp8_recipe": "delayed"}


@pytest.mark.parametrize(
    "layout", [(2, 1, {}), (1, 1, {"use_distributed_optimizer": True})], ids=["tp2", "dp2_distopt"]
)
def test_delayed_training_layouts_follow_single_process(cluster, layout):
    tp, pp, kw = layout
    single = train_and_report(0, 1, make_job(1, iters=4, **DELAYED))
    for rep in cluster.run(train_and_report, 2, make_job(2, tp, pp, iters=4, **DELAYED, **kw)):
        torch.testing.assert_close(rep["losses"], single["losses"], rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(rep["norms"], single["norms"], rtol=3e-2, atol=1e-3)


def test_delayed_follows_current_scaling():
    """Same first step (current scaling), then other scales: close, not equal."""
    torch.set_num_threads(1)
    delayed = train_and_report(
        0, 1, make_job(1, iters=8, fp8_amax_history_len=4, fp8_amax_compute_algo="max", **DELAYED)
    )["losses"]
    current = train_and_report(0, 1, make_job(1, iters=8, bf16=True, fp8_format="hybrid"))["losses"]
    assert delayed[0] == current[0] and delayed != current
    torch.testing.assert_close(delayed, current, rtol=1e-2, atol=1e-2)


def test_delayed_recompute_and_resume_are_bit_identical(tmp_path):
    """A recomputed forward records the same amaxes (max is idempotent); a checkpoint keeps
    the histories and scales, so the resumed steps cast as the uninterrupted ones."""
    from test_checkpoint import train_save_resume

    torch.set_num_threads(1)
    kw = dict(fp8_amax_history_len=3, fp8_amax_compute_algo="max", **DELAYED)
    plain = train_and_report(0, 1, make_job(1, iters=3, **kw))
    again = train_and_report(0, 1, make_job(1, iters=3, recompute_granularity="full", recompute_num_layers=2, **kw))
    assert again["losses"] == plain["losses"]
    rep = train_save_resume(0, 1, make_job(1, iters=4, **kw), str(tmp_path))
    assert rep["resumed"] == rep["straight"] and rep["params_equal"]


def test_delayed_linear_compiles_into_one_graph():
    """Forward and backward compiled whole: the eager numbers, and all three amaxes recorded
    (the gradient's by the custom op inside the compiled backward)."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(5)
    x, g = torch.randn(2, 16, 32, generator=gen).bfloat16(), torch.randn(2, 16, 48, generator=gen).bfloat16()
    w = (torch.randn(48, 32, generator=gen) * 0.1).bfloat16()
    results = []
    for compiled in (False, True):
        st = DelayedScaling(E5M2, 1, "cpu")
        st.scale.copy_(torch.tensor([64.0, 1024.0, 4096.0]))
        st.ready = True
        fn = lambda a, b: fp8_linear(a, b, None, FP8Spec(E5M2), state=st)
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = (torch.compile(fn, fullgraph=True) if compiled else fn)(xx, ww)
        y.backward(g)
        results.append((y.detach(), xx.grad, ww.grad, st.amax_step.clone()))
    for eager, compiled in zip(*results):
        assert torch.equal(compiled, eager)
    assert (results[0][3] > 0).all()


def test_compiled_delayed_engine_compiles_per_block_kind_not_per_layer():
    """Ten layers, compiled, delayed FP8: attention and MLP get one graph each for the first step
    (current scaling) and one each after it, plus the head: five frames, no graph breaks.
    tests/gpu/test_gpu.py runs the same on the device's torch."""
    torch.set_num_threads(1)
    job = make_job(1, num_layers=10, iters=3, compile=True, **DELAYED)
    assert compiled_frames(job, "cpu") == {"frames": 5, "graph_breaks": 0}


def _delayed_train_and_save(rank: int, world: int, job, save_dir: str) -> dict:
    from test_checkpoint import _trainer

    from megatronapp.engine.checkpoint import save_checkpoint
    from megatronapp.parallel.fp8 import delayed_state_dict

    trainer, data = _trainer(job, rank)
    trainer.train(2)
    save_checkpoint(save_dir, trainer, data)
    return delayed_state_dict(trainer.fp8_states)


def test_delayed_state_moves_between_layouts(cluster, tmp_path):
    """Saved at TP2 x PP2, loaded by one process: every linear's history and scales, by name."""
    from test_checkpoint import _trainer

    from megatronapp.engine.checkpoint import load_checkpoint
    from megatronapp.parallel.fp8 import delayed_state_dict

    kw = dict(iters=4, fp8_amax_history_len=2, **DELAYED)
    saved = {}
    for states in cluster.run(_delayed_train_and_save, 4, make_job(4, 2, 2, **kw), str(tmp_path)):
        saved.update(states)
    torch.set_num_threads(1)
    single, data = _trainer(make_job(1, **kw), 0)
    load_checkpoint(str(tmp_path), single, data)
    loaded = delayed_state_dict(single.fp8_states)
    assert loaded.keys() == saved.keys() and len(loaded) == 4 * 4  # 4 layers x 4 linears
    for name, entry in loaded.items():
        assert entry["ready"] and torch.equal(entry["history"], saved[name]["history"]), name
        assert torch.equal(entry["scale"], saved[name]["scale"]), name
