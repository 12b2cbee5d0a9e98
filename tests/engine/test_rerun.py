"""Checks before the update (--rerun-mode): a flagged step's rerun from the same weights puts back
exactly what the step consumed (dropout RNG, the fp16 loss scale), report_stats measures a real
spread, validation reads nothing on the host and copies no model state, and the refusals."""

from __future__ import annotations

from dataclasses import fields, is_dataclass, replace

import torch
from engine_jobs import RandomTokenBatches, make_job
from integrity_jobs import Corruption, train_with_hook
from torch.utils._python_dispatch import TorchDispatchMode

from megatronapp.config import IntegrityConfig
from megatronapp.engine.integrity import StepHistory, compute_rerun_verdict
from megatronapp.engine.rerun import DeviceBands, decode_flags
from megatronapp.engine.trainer import Trainer
from megatronapp.parallel.groups import single_process_groups

CHECKS = dict(check_for_spiky_loss=True, check_for_large_grads=True, rerun_mode="validate_results")


def _job(iters: int, model_kw: dict | None = None, integrity: dict | None = None, **train_kw):
    """A 2-layer tiny job whose metrics reach the host once, at the end: a flagged step holds
    every update after it until then."""
    job = make_job(1, iters=iters, num_layers=2, log_interval=iters, model_kw=model_kw, **train_kw)
    return replace(job, integrity=IntegrityConfig(**(integrity or {})))


def _losses(out: dict) -> list[float]:
    return [r["loss"] for r in out["rows"]]


def test_rerun_of_a_step_with_dropout_reproduces_its_loss_and_the_clean_run():
    """The grads of step 7 are corrupted once; the held steps after it draw dropout masks, so
    without the RNG put back the rerun and every later step would see other masks."""
    dropout = {"hidden_dropout": 0.1, "attention_dropout": 0.1}
    job = _job(10, model_kw=dropout, integrity=CHECKS)
    out = train_with_hook(0, 1, job, Corruption(iteration=7, ranks=[0], grad_scale=1e3))
    clean = train_with_hook(0, 1, job, None)
    assert [r["iteration"] for r in out["rows"] if r["flags"]] == [8]
    assert out["rows"][7]["rerun"]["verdict"] == "transient"
    assert _losses(out) == _losses(clean)  # bit for bit, the rerun step's own loss included
    assert [r["grad_norm"] for r in out["rows"]] == [r["grad_norm"] for r in clean["rows"]]
    assert _losses(clean) != _losses(train_with_hook(0, 1, _job(10, integrity=CHECKS), None))  # dropout is on


def test_pipeline_ranks_hold_and_rerun_together_with_dropout(cluster):
    """PP2 x DP2: the grads of one rank are corrupted once; every rank holds its updates, reruns
    the step and ends where a clean run ends, bit for bit (ranks: pp_rank x 2 + dp_rank)."""
    dropout = {"hidden_dropout": 0.1, "attention_dropout": 0.1}
    job = make_job(4, 1, 2, iters=9, num_layers=2, log_interval=9, model_kw=dropout)
    job = replace(job, integrity=IntegrityConfig(**CHECKS))
    reports = cluster.run(train_with_hook, 4, job, Corruption(iteration=7, ranks=[3], grad_scale=1e3))
    clean = cluster.run(train_with_hook, 4, job, None)
    for rep, ref in zip(reports, clean):
        # the grad norm is one over the pipeline: rank 3's stage partner (rank 1) sees it differ too
        assert rep["rows"][7]["rerun"]["verdict"] == "transient" and rep["rows"][7]["rerun"]["ranks"] == [1, 3]
        assert _losses(rep) == _losses(ref)
        assert all(torch.equal(a, b) for a, b in zip(rep["params"][-1], ref["params"][-1]))


def test_fp16_rerun_restores_the_loss_scale_the_step_started_with():
    """A dynamic scale that grows every 2 clean steps: the flagged step and the held steps after
    it move the scaler on; the rerun and the steps after it must see the clean run's scales."""
    job = _job(10, integrity=CHECKS, fp16=True, initial_loss_scale=2.0**10, loss_scale_window=2)
    out = train_with_hook(0, 1, job, Corruption(iteration=6, ranks=[0], grad_scale=1e3))
    clean = train_with_hook(0, 1, job, None)
    assert out["rows"][6]["rerun"]["verdict"] == "transient"
    scales = [r["loss_scale"] for r in out["rows"]]
    assert scales == [r["loss_scale"] for r in clean["rows"]] and len(set(scales)) > 3
    assert _losses(out) == _losses(clean)


def test_report_stats_reports_the_spread_of_a_nondeterministic_perturbation():
    job = _job(6, integrity={"rerun_mode": "report_stats", "rerun_stats_interval": 3})
    out = train_with_hook(0, 1, job, Corruption(iteration=2, ranks=[0], loss_add=1e-3, grad_scale=1.01))
    perturbed, quiet = out["rows"][2]["rerun"], out["rows"][5]["rerun"]
    assert abs(perturbed["loss_delta"] - 1e-3) < 1e-5 and perturbed["grad_norm_delta"] > 0
    assert perturbed["ranks"] == [0] and quiet["loss_delta"] == quiet["grad_norm_delta"] == 0.0
    assert _losses(out) == _losses(train_with_hook(0, 1, job, None))  # the second execution is applied


