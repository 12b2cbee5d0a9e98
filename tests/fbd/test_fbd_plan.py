"""MegaFBD's pure parts: role layout, action lists and their validator, weight resharding."""

from __future__ import annotations

import pytest
import torch

from megatronapp.config import model_preset
from megatronapp.fbd.layout import RoleLayout
from megatronapp.fbd.plan import FbdAction, Op, build_fbd_plan
from megatronapp.fbd.reshard import compute_weight_pieces, full_param_specs, pack_weights, unpack_weights
from megatronapp.fbd.validate import PlanError, validate_fbd_plan
from megatronapp.model.gpt import GPTChunk, TPContext
from megatronapp.p2p.message import HEADER_BYTES, split_message
from megatronapp.parallel.layout import LayoutError

SHAPES = [  # (tp, pp, tf, dp)
    (1, 1, 1, 1),
    (1, 2, 1, 1),
    (2, 2, 1, 1),
    (2, 2, 2, 1),
    (1, 2, 1, 2),
    (2, 2, 1, 2),
    (1, 2, 2, 1),
    (4, 2, 2, 2),
    (2, 4, 4, 1),
    (4, 3, 1, 2),
    (8, 2, 4, 2),
]


def _layout(tp, pp, tf, dp) -> RoleLayout:
    return RoleLayout((tp + tf) * pp * dp, tp, pp, tf)


def test_worked_example_of_the_docstring():
    lay = RoleLayout(6, tp_size=2, pp_size=2, forward_tp_size=1)
    roles = [(c.role[0], c.tp, c.pp) for c in map(lay.role_of, range(6))]
    assert roles == [("b", 0, 0), ("b", 1, 0), ("b", 0, 1), ("b", 1, 1), ("f", 0, 0), ("f", 0, 1)]
    assert lay.input_targets(0, 0, 1) == [2, 3] and lay.input_source(1, 0, 1) == 5
    assert lay.weight_sources(0, 0, 0) == [0, 1] and lay.weight_sources(0, 0, 1) == [2, 3]
    assert lay.backward.describe() == "world=4 TP=2 PP=2 VPP=1 DP=1"


@pytest.mark.parametrize("shape", SHAPES)
def test_role_layout_is_a_bijection_with_consistent_links(shape):
    lay = _layout(*shape)
    seen = set()
    for r in range(lay.world_size):
        c = lay.role_of(r)
        seen.add((c.role, c.tp, c.dp, c.pp))
        back = lay.forward_rank(c.tp, c.dp, c.pp) if c.is_forward else lay.backward_rank(c.tp, c.dp, c.pp)
        assert back == r
        if c.is_forward:
            assert lay.weight_sources(c.tp, c.dp, c.pp), "every forward worker gets weights"
            for b in lay.weight_sources(c.tp, c.dp, c.pp):
                bc = lay.role_of(b)
                assert (bc.dp, bc.pp) == (c.dp, c.pp) and r in lay.weight_targets(bc.tp, bc.dp, bc.pp)
        else:
            src = lay.input_source(c.tp, c.dp, c.pp)
            sc = lay.role_of(src)
            assert sc.is_forward and r in lay.input_targets(sc.tp, sc.dp, sc.pp)
    assert len(seen) == lay.world_size
    assert lay.num_backward == shape[0] * shape[1] * shape[3]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(world_size=5, tp_size=1, pp_size=2, forward_tp_size=1), "world size 5 is not a multiple of 4"),
        (dict(world_size=6, tp_size=2, pp_size=2, forward_tp_size=0), "forward_tp_size must be >= 1"),
    ],
)
def test_role_layout_errors_are_one_line(kwargs, message):
    with pytest.raises(LayoutError, match=message) as e:
        RoleLayout(**kwargs)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("microbatches, ahead, log_interval", [(1, 1, 1), (4, 1, 2), (5, 2, 1), (3, 8, 4)])
def test_plans_are_consistent_and_deadlock_free(shape, microbatches, ahead, log_interval):
    validate_fbd_plan(build_fbd_plan(_layout(*shape), microbatches, ahead, range(3), log_interval))


def _mutate(plan, rank, fn):
    plan = dict(plan)
    plan[rank] = fn(list(plan[rank]))
    return plan


def _swap_first(actions, op):
    i, j = [k for k, a in enumerate(actions) if a.op is op][:2]
    actions[i], actions[j] = actions[j], actions[i]
    return actions


