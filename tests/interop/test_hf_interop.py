"""Hugging Face GPT-NeoX export/import against transformers' own model (CPU, no hub access).

Checkpoints are trained for two steps under TP2 x PP2 and TP2 (gloo workers); transformers'
GPTNeoXForCausalLM loads the export and must give the engine's logits and its distributed
loss. Import is checked on a randomly initialised GPT-NeoX built here, by round trip, by
training from it, and by refusing what the engine cannot express.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import fields, replace

import pytest
import torch
import torch.nn.functional as F
from engine_jobs import RandomTokenBatches, make_job

from megatronapp.cli.main import main
from megatronapp.data.tokenizer import ByteTokenizer, HFTokenizer
from megatronapp.engine.checkpoint import load_checkpoint, save_checkpoint
from megatronapp.engine.full_model import (
    compute_logits,
    load_full_model,
    load_model_config,
    resolve_checkpoint_folder,
)
from megatronapp.engine.trainer import Trainer
from megatronapp.interop.hf_gptneox import GPTNEOX_DEFAULTS
from megatronapp.job import replace_fields, validate_job
from megatronapp.parallel.groups import build_process_groups

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

CPU = torch.device("cpu")


def _job(world: int, tp: int = 1, pp: int = 1, **kw):
    """make_job without dropout (ModelConfig may carry dropout fields): the scored losses are eval-mode."""
    job = make_job(world, tp, pp, **kw)
    off = {f.name: 0.0 for f in fields(job.model) if f.name.endswith("dropout")}
    return replace(job, model=replace(job.model, **off))


def train_and_save(rank: int, world: int, job, save_dir: str) -> float:
    """Two steps, save, then the third step's loss: the forward loss of the saved weights on batch 3."""
    groups = build_process_groups(job.layout, rank)
    data = RandomTokenBatches(job, groups.dp_rank)
    trainer = Trainer(job, groups, CPU, data)
    trainer.train(2)
    save_checkpoint(save_dir, trainer, data)
    return trainer.train_step().loss


@pytest.fixture(scope="module")
def checkpoints(cluster, tmp_path_factory):
    """layout name -> (checkpoint dir, distributed loss of batch 3 on the saved weights)."""
    out = {}
    for name, (world, tp, pp) in {"tp2_pp2": (4, 2, 2), "tp2": (2, 2, 1)}.items():
        path = str(tmp_path_factory.mktemp(name))
        out[name] = (path, cluster.run(train_and_save, world, _job(world, tp, pp), path)[0])
    return out


def _third_batch(job) -> torch.Tensor:
    data = RandomTokenBatches(job, 0)
    data.step = 2
    return torch.cat(data.next_microbatches())  # (global batch, seq + 1)


def _random_tokens(vocab: int, seq: int) -> torch.Tensor:
    return torch.randint(0, vocab, (3, seq), generator=torch.Generator().manual_seed(7))


def _export(ckpt, out) -> None:
    assert main(["export", "hf", "--load", str(ckpt), "--out", str(out)]) == 0


def _hf_model(path):
    return transformers.GPTNeoXForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("layout", ["tp2_pp2", "tp2"])
def test_export_logits_and_loss_equal_transformers(checkpoints, tmp_path, layout):
    ckpt, dist_loss = checkpoints[layout]
    torch.set_num_threads(1)
    _export(ckpt, tmp_path / "hf")
    hf = _hf_model(tmp_path / "hf")
    tokens = _random_tokens(257, 16)
    ours = compute_logits(load_full_model(ckpt), tokens)
    with torch.no_grad():
        theirs = hf(tokens).logits
    assert ours.shape == theirs.shape == (3, 16, 384)
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    batch = _third_batch(_job(1))  # the batch the distributed run scored after saving
    with torch.no_grad():
        hf_loss = F.cross_entropy(hf(batch[:, :-1]).logits.flatten(0, 1), batch[:, 1:].flatten()).item()
    assert hf_loss == pytest.approx(dist_loss, rel=1e-5)


