"""The static runtime's transports (pipeline/transport.py): receives posted ahead in the
schedule's order within a bounded window (p2p/receives.py), and the same gradients as the
schedule's batches and as one process."""

from __future__ import annotations

import pytest
import torch
from engine_jobs import RandomTokenBatches, make_job

from megatronapp.cli.devices import check_job_devices
from megatronapp.config import ConfigError
from megatronapp.engine.trainer import Trainer
from megatronapp.p2p.receives import RECV_AHEAD, PostedReceives
from megatronapp.parallel.groups import build_process_groups
from megatronapp.pipeline.transport import resolve_recv_ahead


def _recording(order, ahead):
    posts = []
    receives = PostedReceives(order, lambda key: posts.append(key) or f"buffer-{key}", ahead)
    return receives, posts


def test_receives_are_posted_in_order_and_the_window_is_refilled_on_each_take():
    receives, posts = _recording(range(6), ahead=2)
    receives.start()
    assert posts == [0, 1]
    assert receives.take(0) == "buffer-0"
    assert posts == [0, 1, 2]  # the slot freed by 0 is filled before 0's message is waited for
    assert receives.take(1) == "buffer-1" and posts == [0, 1, 2, 3]
    for key in (2, 3, 4, 5):
        receives.take(key)
    assert posts == list(range(6)) and receives.pending == 0 and receives.peak_posted == 2


def test_the_schedule_position_of_a_receive_posts_it_even_past_the_window():
    receives, posts = _recording("abcdef", ahead=1)
    receives.start()
    receives.ensure_posted("d")  # the schedule's RECV of d: everything up to d goes out now
    assert posts == list("abcd") and receives.peak_posted == 4
    receives.ensure_posted("b")  # already posted: nothing more
    assert posts == list("abcd")
    assert receives.take("a") == "buffer-a" and posts == list("abcd")  # 3 still posted: window full
    assert receives.pending == 5


def test_a_bad_window_or_duplicate_receives_are_refused():
    with pytest.raises(ValueError, match=">= 1"):
        PostedReceives([1, 2], lambda key: key, ahead=0)
    with pytest.raises(ValueError, match="its own key"):
        PostedReceives([1, 1], lambda key: key)


def test_receives_go_ahead_when_asked_and_only_on_the_cpu():
    assert resolve_recv_ahead(True, "cpu") and not resolve_recv_ahead(False, "cpu")
    assert not resolve_recv_ahead(False, "cuda")
    with pytest.raises(ValueError, match="NCCL"):
        resolve_recv_ahead(True, "cuda")


def _grads_and_peaks(rank: int, world: int, schedule: str, vpp: int, m: int) -> list:
    out = []
    for recv_ahead in (True, False):
        job = make_job(world, 1, world, vpp, schedule, global_batch=m, iters=1, num_layers=4)
        groups = build_process_groups(job.layout, rank)
        trainer = Trainer(job, groups, torch.device("cpu"), RandomTokenBatches(job, 0))
        trainer.runtime.recv_ahead = recv_ahead  # False: the schedule's batches, as on NCCL
        # PP2 also through the sender thread that a host with a spare core per rank uses
        trainer.runtime.send_thread = recv_ahead and world == 2
        trainer.train_step()
        grads = {n: p.grad.clone() for c in trainer.chunks for n, p in c.named_parameters()}
        out.append((grads, trainer.runtime.peak_recvs_posted))
    return out


@pytest.mark.parametrize(("pp", "schedule", "vpp"), [(2, "interleaved", 2), (2, "interleaved-zb", 2), (4, "1f1b", 1)])
def test_receives_ahead_give_the_batched_and_single_process_gradients(cluster, pp, schedule, vpp):
    m = 4
    per_rank = cluster.run(_grads_and_peaks, pp, schedule, vpp, m)
    torch.set_num_threads(1)
    ref = _grads_and_peaks(0, 1, "1f1b", 1, m)[0][0]
    ahead, batched = {}, {}
    for rank_result in per_rank:
        ahead.update(rank_result[0][0])
        batched.update(rank_result[1][0])
        # the window is used: more receives in flight than any of the schedule's batches holds
        assert rank_result[0][1] == RECV_AHEAD and rank_result[1][1] <= 2
    assert ahead.keys() == ref.keys() == batched.keys()
    for name, g in ahead.items():
        assert torch.equal(g, batched[name]), name  # same messages, same order of compute: bitwise
        torch.testing.assert_close(g, ref[name], rtol=1e-4, atol=1e-6, msg=lambda msg: f"{name}: {msg}")


def test_receives_ahead_on_a_gpu_job_are_refused_before_launch():
    job = make_job(1, pipeline_recv_ahead=True)
    check_job_devices(job, 1, "cpu", None, visible_gpus=0, ranks_per_node=None)
    with pytest.raises(ConfigError, match="--pipeline-recv-ahead needs the CPU"):
        check_job_devices(job, 1, "cuda", None, visible_gpus=1, ranks_per_node=None)
