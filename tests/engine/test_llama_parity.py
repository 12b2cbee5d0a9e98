"""The Llama family (RMSNorm, SwiGLU, grouped-query attention, no biases, tied embeddings)
trains the same numbers in every layout as one process (fp32, CPU, gloo)."""

from __future__ import annotations

import pytest
import torch
from engine_jobs import (
    RandomTokenBatches,
    assemble_full_grads,
    compiled_frames,
    full_grads,
    make_job,
    train_and_report,
)
from fbd_jobs import fbd_train_and_report
from test_checkpoint import train_and_save, train_save_resume

from megatronapp.dpp.config import DppConfig
from megatronapp.dpp.job_hooks import build_dynamic_runtime_factory
from megatronapp.engine.checkpoint import load_checkpoint
from megatronapp.engine.trainer import Trainer
from megatronapp.fbd.config import FbdConfig
from megatronapp.parallel.groups import build_process_groups, single_process_groups

CASES = {
    # name: (world, tp, pp, vpp, schedule, train kwargs)
    "tp2_pp2_vpp2_interleaved": (4, 2, 2, 2, "interleaved", {}),
    "dp2_tp2_distopt_sp": (4, 2, 1, 1, "1f1b", {"use_distributed_optimizer": True, "sequence_parallel": True}),
    # the tie across stages with DP-sharded main grads: summed before the reduce-scatter
    "dp2_pp2_distopt_tied": (4, 1, 2, 1, "1f1b", {"use_distributed_optimizer": True}),
    "pp2_zb_h1": (2, 1, 2, 1, "zb-h1", {}),
    "pp2_vpp2_interleaved_zb": (2, 1, 2, 2, "interleaved-zb", {}),
    "tp2_recompute_full": (2, 2, 1, 1, "1f1b", {"recompute_granularity": "full"}),
}
# two query groups: TP 2 gives each rank one key/value head shared by two query heads
QWEN_LIKE = {"add_qkv_bias": True, "untie_embeddings_and_output_weights": True}


def _llama_job(world: int, tp: int = 1, pp: int = 1, vpp: int = 1, schedule: str = "1f1b", model_kw=None, **kw):
    return make_job(world, tp, pp, vpp, schedule, preset="llama-tiny", model_kw=model_kw, **kw)