def test_compute_logits_matches_the_engine_loss(checkpoints):
    """compute_logits against the engine's own loss path (a one-process Trainer after load_checkpoint)."""
    ckpt, _ = checkpoints["tp2_pp2"]
    torch.set_num_threads(1)
    job = _job(1)
    trainer = Trainer(job, build_process_groups(job.layout, 0), CPU, RandomTokenBatches(job, 0))
    load_checkpoint(ckpt, trainer)
    trainer.chunks[0].eval()
    batch = _third_batch(job)
    with torch.no_grad():
        engine_loss = trainer.chunks[0](batch[:, :-1], batch[:, 1:]).mean().item()  # per-token losses
    logits = compute_logits(load_full_model(ckpt), batch[:, :-1])
    assert F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item() == pytest.approx(engine_loss, rel=1e-6)


def test_exported_byte_tokenizer_gives_the_engine_ids(checkpoints, tmp_path):
    _export(checkpoints["tp2"][0], tmp_path)
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    engine_view = HFTokenizer(tmp_path / "tokenizer.json")
    assert engine_view.vocab_size == 257 and engine_view.eod_id == ByteTokenizer.EOD_ID == auto.eos_token_id
    for text in ["hello world", "  two  spaces\n\ttab", "héllo ünïcödé 日本語 🙂"]:
        ids = ByteTokenizer().encode(text)
        assert auto(text)["input_ids"] == ids == engine_view.encode(text)
        assert auto.decode(ids) == text
    assert json.loads((tmp_path / "config.json").read_text())["eos_token_id"] == 256


def test_import_then_export_round_trip_is_identical(checkpoints, tmp_path):
    ckpt, _ = checkpoints["tp2_pp2"]
    _export(ckpt, tmp_path / "hf1")
    assert main(["import", "hf", "--from", str(tmp_path / "hf1"), "--save", str(tmp_path / "ck")]) == 0
    _export(tmp_path / "ck", tmp_path / "hf2")
    first, second = load_file(tmp_path / "hf1" / "model.safetensors"), load_file(tmp_path / "hf2" / "model.safetensors")
    assert first.keys() == second.keys() and len(first) == 4 + 12 * 4
    for key in first:
        assert torch.equal(first[key], second[key]), key
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "hf1" / name).read_text() == (tmp_path / "hf2" / name).read_text(), name
    before = json.loads((resolve_checkpoint_folder(ckpt) / "meta.json").read_text())["model"]
    after = json.loads((tmp_path / "ck" / "iter_0000000" / "meta.json").read_text())["model"]
    assert after == before  # vocab_size 257 comes back through the exported tokenizer


def _random_gptneox(path, **overrides):
    """A randomly initialised GPTNeoXForCausalLM the engine can express, saved with save_pretrained."""
    settings = dict(
        vocab_size=200,
        hidden_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=100,
        hidden_act="gelu_pytorch_tanh",
        rotary_pct=1.0,
        rotary_emb_base=5000.0,
        use_parallel_residual=False,
        max_position_embeddings=24,
        layer_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    settings.update(overrides)
    torch.manual_seed(3)
    model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**settings)).eval()
    with torch.no_grad():
        for p in model.parameters():  # non-trivial LayerNorms and biases too
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(str(path))
    return model


def test_import_random_gptneox_gives_transformers_logits(tmp_path):
    torch.set_num_threads(1)
    hf = _random_gptneox(tmp_path / "hf")
    assert main(["import", "hf", "--from", str(tmp_path / "hf"), "--save", str(tmp_path / "ck")]) == 0
    tokens = _random_tokens(200, 24)
    with torch.no_grad():
        theirs = hf(tokens).logits
    ours = compute_logits(load_full_model(tmp_path / "ck"), tokens)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    cfg = json.loads((tmp_path / "ck" / "iter_0000000" / "meta.json").read_text())["model"]
    assert (cfg["rotary_base"], cfg["layernorm_epsilon"], cfg["vocab_size"]) == (5000.0, 1e-6, 200)


def load_and_score(rank: int, world: int, job, ckpt: str) -> float:
    groups = build_process_groups(job.layout, rank)
    data = RandomTokenBatches(job, groups.dp_rank, vocab=job.model.vocab_size)
    trainer = Trainer(job, groups, CPU, data)
    load_checkpoint(ckpt, trainer)  # the test batches keep their own position
    return trainer.train_step().loss  # forward loss of batch 1 on the imported weights