def _tensors(obj):
    if torch.is_tensor(obj):
        yield obj
    elif is_dataclass(obj):
        for f in fields(obj):
            yield from _tensors(getattr(obj, f.name))
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _replay_point_of_one_step(hidden: int):
    torch.set_num_threads(1)
    job = _job(3, model_kw={"hidden_size": hidden}, integrity=CHECKS)
    trainer = Trainer(job, single_process_groups(), torch.device("cpu"), RandomTokenBatches(job, 0))
    return trainer._run_step().check.replay, [p for c in trainer.chunks for p in c.parameters()]


def test_validation_keeps_no_copy_of_params_or_optimizer_state():
    small, params = _replay_point_of_one_step(32)
    large, _ = _replay_point_of_one_step(128)
    shapes = {tuple(p.shape) for p in params}
    held = list(_tensors(small))
    assert not [t.shape for t in held if t.is_floating_point() and tuple(t.shape) in shapes]
    size = sum(t.numel() * t.element_size() for t in held)
    assert size == sum(t.numel() * t.element_size() for t in _tensors(large)) < 64 * 1024  # not the model's size


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_checks_before_the_update_read_nothing_on_the_host():
    cfg = IntegrityConfig(**CHECKS, check_min_history=2)
    bands = DeviceBands(cfg, torch.device("cpu"))
    codes = []
    with _RecordOps() as rec:
        for loss, norm in ((2.0, 1.0), (2.1, 1.1), (1.9, 0.9), (50.0, 1.0), (2.0, 1e4), (float("nan"), 1.0)):
            codes.append(bands.flag_and_accept(torch.tensor([[loss, norm]]), dp_size=1))
    assert not {"_local_scalar_dense", "item", "is_nonzero"} & set(rec.ops), sorted(set(rec.ops))
    assert [int(c) for c in codes] == [0, 0, 0, 2, 4, 1]  # spiky loss, large grads, non-finite


def test_validated_steps_read_nothing_on_the_host_between_log_intervals(monkeypatch):
    """With the fused update (the GPU's path, here on the CPU) a validated step, its checks
    included, neither reads a tensor's value on the host nor copies one off the device."""
    from megatronapp.engine.mixed_precision import MixedPrecisionOptimizer

    torch.set_num_threads(1)
    job = _job(6, integrity=CHECKS)
    trainer = Trainer(job, single_process_groups(), torch.device("cpu"), RandomTokenBatches(job, 0))
    trainer.optimizer = MixedPrecisionOptimizer(
        trainer.reducer, job.optimizer, job.precision, trainer.groups, torch.device("cpu"), fused=True
    )
    trainer.runtime.grad_scale_func = trainer.optimizer.scale_loss
    trainer._run_step()  # the first step builds the device bands
    reads = []
    for name in ("item", "tolist", "cpu", "__bool__", "__float__", "__int__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda t, *a, _n=name, _f=original, **k: reads.append(_n) or _f(t, *a, **k)
        )
    with _RecordOps() as rec:
        steps = [trainer._run_step() for _ in range(3)]
    monkeypatch.undo()
    assert not reads and "_local_scalar_dense" not in rec.ops, (reads, sorted(set(rec.ops)))
    assert all(st.check is not None and st.flags is None for st in steps)  # judged at the interval


def test_device_bands_flag_what_the_host_rules_flag():
    """DeviceBands (the checks before the update) against integrity.StepHistory.judge (the log
    interval's checks) over noisy series with spikes, NaNs and a window that wraps around."""
    gen = torch.Generator().manual_seed(0)
    cfg = IntegrityConfig(**CHECKS, check_window=6, check_min_history=3, spiky_loss_factor=3.0, large_grads_factor=3.0)
    bands, history = DeviceBands(cfg, torch.device("cpu")), StepHistory.build(cfg.check_window)
    flagged = 0
    for step in range(60):
        loss = 3.0 - 0.01 * step + 0.05 * float(torch.randn((), generator=gen))
        norm = 1.0 + 0.1 * float(torch.rand((), generator=gen))
        if step % 7 == 6:
            loss, norm = (loss * 3, norm) if step % 2 else (loss, norm * 20)
        if step == 40:
            loss = float("nan")
        values = torch.tensor([[loss, norm]], dtype=torch.float32)
        code = bands.flag_and_accept(values, dp_size=1)
        loss32, norm32 = values[0].tolist()
        expected = history.judge(loss32, norm32, cfg)
        assert decode_flags(float(code)) == expected, (step, expected)
        flagged += bool(expected)
    assert flagged >= 8


def test_rerun_verdict_compares_a_difference_with_the_spread_unless_deterministic():
    assert compute_rerun_verdict([]) == "reproducible"
    assert compute_rerun_verdict([0], deterministic=True, difference=(0.0, 1e-9), spread=(1.0, 1.0)) == "transient"
    within = compute_rerun_verdict([0], deterministic=False, difference=(1e-4, 1e-3), spread=(2e-4, 1e-3))
    beyond = compute_rerun_verdict([0], deterministic=False, difference=(1e-4, 5.0), spread=(2e-4, 1e-3))
    assert (within, beyond) == ("reproducible", "transient")
    assert compute_rerun_verdict([1], deterministic=False) == "transient"  # no spread measured


def test_rerun_mode_with_forward_backward_disaggregation_is_refused_before_launch(train_before_launch):
    code, lines = train_before_launch(
        ["--nproc-per-node", "2", "--forward-backward-disaggregating", "--rerun-mode", "validate_results"]
    )
    assert code == 2 and len(lines) == 1 and "--rerun-mode validate_results executes a step again" in lines[0], lines
