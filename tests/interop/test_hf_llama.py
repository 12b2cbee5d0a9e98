"""Hugging Face Llama and Qwen2 export/import against transformers' own models (CPU, no hub).

Tolerance: fp32 logits within 1e-5 absolute of transformers' (measured: equal to the bit on
these shapes); losses within 1e-5 relative.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from engine_jobs import RandomTokenBatches, make_job
from test_hf_interop import load_and_score, train_and_save

from megatronapp.cli.main import main
from megatronapp.engine.full_model import compute_logits, load_full_model, load_model_config, resolve_checkpoint_folder
from megatronapp.job import validate_job

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

SMALL = dict(
    vocab_size=200,
    hidden_size=32,
    intermediate_size=80,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    rms_norm_eps=1e-6,
    rope_theta=5000.0,
)
MODELS = {
    # name: (transformers class, config class, settings beyond SMALL)
    "llama_tied": ("LlamaForCausalLM", "LlamaConfig", {"tie_word_embeddings": True}),
    "llama_biases": ("LlamaForCausalLM", "LlamaConfig", {"attention_bias": True, "mlp_bias": True}),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {"tie_word_embeddings": False}),
}


def _random_hf(name: str, path):
    """A randomly initialised small model (norms and biases moved off their init), saved to `path`."""
    model_cls, config_cls, extra = MODELS[name]
    torch.manual_seed(3)
    config = getattr(transformers, config_cls)(**{**SMALL, **extra})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(str(path))
    return model


def _tokens(vocab: int, seq: int) -> torch.Tensor:
    return torch.randint(0, vocab, (3, seq), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("name", list(MODELS))
def test_import_gives_transformers_logits_and_export_round_trips(tmp_path, name):
    torch.set_num_threads(1)
    hf = _random_hf(name, tmp_path / "hf")
    assert main(["import", "hf", "--from", str(tmp_path / "hf"), "--save", str(tmp_path / "ck")]) == 0
    tokens = _tokens(200, 24)
    with torch.no_grad():
        theirs = hf(tokens).logits
    torch.testing.assert_close(compute_logits(load_full_model(tmp_path / "ck"), tokens), theirs, atol=1e-5, rtol=0)
    assert main(["export", "hf", "--load", str(tmp_path / "ck"), "--out", str(tmp_path / "out")]) == 0
    before, after = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert before.keys() == after.keys()
    for key, t in before.items():
        assert torch.equal(after[key], t), key
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == [MODELS[name][0]] and config["num_key_value_heads"] == 2


@pytest.fixture(scope="module")
def llama_checkpoint(cluster, tmp_path_factory):
    """llama-tiny trained two steps under TP2 x PP2: (folder, the distributed loss of batch 3)."""
    path = str(tmp_path_factory.mktemp("llama_tp2_pp2"))
    job = make_job(4, 2, 2, preset="llama-tiny")
    return path, cluster.run(train_and_save, 4, job, path)[0]


def test_export_from_tp2_pp2_gives_the_engines_logits_and_loss(llama_checkpoint, tmp_path):
    ckpt, dist_loss = llama_checkpoint
    torch.set_num_threads(1)
    assert main(["export", "hf", "--load", ckpt, "--out", str(tmp_path / "hf")]) == 0
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert hf.config.tie_word_embeddings and "lm_head.weight" not in load_file(tmp_path / "hf" / "model.safetensors")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))  # the byte tokenizer's ids
    assert tokenizer("Hi")["input_ids"] == [72, 105]
    tokens = _tokens(257, 16)
    with torch.no_grad():
        theirs = hf(tokens).logits
    torch.testing.assert_close(theirs, compute_logits(load_full_model(ckpt), tokens), atol=1e-5, rtol=0)
    data = RandomTokenBatches(make_job(1, preset="llama-tiny"), 0)
    data.step = 2  # the batch the distributed run scored after saving
    batch = torch.cat(data.next_microbatches())
    with torch.no_grad():
        hf_loss = F.cross_entropy(hf(batch[:, :-1]).logits.flatten(0, 1), batch[:, 1:].flatten()).item()
    assert hf_loss == pytest.approx(dist_loss, rel=1e-5)


@pytest.mark.parametrize("name", ["llama_tied", "qwen2"])
def test_import_loads_under_tp2_pp2_and_scores_as_transformers(cluster, tmp_path, name):
    hf = _random_hf(name, tmp_path / "hf")
    assert main(["import", "hf", "--from", str(tmp_path / "hf"), "--save", str(tmp_path / "ck")]) == 0
    model = load_model_config(resolve_checkpoint_folder(tmp_path / "ck"))
    job = replace(make_job(4, 2, 2), model=model)
    validate_job(job)
    dist_loss = cluster.run(load_and_score, 4, job, str(tmp_path / "ck"))[0]
    batch = torch.cat(RandomTokenBatches(job, 0, vocab=200).next_microbatches())
    with torch.no_grad():
        hf_loss = F.cross_entropy(hf(batch[:, :-1]).logits.flatten(0, 1), batch[:, 1:].flatten()).item()
    assert dist_loss == pytest.approx(hf_loss, rel=1e-5)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"rope_scaling": {"rope_type": "llama3", "factor": 32.0}}, "rope_type: 'llama3'"),
        ({"attention_bias": True}, "attention_bias and mlp_bias differ"),
        ({"head_dim": 16}, "head_dim: 16"),
        ({"hidden_act": "gelu"}, "hidden_act: 'gelu'"),
        ({"num_key_value_heads": 3}, "not divisible by num query groups 3"),
    ],
)
def test_import_refuses_what_the_engine_cannot_express_in_one_line(tmp_path, capsys, config, message):
    (tmp_path / "hf").mkdir()
    hf_config = {"model_type": "llama", **SMALL, **config}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf_config))
    assert main(["import", "hf", "--from", str(tmp_path / "hf"), "--save", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "ck").exists()