def test_imported_checkpoint_loads_under_tp2_pp2(cluster, tmp_path):
    """The one-shard import re-shards like any checkpoint: TP2 x PP2 scores a batch as transformers does."""
    hf = _random_gptneox(tmp_path / "hf", num_hidden_layers=4)
    assert main(["import", "hf", "--from", str(tmp_path / "hf"), "--save", str(tmp_path / "ck")]) == 0
    job = replace(_job(4, 2, 2), model=load_model_config(resolve_checkpoint_folder(tmp_path / "ck")))
    validate_job(job)
    dist_loss = cluster.run(load_and_score, 4, job, str(tmp_path / "ck"))[0]
    data = RandomTokenBatches(job, 0, vocab=200)
    batch = torch.cat(data.next_microbatches())
    with torch.no_grad():
        hf_loss = F.cross_entropy(hf(batch[:, :-1]).logits.flatten(0, 1), batch[:, 1:].flatten()).item()
    assert dist_loss == pytest.approx(hf_loss, rel=1e-5)


def test_train_cli_resumes_from_an_import(checkpoints, tmp_path, capsys):
    """`megatronapp train --load` with the flags import prints: its first loss is the imported model's."""
    from megatronapp.data.dataset import DistributedBatchIterator, build_default_dataset

    torch.set_num_threads(1)
    _export(checkpoints["tp2"][0], tmp_path / "hf")
    capsys.readouterr()
    assert main(["import", "hf", "--from", str(tmp_path / "hf"), "--save", str(tmp_path / "ck")]) == 0
    hint = capsys.readouterr().out.strip().splitlines()[-1].split()
    assert hint[:4] == ["megatronapp", "train", "--load", str(tmp_path / "ck")]
    metrics = tmp_path / "metrics.jsonl"
    assert (
        main(
            [
                *hint[1:],
                "--device",
                "cpu",
                "--train-iters",
                "1",
                "--micro-batch-size",
                "2",
                "--global-batch-size",
                "4",
                "--lr-warmup-iters",
                "0",
                "--metrics-file",
                str(metrics),
            ]
        )
        == 0
    )
    first_loss = json.loads(metrics.read_text().splitlines()[0])["loss"]
    data = DistributedBatchIterator(
        build_default_dataset(ByteTokenizer(), 16, 1234),
        micro_batch_size=2,
        global_batch_size=4,
        dp_rank=0,
        dp_size=1,
        seed=1234,
    )
    batch = torch.cat(data.next_microbatches())
    with torch.no_grad():
        hf_loss = F.cross_entropy(
            _hf_model(tmp_path / "hf")(batch[:, :-1]).logits.flatten(0, 1), batch[:, 1:].flatten()
        ).item()
    assert first_loss == pytest.approx(hf_loss, rel=1e-5)


