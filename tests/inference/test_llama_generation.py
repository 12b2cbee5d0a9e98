"""Grouped-query attention downstream of training: generation with a KV cache of one head per
query group, and MegaScope's captures, attention maps and perturbations, on llama-tiny."""

from __future__ import annotations

import pytest
import torch
from inference_jobs import PROMPTS, load_model, save_tiny_checkpoint
from scope_jobs import capture_job
from test_inference import full_recompute_greedy, generate_job

from megatronapp import scope
from megatronapp.inference.generate import SamplingConfig, generate
from megatronapp.scope.specs import Perturbation, Target

EOD, VOCAB = 256, 257


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("llama_ckpt")
    torch.set_num_threads(1)
    save_tiny_checkpoint(str(path), preset="llama-tiny")
    return str(path)


def test_gqa_kv_cache_generation_equals_full_recompute(ckpt):
    torch.set_num_threads(1)
    model = load_model(0, 1, 1, 1, ckpt)
    assert model.cfg.query_groups < model.cfg.num_attention_heads
    res = generate(model, PROMPTS, SamplingConfig(max_new_tokens=9), eod_id=EOD, vocab_size=VOCAB)
    # the cache holds one key/value head per query group
    keys = next(iter(model.cache.keys.values()))
    assert keys.shape[1] == model.cfg.query_groups
    expected = [full_recompute_greedy(model, p, 9) for p in PROMPTS]
    assert res.tokens == expected
    assert len(set(map(tuple, expected))) > 1  # not a degenerate model


def test_gqa_generation_identical_on_tp2(cluster, ckpt):
    """TP 2 splits the two query groups: each rank caches one key/value head."""
    torch.set_num_threads(1)
    samplings = (SamplingConfig(max_new_tokens=6),)
    ref = generate_job(0, 1, 1, 1, ckpt, samplings)
    for got in cluster.run(generate_job, 2, 2, 1, ckpt, samplings):
        assert got == ref


def test_gqa_captures_share_a_groups_keys_and_attention_rows_sum_to_one(ckpt):
    torch.set_num_threads(1)
    model = load_model(0, 1, 1, 1, ckpt)
    per_group = model.cfg.num_attention_heads // model.cfg.query_groups
    with scope.capture(model, sites=("q", "k", "v", "attn_probs")) as cap:
        generate(model, [PROMPTS[0]], SamplingConfig(max_new_tokens=2), eod_id=EOD, vocab_size=VOCAB)
    for site in ("k", "v"):
        data = cap.get(site, 1, 0)[0].tensors["data"]  # (B, heads, S, D): per query head
        assert data.shape[1] == model.cfg.num_attention_heads
        assert torch.equal(data[:, 0], data[:, per_group - 1])  # one group, one key/value head
        assert not torch.equal(data[:, 0], data[:, per_group])  # the next group's head
    for item in cap.get("attn_probs"):
        p = item.tensors["data"]
        torch.testing.assert_close(p.sum(-1), torch.ones(p.shape[:-1]))


def test_gqa_captures_and_perturbations_equal_on_tp2(cluster, ckpt):
    torch.set_num_threads(1)
    specs = (
        Perturbation("gaussian", Target("k", layers=(1,), heads=(1,)), seed=4, sigma=0.5, rate=0.5),
        Perturbation("bitflip", Target("q", layers=(2,), heads=(0, 3)), seed=5, field="mantissa", rate=0.2),
    )
    sites = ("q", "k", "attn_probs", "residual")
    clean = capture_job(0, 1, 1, 1, ckpt, sites)
    ref = capture_job(0, 1, 1, 1, ckpt, sites, specs)
    assert any(not torch.equal(ref["items"][n]["data"], clean["items"][n]["data"]) for n in ref["items"])
    got = cluster.run(capture_job, 2, 2, 1, ckpt, sites, specs)[0]
    assert got["items"].keys() == ref["items"].keys()
    for name, tensors in ref["items"].items():
        torch.testing.assert_close(got["items"][name]["data"], tensors["data"], rtol=1e-4, atol=2e-5, msg=name)


def test_perturbing_a_groups_key_head_out_of_range_is_refused(ckpt):
    model = load_model(0, 1, 1, 1, ckpt)
    with pytest.raises(ValueError, match="head 2 is out of range"):
        scope.perturb(model, Perturbation("gaussian", Target("k", layers=(0,), heads=(2,)), sigma=1.0))


def test_gqa_static_cache_equals_dynamic_cache(ckpt):
    """The fixed-shape cache behind CUDA graphs, sized by query groups, decodes the same tokens."""
    torch.set_num_threads(1)
    model = load_model(0, 1, 1, 1, ckpt)
    sampling = SamplingConfig(max_new_tokens=9)
    dynamic = generate(model, PROMPTS, sampling, eod_id=EOD, vocab_size=VOCAB)
    original_start = model.start
    model.start = lambda b, n, pad: original_start(b, n, pad, static=True)
    static = generate(model, PROMPTS, sampling, eod_id=EOD, vocab_size=VOCAB)
    assert model.cache.static and static.tokens == dynamic.tokens


def test_greedy_equals_transformers_llama_on_hf_export(ckpt, tmp_path):
    """Batched greedy output equals transformers' LlamaForCausalLM generate on the export
    (left-padded batch with an attention mask on their side, both stopping at end-of-text)."""
    transformers = pytest.importorskip("transformers")
    from megatronapp.inference.reference import greedy_generate_from_checkpoint
    from megatronapp.interop.hf_checkpoint import export_hf

    torch.set_num_threads(1)
    export_hf(ckpt, tmp_path / "hf")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    width = max(map(len, PROMPTS))
    ids = torch.full((len(PROMPTS), width), EOD)
    mask = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    for i, p in enumerate(PROMPTS):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=9, do_sample=False, pad_token_id=EOD)
    theirs = [row[: row.index(EOD)] if EOD in row else row for row in out[:, width:].tolist()]
    assert greedy_generate_from_checkpoint(ckpt, PROMPTS, 9, eod_id=EOD, vocab_size=VOCAB) == theirs


def test_generate_refuses_query_groups_not_dividing_tp_in_one_line(ckpt, capsys):
    from megatronapp.cli.main import main

    args = ["--prompt", "hi", "--nproc-per-node", "4", "--tensor-model-parallel-size", "4"]
    code = main(["generate", "--device", "cpu", "--load", ckpt, *args])  # in-process: nothing may launch
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, lines
    assert "num query groups 2 is not divisible by tensor-parallel size 4" in lines[0]
