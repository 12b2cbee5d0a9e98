"""Split backward (I then W, parallel/wgrad_defer.py): the same losses and gradients as the
whole backward, for every parallel layout, with recompute, bf16 and across a checkpoint resume.

The zero-bubble schedules run each chunk's W's in the order of its I's, so the fp32 sums are
added in the same order as the whole backward's: the results must be bit-identical."""

from __future__ import annotations

import pytest
import torch
from engine_jobs import RandomTokenBatches, make_job

from megatronapp.engine.checkpoint import load_checkpoint, save_checkpoint
from megatronapp.engine.trainer import Trainer
from megatronapp.parallel import wgrad_defer
from megatronapp.parallel.groups import build_process_groups, single_process_groups


def _train(rank: int, job, steps: int) -> dict:
    groups = build_process_groups(job.layout, rank) if job.layout.world_size > 1 else single_process_groups()
    trainer = Trainer(job, groups, torch.device("cpu"), RandomTokenBatches(job, groups.dp_rank))
    return _report(trainer, steps)


def _report(trainer: Trainer, steps: int) -> dict:
    metrics = [trainer.train_step() for _ in range(steps)]
    queue = trainer.runtime.stage.wgrad_queue
    return {
        "losses": [m.loss for m in metrics],
        "norms": [m.grad_norm for m in metrics],
        "main_grads": {n: p.main_grad.clone() for c in trainer.chunks for n, p in c.named_parameters()},
        "params": {n: p.detach().clone() for c in trainer.chunks for n, p in c.named_parameters()},
        "peak_w_bytes": None if queue is None else queue.peak_bytes,
    }


def train_pair(rank: int, world: int, whole, split, steps: int = 2) -> tuple[dict, dict]:
    return _train(rank, whole, steps), _train(rank, split, steps)


def _assert_same(whole: dict, split: dict, exact: bool = True) -> None:
    assert whole["main_grads"].keys() == split["main_grads"].keys()
    check = (
        (lambda a, b, msg: torch.testing.assert_close(a, b, rtol=0, atol=0, msg=msg))
        if exact
        else (lambda a, b, msg: torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=msg))
    )
    for kind in ("main_grads", "params"):
        for name, g in whole[kind].items():
            check(split[kind][name], g, f"{kind} {name}")
    assert split["losses"] == whole["losses"] if exact else split["losses"] == pytest.approx(whole["losses"])
    assert split["peak_w_bytes"] > 0  # W really held operands: the split path ran