@pytest.mark.parametrize(
    "field, value",
    [
        ("use_parallel_residual", True),
        ("rotary_pct", 0.25),
        ("tie_word_embeddings", True),
        ("hidden_act", "gelu"),
        ("attention_bias", False),
        ("rope_scaling", {"type": "linear", "factor": 2.0}),
        ("model_type", "mistral"),
    ],
)
def test_unexpressible_config_is_refused_in_one_line(checkpoints, tmp_path, capsys, field, value):
    _export(checkpoints["tp2"][0], tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config[field] = value
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["import", "hf", "--from", str(tmp_path / "hf"), "--save", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("megatronapp: error: ")
    assert f"{ {'rope_scaling': 'rope_type'}.get(field, field) }: " in err  # names the field
    assert not (tmp_path / "ck").exists()


def test_missing_weight_and_bad_paths_are_one_line_errors(checkpoints, tmp_path, capsys):
    _export(checkpoints["tp2"][0], tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    del tensors["gpt_neox.layers.1.mlp.dense_4h_to_h.bias"]
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    ck, out = str(tmp_path / "ck"), str(tmp_path / "out")
    cases = [
        (["import", "hf", "--from", str(tmp_path / "hf"), "--save", ck], "dense_4h_to_h.bias"),
        (["import", "hf", "--from", str(tmp_path / "nowhere"), "--save", ck], "not found"),
        (["export", "hf", "--load", str(tmp_path / "hf"), "--out", out], "no complete checkpoint"),
    ]
    for argv, words in cases:
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err
    assert not (tmp_path / "ck").exists() and not (tmp_path / "out").exists()


def test_import_refuses_to_overwrite_a_checkpoint(checkpoints, tmp_path, capsys):
    ckpt = tmp_path / "ck"
    shutil.copytree(checkpoints["tp2"][0], ckpt)
    _export(ckpt, tmp_path / "hf")
    before = sorted(p.name for p in ckpt.iterdir())
    assert main(["import", "hf", "--from", str(tmp_path / "hf"), "--save", str(ckpt)]) == 2
    assert "already holds a checkpoint" in capsys.readouterr().err
    assert sorted(p.name for p in ckpt.iterdir()) == before


def test_gptneox_defaults_match_transformers():
    """config.json omits default values, so our table of GPTNeoXConfig's defaults must be right."""
    default = transformers.GPTNeoXConfig()
    rope = default.rope_parameters
    for key, value in GPTNEOX_DEFAULTS.items():
        theirs = (
            {"rotary_pct": rope["partial_rotary_factor"], "rotary_emb_base": rope["rope_theta"]}.get(key)
            if key in ("rotary_pct", "rotary_emb_base")
            else getattr(default, key)
        )
        assert theirs == value, key


def test_vocab_divisor_pads_the_tokenizer_vocab_exactly_to_the_model_vocab():
    from megatronapp.interop.hf_gptneox import compute_vocab_divisor

    for padded, vocab, expected in [
        (384, 257, 128),
        (384, 384, 128),
        (200, 200, 8),
        (200, 193, 8),
        (200, 150, 200),
        (50304, 50277, 128),
        (7, 7, 1),
    ]:
        m = compute_vocab_divisor(padded, vocab)
        assert m == expected and -(-vocab // m) * m == padded


def test_expressibility_reads_both_config_styles_and_the_defaults():
    from megatronapp.interop.hf_gptneox import InteropError, check_expressible

    good = {"model_type": "gpt_neox", "use_parallel_residual": False, "hidden_act": "gelu_pytorch_tanh"}
    check_expressible({**good, "rotary_pct": 1.0})  # transformers 4.x keys
    check_expressible(
        {**good, "rope_parameters": {"partial_rotary_factor": 1.0, "rope_theta": 1e4, "rope_type": "default"}}
    )  # 5.x
    for config, field in [
        ({**good}, "rotary_pct"),  # default 0.25
        ({**good, "rope_parameters": {"partial_rotary_factor": 0.5}}, "rotary_pct"),
        ({"model_type": "gpt_neox", "rotary_pct": 1.0}, "use_parallel_residual"),
    ]:
        with pytest.raises(InteropError, match=f"^{field}: "):
            check_expressible(config)


def test_bf16_checkpoint_exports_its_fp32_main_params(tmp_path):
    """Under bf16 the fp32 main params are the model; --dtype bfloat16 gives exactly the bf16 copies."""
    torch.set_num_threads(1)
    job = replace_fields(_job(1), bf16=True)
    data = RandomTokenBatches(job, 0)
    trainer = Trainer(job, build_process_groups(job.layout, 0), CPU, data)
    trainer.train(2)
    save_checkpoint(tmp_path / "ck", trainer, data)
    bf16_params = {n: p.detach().clone() for c in trainer.chunks for n, p in c.named_parameters()}
    assert main(["export", "hf", "--load", str(tmp_path / "ck"), "--out", str(tmp_path / "fp32")]) == 0
    assert (
        main(["export", "hf", "--load", str(tmp_path / "ck"), "--out", str(tmp_path / "bf16"), "--dtype", "bfloat16"])
        == 0
    )
    fp32, bf16 = load_file(tmp_path / "fp32" / "model.safetensors"), load_file(tmp_path / "bf16" / "model.safetensors")
    qkv = "gpt_neox.layers.0.attention.query_key_value.weight"
    assert fp32[qkv].dtype == torch.float32 and not torch.equal(fp32[qkv], fp32[qkv].bfloat16().float())
    assert torch.equal(bf16[qkv], bf16_params["layers.0.attention.attn.qkv.weight"])
    tokens = _random_tokens(257, 16)
    with torch.no_grad():
        theirs = _hf_model(tmp_path / "fp32")(tokens).logits
    torch.testing.assert_close(theirs, compute_logits(load_full_model(tmp_path / "ck"), tokens), atol=1e-5, rtol=0)
