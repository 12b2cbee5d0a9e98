"""Engine II features against one process: sequence parallelism, hidden dropout under every
parallel axis, recompute, and bit-identical resume with dropout (fp32, CPU, gloo)."""

from __future__ import annotations

import pytest
import torch
from engine_jobs import assemble_full_grads, make_job, train_and_report
from test_checkpoint import train_save_resume

HIDDEN_DROPOUT = {"hidden_dropout": 0.2}
BOTH_DROPOUTS = {"hidden_dropout": 0.2, "attention_dropout": 0.2}

CASES = {
    # name: (world, tp, pp, train kwargs, model kwargs)
    "sp_tp2": (2, 2, 1, {"sequence_parallel": True}, {}),
    "sp_tp2_pp2_dropout": (4, 2, 2, {"sequence_parallel": True}, HIDDEN_DROPOUT),
    "dropout_tp2": (2, 2, 1, {}, HIDDEN_DROPOUT),
    "dropout_pp2": (2, 1, 2, {}, HIDDEN_DROPOUT),
    "dropout_dp2": (2, 1, 1, {}, HIDDEN_DROPOUT),
    "recompute_full_tp2_dropout": (2, 2, 1, {"recompute_granularity": "full"}, HIDDEN_DROPOUT),
}


def _reference(model_kw: dict) -> dict:
    torch.set_num_threads(1)
    return train_and_report(0, 1, make_job(1, model_kw=model_kw))


@pytest.mark.parametrize("name", list(CASES))
def test_feature_matches_single_process(cluster, name):
    world, tp, pp, train_kw, model_kw = CASES[name]
    ref = _reference(model_kw)
    reports = cluster.run(train_and_report, world, make_job(world, tp, pp, model_kw=model_kw, **train_kw))
    for rep in reports:
        torch.testing.assert_close(rep["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rep["norms"], ref["norms"], rtol=1e-5, atol=1e-6)
    grads = assemble_full_grads(reports)
    assert grads.keys() == ref["grads"].keys()
    for key, g in grads.items():
        torch.testing.assert_close(g, ref["grads"][key][0], rtol=1e-4, atol=1e-6, msg=lambda m: f"{key}: {m}")


def test_hidden_dropout_changes_training():
    """Guards the cases above: with dropout on the numbers really differ from dropout off."""
    on, off = _reference(HIDDEN_DROPOUT), _reference({})
    assert abs(on["losses"][0] - off["losses"][0]) > 1e-4


@pytest.mark.parametrize(
    "recompute",
    [
        {"recompute_granularity": "selective"},
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2},
        {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
    ],
    ids=["selective", "full_uniform2", "full_block1"],
)
def test_recompute_is_bit_identical_with_both_dropouts(recompute):
    torch.set_num_threads(1)
    plain = train_and_report(0, 1, make_job(1, model_kw=BOTH_DROPOUTS))
    again = train_and_report(0, 1, make_job(1, model_kw=BOTH_DROPOUTS, **recompute))
    assert again["losses"] == plain["losses"]
    for key, (g, _, _) in plain["grads"].items():
        assert torch.equal(again["grads"][key][0], g), key


def test_resume_bit_identical_with_both_dropouts(cluster, tmp_path):
    job = make_job(2, 2, 1, iters=4, model_kw=BOTH_DROPOUTS)
    for rep in cluster.run(train_save_resume, 2, job, str(tmp_path)):
        assert rep["resumed"] == rep["straight"]
        assert rep["params_equal"]
