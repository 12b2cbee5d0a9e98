"""Keyed dropout masks are a pure function of global coordinates; tracked RNG streams fork."""

from __future__ import annotations

import torch

from megatronapp.config import RecomputeConfig
from megatronapp.model.recompute import compute_full_recompute_groups
from megatronapp.parallel.random import DropoutKey, build_rng_tracker, keyed_dropout, keyed_uniform


def test_keyed_mask_slices_match_the_full_mask():
    full = keyed_uniform(DropoutKey(7, 3, 0), 2, "mlp", (4, 8, 16), "cpu")
    samples = keyed_uniform(DropoutKey(7, 3, 2), 2, "mlp", (2, 8, 16), "cpu")  # a later microbatch
    shard = keyed_uniform(DropoutKey(7, 3, 0, position_offset=4), 2, "mlp", (4, 4, 16), "cpu")  # an SP shard
    assert torch.equal(samples, full[2:])
    assert torch.equal(shard, full[:, 4:])


def test_keyed_mask_depends_on_every_key_field():
    base = keyed_uniform(DropoutKey(7, 3, 0), 2, "mlp", (2, 8, 16), "cpu")
    for other in (
        keyed_uniform(DropoutKey(8, 3, 0), 2, "mlp", (2, 8, 16), "cpu"),
        keyed_uniform(DropoutKey(7, 4, 0), 2, "mlp", (2, 8, 16), "cpu"),
        keyed_uniform(DropoutKey(7, 3, 0), 3, "mlp", (2, 8, 16), "cpu"),
        keyed_uniform(DropoutKey(7, 3, 0), 2, "attention", (2, 8, 16), "cpu"),
    ):
        assert (other != base).float().mean() > 0.9


def test_keyed_dropout_rate_and_scale():
    x = torch.ones(8, 64, 64)
    y = keyed_dropout(x, 0.25, DropoutKey(1, 0, 0), 0, "mlp")
    kept = (y != 0).float().mean().item()
    assert abs(kept - 0.75) < 0.01
    assert torch.allclose(y[y != 0], torch.full_like(y[y != 0], 1 / 0.75))
    assert keyed_dropout(x, 0.25, None, 0, "mlp") is x  # evaluation: no key, no dropout


def test_tracker_fork_is_isolated_and_replayable():
    torch.manual_seed(0)
    tracker = build_rng_tracker(5, tp_rank=0, pp_rank=0, device="cpu")
    before = torch.get_rng_state()
    snapshot = tracker.get_states()
    with tracker.fork():
        a = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream did not move
    with tracker.fork():
        b = torch.rand(4)
    assert not torch.equal(a, b)  # the stream advanced
    tracker.set_states(snapshot)
    with tracker.fork():
        assert torch.equal(torch.rand(4), a)
    other_rank = build_rng_tracker(5, tp_rank=1, pp_rank=0, device="cpu")
    with other_rank.fork():
        assert not torch.equal(torch.rand(4), a)


def test_full_recompute_groups():
    uniform = RecomputeConfig("full", "uniform", 2)
    assert compute_full_recompute_groups(5, uniform) == [(0, 2, True), (2, 4, True), (4, 5, True)]
    block = RecomputeConfig("full", "block", 2)
    assert compute_full_recompute_groups(3, block) == [(0, 1, True), (1, 2, True), (2, 3, False)]
    assert compute_full_recompute_groups(3, RecomputeConfig("selective")) == [(0, 3, False)]
