"""Validation and test loss: forward-only through every pipeline layout and schedule, the same
numbers as one process, and no trace left on training."""

from __future__ import annotations

import math

import pytest
import torch
from eval_jobs import HeldOutTokenBatches, build_trainer, make_eval_job, train_and_evaluate, train_with_and_without_eval

from megatronapp.config import ConfigError, EvalConfig
from megatronapp.data.eval_data import RestartableBatches, build_held_out_synthetic_dataset
from megatronapp.data.tokenizer import ByteTokenizer
from megatronapp.engine.evaluation import PPL_LOSS_CAP, compute_ppl
from megatronapp.pipeline.actions import ActionKind
from megatronapp.pipeline.forward_only import build_forward_only_schedule

LAYOUTS = {
    # name: (world, tp, pp, vpp, schedule)
    "tp2_pp2_vpp2_interleaved": (4, 2, 2, 2, "interleaved"),
    "dp2": (2, 1, 1, 1, "1f1b"),
    "pp2_dp2_vpp2_dynamic": (4, 1, 2, 2, "dynamic"),
    "tp2_pp2_vpp2_interleaved_zb": (4, 2, 2, 2, "interleaved-zb"),
    "pp2_zb_h1": (2, 1, 2, 1, "zb-h1"),
}


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    return train_and_evaluate(0, 1, make_eval_job(1))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_validation_loss_matches_single_process(cluster, reference, name):
    world, tp, pp, vpp, schedule = LAYOUTS[name]
    job = make_eval_job(world, tp, pp, vpp, schedule)
    reports = cluster.run(train_and_evaluate, world, job, schedule == "dynamic")
    assert len(reference["valid"]) == job.train.train_iters
    assert reference["valid"][0] != reference["valid"][1]  # the model moved between evaluations
    for rep in reports:  # every rank knows the numbers
        torch.testing.assert_close(rep["valid"], reference["valid"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rep["test"], reference["test"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rep["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
        assert all(rep["training_mode"])  # back in train mode


def test_training_is_bitwise_the_same_with_evaluation_in_a_pipeline(cluster):
    job = make_eval_job(4, 2, 2, 2, "interleaved", iters=3, model_kw=dict(hidden_dropout=0.1, attention_dropout=0.1))
    for rep in cluster.run(train_with_and_without_eval, 4, job):
        assert rep["with"]["losses"] == rep["without"]["losses"]
        for name, p in rep["with"]["params"].items():
            assert torch.equal(p, rep["without"]["params"][name]), name


def test_training_is_bitwise_the_same_with_evaluation_under_overlapped_param_gather(cluster):
    """The distributed optimizer's all-gathers overlap the next forward: an evaluation between
    steps (which completes them first) changes nothing in training."""
    job = make_eval_job(2, iters=3, use_distributed_optimizer=True, overlap_param_gather=True)
    for rep in cluster.run(train_with_and_without_eval, 2, job):
        assert rep["with"]["losses"] == rep["without"]["losses"]
        assert len(rep["with"]["valid"]) == 3
        for name, p in rep["with"]["params"].items():
            assert torch.equal(p, rep["without"]["params"][name]), name


def test_training_is_bitwise_the_same_with_evaluation_and_dropout():
    torch.set_num_threads(1)
    job = make_eval_job(1, iters=4, model_kw=dict(hidden_dropout=0.1, attention_dropout=0.1))
    rep = train_with_and_without_eval(0, 1, job)
    assert rep["with"]["losses"] == rep["without"]["losses"]
    assert len(rep["with"]["valid"]) == 4
    for name, p in rep["with"]["params"].items():
        assert torch.equal(p, rep["without"]["params"][name]), name


def test_evaluation_runs_with_dropout_off_and_restores_train_mode():
    torch.set_num_threads(1)
    job = make_eval_job(1, model_kw=dict(hidden_dropout=0.3, attention_dropout=0.3))
    trainer = build_trainer(0, 1, job)
    stream = HeldOutTokenBatches(job, 0)
    first, second = trainer.evaluate("valid", stream), trainer.evaluate("valid", stream)
    assert first.loss == second.loss  # no dropout draws: the same samples give the same number
    assert all(c.training for c in trainer.chunks)
    with torch.no_grad():  # the mean per-token loss of the stream's batches, computed directly
        for c in trainer.chunks:
            c.eval()
        losses = [trainer.chunks[0](mb[:, :-1], mb[:, 1:]).mean() for b in stream(2) for mb in b]
    assert first.loss == pytest.approx(torch.stack(losses).mean().item(), rel=1e-6)
    assert first.ppl == pytest.approx(math.exp(first.loss))
    assert not any(p.grad is not None and p.grad.abs().sum() > 0 for c in trainer.chunks for p in c.parameters())


def test_forward_only_schedule_runs_every_forward_once_and_no_backward():
    s = build_forward_only_schedule(pp_size=2, num_chunks=2, num_microbatches=4)
    for rank in range(2):
        compute = [(a.kind, a.chunk, a.microbatch) for a in s.for_rank(rank) if not a.kind.is_comm]
        assert sorted(compute) == [(ActionKind.FORWARD, c, m) for c in range(2) for m in range(4)]
    sends = sum(a.kind is ActionKind.SEND_FORWARD for r in range(2) for a in s.for_rank(r))
    recvs = sum(a.kind is ActionKind.RECV_FORWARD for r in range(2) for a in s.for_rank(r))
    assert sends == recvs == 3 * 4  # every virtual-stage boundary, every microbatch


def test_held_out_streams_restart_and_differ_from_training_text():
    from megatronapp.data.dataset import build_default_dataset

    tok = ByteTokenizer()
    train = build_default_dataset(tok, 16, 1234, num_tokens=4096)
    valid = build_held_out_synthetic_dataset(tok, 16, 1234, "valid", 8)
    test = build_held_out_synthetic_dataset(tok, 16, 1234, "test", 8)
    assert len(valid) == 8
    assert not torch.equal(torch.from_numpy(valid.get_samples([0, 1])), torch.from_numpy(train.get_samples([0, 1])))
    assert not torch.equal(torch.from_numpy(valid.get_samples([0, 1])), torch.from_numpy(test.get_samples([0, 1])))
    stream = RestartableBatches(valid, micro_batch_size=2, global_batch_size=4, dp_rank=1, dp_size=2, seed=1)
    a, b = list(stream(2)), list(stream(2))
    assert [torch.equal(x, y) for bx, by in zip(a, b) for x, y in zip(bx, by)] == [True] * 2
    with pytest.raises(ValueError, match="unknown evaluation split"):
        build_held_out_synthetic_dataset(tok, 16, 1234, "train", 8)


def test_perplexity_is_capped_as_megatron():
    assert compute_ppl(1.0) == pytest.approx(math.e)
    assert compute_ppl(1e6) == math.exp(PPL_LOSS_CAP)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(eval_interval=0), "eval_interval must be >= 1, got 0"),
        (dict(eval_interval=5, eval_iters=0), "eval_iters must be >= 1, got 0"),
    ],
)
def test_eval_config_refuses_bad_values(fields, message):
    with pytest.raises(ConfigError, match=message):
        EvalConfig(**fields)


def test_evaluation_time_is_left_out_of_step_times():
    torch.set_num_threads(1)
    from megatronapp.job import replace_fields

    job = replace_fields(make_eval_job(1, iters=4), log_interval=2)  # evaluations inside log intervals too
    trainer = build_trainer(0, 1, job)
    now, run_step = [0.0], trainer._run_step
    trainer.clock = lambda: now[0]

    def one_second_step():
        now[0] += 1.0
        return run_step()

    def slow_evaluation(iteration):
        now[0] += 100.0

    trainer._run_step = one_second_step
    history = trainer.train(on_eval=slow_evaluation)
    assert [m.step_time_s for m in history] == [1.0] * 4


def test_evaluation_leaves_the_delayed_fp8_state_as_it_found_it():
    """The evaluation's forwards record amaxes too; they are put back, so the next step casts with
    the scales it would have used (and training is bitwise the same with evaluation)."""
    torch.set_num_threads(1)
    fp8 = dict(
        bf16=True, fp8_format="hybrid", fp8_recipe="delayed", fp8_amax_history_len=2, fp8_amax_compute_algo="max"
    )
    job = make_eval_job(1, iters=3, **fp8)
    trainer = build_trainer(0, 1, job)
    trainer.train_step()
    state = lambda: [t.clone() for s in trainer.fp8_states.values() for t in (s.amax_step, s.scale, s.history)]
    before = state()
    assert before
    trainer.evaluate("valid", HeldOutTokenBatches(job, 0))
    assert all(torch.equal(a, b) for a, b in zip(state(), before))
    rep = train_with_and_without_eval(0, 1, job)
    assert rep["with"]["losses"] == rep["without"]["losses"]
