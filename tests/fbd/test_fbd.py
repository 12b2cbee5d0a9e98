"""MegaFBD trains exactly what the same layout trains without it (fp32, CPU, gloo).

Every case runs the plain engine and FBD on the same cluster from the same seed and compares
per-iteration losses, grad norms and the first step's full gradients: bit-identical where
forward workers use the backward workers' TP degree, tight tolerance otherwise (a different
TP degree sums partial products in another order).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_jobs import assemble_full_grads, make_job, train_and_report
from fbd_jobs import fbd_losses, fbd_train_and_report, plain_losses

from megatronapp.fbd.config import FbdConfig, FbdInjection

CASES = {
    # name: (backward world, tp, pp, tf, dropout: None | "hidden" | "both" (hidden and attention))
    "pp2_tf1": (2, 1, 2, 1, None),
    "tp2_pp2_tf1": (4, 2, 2, 1, None),
    "dp2_pp2": (4, 1, 2, 1, None),  # world 8
    "pp2_hidden_and_attention_dropout": (2, 1, 2, 1, "both"),  # TF = TP: the same tracked streams
    "tp2_tf1_hidden_dropout": (2, 2, 1, 1, "hidden"),
    "dp2_distributed_optimizer": (2, 1, 1, 1, None),  # weights published from gathered shards
    # sequence parallelism on the backward workers: TF1 hands each TP rank its sequence slice
    "tp2_pp2_sp_tf1": (4, 2, 2, 1, "hidden"),
    "tp2_pp2_sp_tf2": (4, 2, 2, 2, None),  # TF = TP: forward workers are sequence-parallel too
    "pp2_bf16": (2, 1, 2, 1, None),  # bf16 params: weights published in bf16, activations sent in bf16
}


def _job(backward_world, tp, pp, dropout, iters=3, **train_kw):
    job = make_job(backward_world, tp, pp, iters=iters, **train_kw)
    if dropout:
        attention = 0.1 if dropout == "both" else 0.0
        job = dataclasses.replace(
            job, model=dataclasses.replace(job.model, hidden_dropout=0.2, attention_dropout=attention)
        )
    return job


def _world(job, tf):
    lay = job.layout
    return (lay.tp_size + tf) * lay.pp_size * lay.dp_size


@pytest.mark.parametrize("name", list(CASES))
def test_fbd_trains_the_same_numbers_as_the_plain_engine(cluster, name):
    backward_world, tp, pp, tf, dropout = CASES[name]
    job = _job(
        backward_world,
        tp,
        pp,
        dropout,
        use_distributed_optimizer="distributed_optimizer" in name,
        sequence_parallel="_sp" in name,
        bf16="bf16" in name,
    )
    plain = cluster.run(train_and_report, backward_world, job)
    reports = cluster.run(fbd_train_and_report, _world(job, tf), job, FbdConfig(forward_tp_size=tf, max_ahead=2))
    backward = [r for r in reports if r["role"] == "backward"]
    assert len(backward) == backward_world
    exact = tf == tp
    ref_grads, grads = assemble_full_grads(plain), assemble_full_grads(backward)
    assert grads.keys() == ref_grads.keys()
    for rep in backward:
        if exact:
            assert rep["losses"] == plain[0]["losses"] and rep["norms"] == plain[0]["norms"]
        else:
            torch.testing.assert_close(rep["losses"], plain[0]["losses"], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(rep["norms"], plain[0]["norms"], rtol=1e-5, atol=1e-6)
    for key, g in grads.items():
        if exact:
            assert torch.equal(g, ref_grads[key]), key
        else:
            torch.testing.assert_close(g, ref_grads[key], rtol=1e-4, atol=1e-7, msg=lambda m: f"{key}: {m}")
    assert abs(plain[0]["losses"][-1] - plain[0]["losses"][0]) > 1e-3  # training moved
    # the forward workers' own losses agree with the recomputed ones (exactly where TF = TP)
    gaps = [r["loss_gap"] for r in backward]
    assert max(gaps) == 0.0 if exact else max(gaps) < 1e-4


def test_dropout_masks_are_really_on(cluster):
    """Guard for the dropout cases above: with dropout the losses differ from without."""
    hidden = cluster.run(plain_losses, 2, _job(2, 1, 2, "hidden"), 1)[0]
    both = cluster.run(plain_losses, 2, _job(2, 1, 2, "both"), 1)[0]
    without = cluster.run(plain_losses, 2, _job(2, 1, 2, None), 1)[0]
    assert hidden != without and both != hidden  # each kind of mask changes the numbers


@pytest.mark.parametrize(
    "seed, ahead, roles",
    [
        (1, 1, ("forward", "backward")),
        (2, 2, ("forward", "backward")),
        (3, 3, ("forward", "backward")),
        (4, 1, ("forward",)),
        (5, 2, ("forward",)),
        (6, 1, ("backward",)),
        (7, 4, ("backward",)),
    ],
)
def test_random_delays_in_either_role_never_deadlock(cluster, seed, ahead, roles):
    """Seeded random sleeps before the compute actions of one or both roles shuffle the
    arrival order of messages; the job must finish (hard timeout) with the undisturbed numbers."""
    job = _job(2, 1, 2, None, iters=2)
    job = dataclasses.replace(job, train=dataclasses.replace(job.train, global_batch_size=6))
    fbd = FbdConfig(max_ahead=ahead)
    delays = FbdInjection(random_delay_ms=15.0, delay_seed=seed, delayed_roles=roles)
    delayed = cluster.run(fbd_losses, 4, job, fbd, 2, None, None, delays, timeout=120)
    assert delayed[0] == cluster.run(plain_losses, 2, job, 2)[0]


def test_resume_from_an_fbd_checkpoint_and_load_it_without_fbd(cluster, tmp_path):
    job = _job(2, 1, 2, "hidden", iters=4)
    fbd = FbdConfig(max_ahead=2)
    straight = cluster.run(fbd_losses, 4, job, fbd, 4)[0]
    head = cluster.run(fbd_losses, 4, job, fbd, 2, str(tmp_path))[0]
    tail = cluster.run(fbd_losses, 4, job, fbd, 2, None, str(tmp_path))[0]
    assert head + tail == straight  # bit-exact resume under FBD
    plain_tail = cluster.run(plain_losses, 2, job, 2, str(tmp_path))[0]
    assert plain_tail == straight[2:]  # the same checkpoint continues identically without FBD
    one = _job(1, 1, 1, "hidden", iters=4)  # and in another layout (one process)
    torch.set_num_threads(1)
    single = plain_losses(0, 1, one, 1, str(tmp_path))
    assert single[0] == pytest.approx(straight[2], rel=1e-5)


def test_resume_with_attention_dropout_restores_the_forward_workers_streams(cluster, tmp_path):
    """Attention dropout draws from per-(tp, pp) streams that forward workers replay in step
    with their twins; a resumed forward worker takes its twin's saved stream state."""
    job = _job(2, 1, 2, "both", iters=4)
    fbd = FbdConfig(max_ahead=1)
    straight = cluster.run(fbd_losses, 4, job, fbd, 4)[0]
    head = cluster.run(fbd_losses, 4, job, fbd, 2, str(tmp_path))[0]
    tail = cluster.run(fbd_losses, 4, job, fbd, 2, None, str(tmp_path))[0]
    assert head + tail == straight
