"""MegaScope on TP / PP layouts: captures and seeded perturbations equal the one-process run."""

from __future__ import annotations

import pytest
import torch
from scope_jobs import capture_job

from megatronapp.scope.specs import Perturbation, Target


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint


def _assert_items_close(got: dict, ref: dict) -> None:
    assert got.keys() == ref.keys()
    for name, tensors in ref.items():
        for key, t in tensors.items():
            if t.dtype.is_floating_point:
                torch.testing.assert_close(got[name][key], t, rtol=1e-4, atol=2e-5, msg=name)
            else:  # top-k ids: equal unless two probabilities tie within rounding
                assert torch.equal(got[name][key], t), name


@pytest.mark.parametrize("layout", [(2, 2, 1), (2, 1, 2), (4, 2, 2)], ids=["tp2", "pp2", "tp2_pp2"])
def test_captures_equal_across_layouts(cluster, ckpt, layout):
    torch.set_num_threads(1)
    ref = capture_job(0, 1, 1, 1, ckpt)
    got = cluster.run(capture_job, layout[0], *layout[1:], ckpt)[0]
    assert len(ref["items"]) == 3 * (4 * 8 + 2)  # 3 steps x (4 layers x 8 sites + topk + lens)
    _assert_items_close(got["items"], ref["items"])


SPECS = (
    Perturbation("gaussian", Target("fc1", layers=(1,)), seed=11, sigma=0.5, rate=0.3),  # TP-sharded columns
    Perturbation("bitflip", Target("q", layers=(2,), heads=(1, 3)), seed=5, field="mantissa", num_bits=2, rate=0.2),
    Perturbation(
        "bitflip", Target("param", param="layers.0.attention.attn.qkv.weight"), seed=3, field="exponent", rate=0.002
    ),
    Perturbation("uniform", Target("residual", layers=(3,), positions=(2, 3), steps=(0, 1)), seed=9, low=0.5, high=1.5),
)


def test_seeded_perturbations_replay_on_tp2_pp2(cluster, ckpt):
    torch.set_num_threads(1)
    sites = ("residual", "topk")
    clean = capture_job(0, 1, 1, 1, ckpt, sites)
    ref = capture_job(0, 1, 1, 1, ckpt, sites, SPECS)
    assert ref["params_restored"]
    changed = [n for n in ref["items"] if not torch.equal(ref["items"][n]["data"], clean["items"][n]["data"])]
    assert "step0/layer1/residual" in changed and "step0/layer0/residual" in changed  # param fault, fc1 noise
    reports = cluster.run(capture_job, 4, 2, 2, ckpt, sites, SPECS)
    assert all(r["params_restored"] for r in reports)
    _assert_items_close(reports[0]["items"], ref["items"])