def _assert_matches(reports: list[dict], ref: dict) -> None:
    for rep in reports:
        torch.testing.assert_close(rep["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rep["norms"], ref["norms"], rtol=1e-5, atol=1e-6)
    grads = assemble_full_grads(reports)
    assert grads.keys() == ref["grads"].keys()
    for key, g in grads.items():
        torch.testing.assert_close(g, ref["grads"][key][0], rtol=1e-4, atol=1e-6, msg=lambda m: f"{key}: {m}")


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    return train_and_report(0, 1, _llama_job(1))


@pytest.mark.parametrize("name", list(CASES))
def test_llama_layout_matches_single_process(cluster, reference, name):
    world, tp, pp, vpp, schedule, train_kw = CASES[name]
    reports = cluster.run(train_and_report, world, _llama_job(world, tp, pp, vpp, schedule, **train_kw))
    _assert_matches(reports, reference)
    assert abs(reference["losses"][-1] - reference["losses"][0]) > 1e-3  # training moved
    # one process holds both sides of the tie: each gets the sum of the two gradients
    assert torch.equal(reference["grads"]["embedding.weight"][0], reference["grads"]["output.weight"][0])


def test_qkv_bias_untied_tp2_pp2_matches_single_process(cluster):
    torch.set_num_threads(1)
    ref = train_and_report(0, 1, _llama_job(1, model_kw=QWEN_LIKE))
    assert "layers.0.attention.attn.qkv.bias" in ref["grads"] and "layers.0.mlp.mlp.fc1.bias" not in ref["grads"]
    _assert_matches(cluster.run(train_and_report, 4, _llama_job(4, 2, 2, model_kw=QWEN_LIKE)), ref)


def tied_weights_after_training(rank: int, world: int, job) -> dict:
    """The embedding (first stage) and the tied output layer (last stage) after training."""
    groups = build_process_groups(job.layout, rank)
    trainer = Trainer(job, groups, torch.device("cpu"), RandomTokenBatches(job, groups.dp_rank))
    trainer.train(job.train.train_iters)
    named = {n: p.detach().clone() for c in trainer.chunks for n, p in c.named_parameters()}
    return {k: named[k] for k in ("embedding.weight", "output.weight") if k in named}


def test_tied_embedding_across_pp2_stays_one_weight(cluster):
    """Both stages take the summed gradient, so the two copies stay bit-identical; and the
    tie really couples them: untied, the same training moves them apart."""
    reports = cluster.run(tied_weights_after_training, 2, _llama_job(2, 1, 2))
    embedding, output = reports[0]["embedding.weight"], reports[1]["output.weight"]
    assert torch.equal(embedding, output)
    untied = _llama_job(2, 1, 2, model_kw={"untie_embeddings_and_output_weights": True})
    reports = cluster.run(tied_weights_after_training, 2, untied)
    assert not torch.equal(reports[0]["embedding.weight"], reports[1]["output.weight"])


def test_llama_fbd_trains_the_plain_engines_numbers(cluster):
    job = _llama_job(2, 1, 2)
    plain = cluster.run(train_and_report, 2, job)
    reports = cluster.run(fbd_train_and_report, 4, job, FbdConfig(forward_tp_size=1, max_ahead=2))
    backward = [r for r in reports if r["role"] == "backward"]
    ref_grads, grads = assemble_full_grads(plain), assemble_full_grads(backward)
    for rep in backward:
        assert rep["losses"] == plain[0]["losses"] and rep["norms"] == plain[0]["norms"]
    for key, g in grads.items():
        assert torch.equal(g, ref_grads[key]), key


@pytest.mark.parametrize(
    "tp, pp, kw", [(2, 1, {"sequence_parallel": True}), (2, 1, {}), (1, 2, {})], ids=["tp2_sp", "tp2", "pp2_tied"]
)
def test_llama_fp8_follows_single_process(cluster, tp, pp, kw):
    """bf16 + FP8 (CPU-emulated) on the Llama family: bf16 tolerance, as the GPT-NeoX FP8 layouts."""
    torch.set_num_threads(1)
    single = train_and_report(0, 1, _llama_job(1, bf16=True, fp8_format="hybrid"))
    for rep in cluster.run(train_and_report, 2, _llama_job(2, tp, pp, bf16=True, fp8_format="hybrid", **kw)):
        torch.testing.assert_close(rep["losses"], single["losses"], rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(rep["norms"], single["norms"], rtol=3e-2, atol=1e-3)


@pytest.mark.parametrize(
    "recompute",
    [{"recompute_granularity": "selective"}, {"recompute_granularity": "full", "recompute_num_layers": 2}],
    ids=["selective", "full_uniform2"],
)
def test_llama_recompute_with_attention_dropout_is_bit_identical(recompute):
    torch.set_num_threads(1)
    dropouts = {"hidden_dropout": 0.2, "attention_dropout": 0.2}
    plain = train_and_report(0, 1, _llama_job(1, model_kw=dropouts))
    again = train_and_report(0, 1, _llama_job(1, model_kw=dropouts, **recompute))
    assert again["losses"] == plain["losses"]
    for key, (g, _, _) in plain["grads"].items():
        assert torch.equal(again["grads"][key][0], g), key


def test_llama_tied_pp2_resume_equals_uninterrupted_and_loads_into_one_process(cluster, tmp_path):
    reports = cluster.run(train_save_resume, 2, _llama_job(2, 1, 2, iters=4), str(tmp_path / "resume"))
    for rep in reports:
        assert rep["resumed"] == rep["straight"] and rep["params_equal"]
    # re-sharding: a TP2 x PP2 checkpoint continues in one process with the distributed run's losses
    losses = cluster.run(train_and_save, 4, _llama_job(4, 2, 2), str(tmp_path / "tp2_pp2"))[0]
    torch.set_num_threads(1)
    single = _llama_job(1)
    data = RandomTokenBatches(single, 0)
    trainer = Trainer(single, single_process_groups(), torch.device("cpu"), data)
    assert load_checkpoint(str(tmp_path / "tp2_pp2"), trainer, data) == 2
    assert trainer.train_step().loss == pytest.approx(losses[2], rel=1e-5)


def train_dynamic_and_report(rank: int, world: int, job) -> dict:
    """train_and_report under MegaDPP's dynamic schedule (adaptive traversal, default cap)."""
    groups = build_process_groups(job.layout, rank)
    factory = build_dynamic_runtime_factory(DppConfig("adaptive", None), job)
    trainer = Trainer(
        job, groups, torch.device("cpu"), RandomTokenBatches(job, groups.dp_rank), runtime_factory=factory
    )
    losses, norms, grads = [], [], None
    for step in range(job.train.train_iters):
        m = trainer.train_step()
        losses.append(m.loss)
        norms.append(m.grad_norm)
        if step == 0:
            grads = full_grads(trainer) if groups.dp_rank == 0 else {}
    return {"losses": losses, "norms": norms, "grads": grads}


def test_llama_dynamic_schedule_tp2_pp2_vpp2_matches_single_process(cluster, reference):
    job = _llama_job(4, 2, 2, 2, "dynamic")
    _assert_matches(cluster.run(train_dynamic_and_report, 4, job), reference)


def test_compiled_llama_compiles_per_block_kind_not_per_layer():
    """Ten layers compiled: attention, MLP and head get one graph each, no graph breaks (the
    GPT-NeoX family's count), so the GQA split and the SwiGLU gate add no per-layer guards."""
    torch.set_num_threads(1)
    job = _llama_job(1, num_layers=10, iters=3, compile=True)
    assert compiled_frames(job, "cpu") == {"frames": 3, "graph_breaks": 0}


def test_tied_embedding_counts_once_in_the_grad_norm():
    """The norm is the tied model's: its shared weight's gradient (held by both sides) counted once."""
    torch.set_num_threads(1)
    rep = train_and_report(0, 1, _llama_job(1, iters=1, clip_grad=0.0))
    grads = {name: g for name, (g, _, _) in rep["grads"].items()}
    assert torch.equal(grads["embedding.weight"], grads["output.weight"])
    once = torch.stack([g.norm() for name, g in grads.items() if name != "output.weight"]).norm()
    assert rep["norms"][0] == pytest.approx(float(once), rel=1e-5)