CASES = {
    # name: (world, tp, pp, vpp, whole schedule, split schedule, extra train kwargs)
    "pp2": (2, 1, 2, 1, "1f1b", "zb-h1", {}),
    "pp4_vpp2": (4, 1, 4, 2, "interleaved", "interleaved-zb", {}),
    "tp2_pp2_sp": (4, 2, 2, 1, "1f1b", "zb-h1", {"sequence_parallel": True}),
    "dp2_pp2": (4, 1, 2, 1, "1f1b", "zb-h1", {}),
    "pp2_recompute": (2, 1, 2, 1, "1f1b", "zb-h1", {"recompute_granularity": "full"}),
    "pp2_dp2_distopt": (4, 1, 2, 1, "1f1b", "zb-h1", {"use_distributed_optimizer": True}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_split_backward_matches_whole_backward(cluster, name):
    world, tp, pp, vpp, whole_name, split_name, kw = CASES[name]
    layers = 8 if vpp > 1 else 4
    whole = make_job(world, tp, pp, vpp, whole_name, num_layers=layers, **kw)
    split = make_job(world, tp, pp, vpp, split_name, num_layers=layers, **kw)
    for whole_rep, split_rep in cluster.run(train_pair, world, whole, split):
        _assert_same(whole_rep, split_rep)


def test_split_backward_in_one_process_bf16():
    # PP1: each B runs as I then W at once (--split-backward); bf16 with fused accumulation
    torch.set_num_threads(1)
    kw = dict(bf16=True, lr_warmup_iters=0)
    whole = _train(0, make_job(1, **kw), 2)
    split = _train(0, make_job(1, split_backward=True, **kw), 2)
    _assert_same(whole, split)


def test_dropped_weight_gemm_is_caught(monkeypatch):
    # the comparison above can fail: a W that loses one linear's GEMM changes its main grad
    torch.set_num_threads(1)
    whole = _train(0, make_job(1), 1)
    run = wgrad_defer.WeightGradQueue.run

    def run_dropping_one(self, chunk, microbatch):
        self._pending[(chunk, microbatch)].pop()
        return run(self, chunk, microbatch)

    monkeypatch.setattr(wgrad_defer.WeightGradQueue, "run", run_dropping_one)
    split = _train(0, make_job(1, split_backward=True), 1)
    with pytest.raises(AssertionError):
        _assert_same(whole, split)


def train_save_resume_split(rank: int, world: int, whole, split, save_dir: str) -> tuple[dict, dict]:
    """3 steps of the whole backward vs 2 split steps + save + a fresh split trainer's 1 step."""
    straight = _train(rank, whole, 3)
    groups = build_process_groups(split.layout, rank)
    data = RandomTokenBatches(split, groups.dp_rank)
    first = Trainer(split, groups, torch.device("cpu"), data)
    head = [first.train_step().loss for _ in range(2)]
    save_checkpoint(save_dir, first, data)
    data = RandomTokenBatches(split, groups.dp_rank)
    resumed = Trainer(split, groups, torch.device("cpu"), data)
    load_checkpoint(save_dir, resumed, data)
    tail = _report(resumed, 1)
    tail["losses"] = head + tail["losses"]
    tail["norms"] = straight["norms"]  # only the resumed step's are compared, through grads/params
    return straight, tail


def test_split_backward_resumes_from_checkpoint(cluster, tmp_path):
    whole = make_job(2, 1, 2, 1, "1f1b")
    split = make_job(2, 1, 2, 1, "zb-h1")
    for straight, resumed in cluster.run(train_save_resume_split, 2, whole, split, str(tmp_path)):
        _assert_same(straight, resumed)


def launched_before_finish(rank: int, world: int, job) -> tuple[int, int]:
    """(buckets whose DP reduction started during the step, all buckets) of one split step."""
    groups = build_process_groups(job.layout, rank)
    trainer = Trainer(job, groups, torch.device("cpu"), RandomTokenBatches(job, groups.dp_rank))
    finish, seen = trainer.reducer.finish, []

    def counting_finish():
        seen.append(sum(b.work is not None for buf in trainer.reducer.buffers for b in buf.buckets))
        finish()

    trainer.reducer.finish = counting_finish
    trainer.train_step()
    return seen[0], sum(len(buf.buckets) for buf in trainer.reducer.buffers)


def test_dp_reduction_of_a_bucket_starts_at_its_last_w(cluster):
    # every bucket holds linear weights (bucket 0.01 MiB), which only W accumulates: without W
    # reporting them to the reducer no bucket would start before the step's end
    job = make_job(4, 1, 2, 1, "zb-h1")
    for launched, total in cluster.run(launched_before_finish, 4, job):
        assert total > 1 and launched == total


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [None, "hybrid"])
def test_split_backward_on_cuda_matches_whole_backward(fp8):
    # the CUDA paths: bf16 fused accumulation (addmm out_dtype fp32) and FP8's deferred _scaled_mm
    kw = dict(bf16=True, fp8_format=fp8)
    dev = torch.device("cuda")
    runs = []
    for split in (False, True):
        job = make_job(1, split_backward=split, **kw)
        trainer = Trainer(job, single_process_groups(), dev, RandomTokenBatches(job, 0))
        runs.append(_report(trainer, 2))
    for name, g in runs[0]["main_grads"].items():
        torch.testing.assert_close(runs[1]["main_grads"][name], g, rtol=0, atol=0, msg=name)
    assert runs[1]["losses"] == runs[0]["losses"] and runs[1]["peak_w_bytes"] > 0