def test_validator_rejects_broken_plans():
    lay = RoleLayout(6, 2, 2, 1)  # backward 0-3, forward 4 (stage 0) and 5 (stage 1)
    plan = build_fbd_plan(lay, 4, 2, range(2))
    validate_fbd_plan(plan)
    # stage inputs received out of order: the k-th message does not match
    with pytest.raises(PlanError, match="rank 5, .*FIFO mismatch"):
        validate_fbd_plan(_mutate(plan, 2, lambda a: _swap_first(a, Op.RECV_INPUT)))
    # a forward that runs before the weights it needs arrive
    with pytest.raises(PlanError, match="runs before RW"):
        validate_fbd_plan(_mutate(plan, 4, lambda a: [a[1], a[0]] + a[2:]))  # rank 4: RW, F(m0), ...

    # publishing weights after waiting for the stage inputs they produce: a real deadlock
    def publish_late(actions):
        sw = next(a for a in actions if a.op is Op.SEND_WEIGHTS and a.iteration == 0)
        rest = [a for a in actions if a is not sw]
        k = next(i for i, a in enumerate(rest) if a.op is Op.RECOMPUTE)
        return rest[: k + 1] + [sw] + rest[k + 1 :]

    with pytest.raises(PlanError, match="deadlock"):
        validate_fbd_plan(_mutate(plan, 2, publish_late))
    # one member skips a collective of its group
    with pytest.raises(PlanError, match="collective #"):
        validate_fbd_plan(_mutate(plan, 1, lambda a: [x for x in a if not (x.op is Op.GRAD_NORM and x.iteration == 1)]))


def test_a_send_nobody_receives_is_reported():
    lay = RoleLayout(4, 1, 2, 1)
    plan = build_fbd_plan(lay, 2, 1, range(1))
    extra = FbdAction(Op.SEND_GRAD, 1, 1, peers=(0,))  # an iteration rank 0 never runs
    with pytest.raises(PlanError, match="unmatched"):
        validate_fbd_plan(_mutate(plan, 1, lambda a: a + [extra]))


def _chunks(cfg, tp_size, seed):
    return [GPTChunk(cfg, 0, cfg.num_layers, TPContext(None, tp_size, r), seed) for r in range(tp_size)]


@pytest.mark.parametrize("tp, tf", [(1, 1), (2, 1), (1, 2), (2, 4), (4, 2), (4, 1)])
def test_weights_reshard_from_tp_to_tf_exactly(tp, tf):
    cfg = model_preset("tiny", num_layers=2, seq_length=8)
    trained, stale, expected = _chunks(cfg, tp, seed=7), _chunks(cfg, tf, seed=1), _chunks(cfg, tf, seed=7)
    for chunk in trained + expected:  # biases start at zero: make every element distinct per layout-free value
        for name, p in chunk.named_parameters():
            if p.ndim == 1 and "norm" not in name:
                p.data += 0.5
    specs = full_param_specs(trained[0], tp)
    assert specs == full_param_specs(stale[0], tf)
    for f in range(tf):
        for t in range(tp):
            pieces = compute_weight_pieces(specs, tp, t, tf, f)
            if pieces:
                unpack_weights(stale[f], pieces, pack_weights(trained[t], pieces, 3, "cpu"), 3, source=t)
        for (name, got), want in zip(stale[f].named_parameters(), expected[f].parameters()):
            assert torch.equal(got, want), name


def test_weights_of_another_version_are_refused():
    cfg = model_preset("tiny", num_layers=1, seq_length=8)
    (src,), (dst,) = _chunks(cfg, 1, 7), _chunks(cfg, 1, 1)
    pieces = compute_weight_pieces(full_param_specs(src, 1), 1, 0, 1, 0)
    with pytest.raises(RuntimeError, match="expected weights of version 4 from rank 2, got version 3"):
        unpack_weights(dst, pieces, pack_weights(src, pieces, 3, "cpu"), 4, source=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weight_versions_are_exact_in_half_precision_messages(dtype):
    """Weights travel in the parameters' dtype; the version rides in the message header's int64
    ids, exact whatever the payload dtype (a version above 256 would not survive as one bf16 number)."""
    cfg = model_preset("tiny", num_layers=1, seq_length=8)
    (src,), (dst,) = _chunks(cfg, 1, 7), _chunks(cfg, 1, 1)
    src.to(dtype), dst.to(dtype)
    pieces = compute_weight_pieces(full_param_specs(src, 1), 1, 0, 1, 0)
    message = pack_weights(src, pieces, 70_001, "cpu")
    header, payload = split_message(message, "weights", 7)
    assert payload.dtype == dtype and message.numel() == HEADER_BYTES + payload.numel() * 2  # half the fp32 bytes
    with pytest.raises(RuntimeError, match="expected weights of version 70000 from rank 2, got version 70001"):
        unpack_weights(dst, pieces, message, 70_000, source=2)
    unpack_weights(dst, pieces, message, 70_001, source=2)
    for (name, got), want in zip(dst.named_parameters(), src.parameters()):
        assert got.dtype == dtype and torch.equal(got, want), name


def test_plan_builder_rejects_bad_sizes():
    with pytest.raises(ValueError, match="max_ahead"):
        build_fbd_plan(RoleLayout(2, 1, 1, 1), 2, 0, range(1))
