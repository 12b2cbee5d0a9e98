"""Generation: same greedy tokens on every layout, KV cache equals full recompute, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from inference_jobs import PROMPTS, load_model

from megatronapp.config import ConfigError
from megatronapp.inference.generate import SamplingConfig, compute_next_tokens, generate

EOD, VOCAB = 256, 257


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint


def generate_job(rank: int, world: int, tp: int, pp: int, load_dir: str, samplings) -> list[list[list[int]]]:
    """New tokens of PROMPTS for each sampling config, on this rank of the layout."""
    model = load_model(rank, world, tp, pp, load_dir)
    return [generate(model, PROMPTS, s, eod_id=EOD, vocab_size=VOCAB).tokens for s in samplings]


def full_recompute_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Reference: no cache, the whole sequence through the plain training forward every step."""
    seq, out = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(steps):
            logits = model.chunk(seq)[:, -1]  # one process: the chunk holds the head and returns logits
            nxt = int(logits[0, :VOCAB].argmax())
            if nxt == EOD:
                break
            out.append(nxt)
            seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
    return out


def test_kv_cache_batched_equals_full_recompute(ckpt):
    torch.set_num_threads(1)
    model = load_model(0, 1, 1, 1, ckpt)
    res = generate(model, PROMPTS, SamplingConfig(max_new_tokens=9), eod_id=EOD, vocab_size=VOCAB)
    expected = [full_recompute_greedy(model, p, 9) for p in PROMPTS]
    assert res.tokens == expected
    assert len(set(map(tuple, expected))) > 1 and len(set(expected[0])) > 1  # not a degenerate model


@pytest.mark.parametrize("layout", [(2, 2, 1), (2, 1, 2), (4, 2, 2)], ids=["tp2", "pp2", "tp2_pp2"])
def test_greedy_and_seeded_sampling_identical_across_layouts(cluster, ckpt, layout):
    torch.set_num_threads(1)
    samplings = (
        SamplingConfig(max_new_tokens=9),
        SamplingConfig(max_new_tokens=9, greedy=False, temperature=1.5, top_k=40, top_p=0.95, seed=7),
    )
    reference = generate_job(0, 1, 1, 1, ckpt, samplings)
    assert reference[0] != reference[1]  # sampling really samples
    results = cluster.run(generate_job, layout[0], *layout[1:], ckpt, samplings)
    for r in results:  # every rank reports the same tokens (broadcast from the serving rank)
        assert r == reference


def test_sampling_is_seeded_and_filters():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0))
    cfg = SamplingConfig(greedy=False, temperature=0.7, top_k=5, seed=3)
    a = compute_next_tokens(logits, cfg, VOCAB, torch.Generator().manual_seed(3))
    b = compute_next_tokens(logits, cfg, VOCAB, torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    top5 = logits[:, :VOCAB].topk(5).indices
    for _ in range(20):
        t = compute_next_tokens(logits, cfg, VOCAB, None)
        assert all(int(t[i]) in top5[i].tolist() for i in range(4))
    nucleus = SamplingConfig(greedy=False, top_p=1e-6)  # keeps only the most likely token
    assert torch.equal(compute_next_tokens(logits, nucleus, VOCAB, None), logits[:, :VOCAB].argmax(-1))
    padded = torch.zeros(1, 300)
    padded[0, 280] = 100.0  # a padding id never wins
    assert int(compute_next_tokens(padded, SamplingConfig(), VOCAB, None)) < VOCAB


def test_bad_generation_requests_rejected(ckpt):
    model = load_model(0, 1, 1, 1, ckpt)
    with pytest.raises(ConfigError, match="exceeds the model's sequence length"):
        generate(model, [[1] * 10], SamplingConfig(max_new_tokens=7), eod_id=EOD, vocab_size=VOCAB)
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        generate(model, [[1, 400]], SamplingConfig(max_new_tokens=2), eod_id=EOD, vocab_size=VOCAB)
    with pytest.raises(ConfigError, match="top-p"):
        SamplingConfig(top_p=0)


def _cli(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "megatronapp.cli.main", "generate", "--device", "cpu", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt", "hi", "--nproc-per-node", "2", "--tensor-model-parallel-size", "3"], "not divisible"),
        (["--prompt", "hi", "--nproc-per-node", "4", "--tensor-model-parallel-size", "2"], "one model replica"),
        (["--prompt", "hi", "--greedy", "--temperature", "0.5"], "--greedy cannot be combined"),
        (["--max-new-tokens", "3"], "at least one --prompt"),
        (["--prompt", "a long prompt that does not fit"], "exceeds the model's sequence length"),
    ],
)
def test_cli_bad_input_one_line(ckpt, args, message, capsys):
    from megatronapp.cli.main import main

    code = main(["generate", "--device", "cpu", "--load", ckpt, *args])  # in-process: nothing may launch
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and message in lines[0], err


@pytest.mark.parametrize(
    "command, gpus, extra, message",
    [
        (
            "generate",
            1,
            ["--nproc-per-node", "2", "--tensor-model-parallel-size", "2"],
            "tensor-parallel group [0, 1] would put ranks 0 and 1 on GPU 0 (1 visible)",
        ),
        ("generate", 0, [], "--device cuda requested but no GPU is visible"),
        (
            "scope",
            1,
            ["--nproc-per-node", "2", "--pipeline-model-parallel-size", "2"],
            "pipeline-parallel group [0, 1] would put ranks 0 and 1 on GPU 0 (1 visible)",
        ),
    ],
)
def test_cli_refuses_ranks_sharing_a_gpu_before_launch(ckpt, monkeypatch, capsys, command, gpus, extra, message):
    """Inference commands place ranks by the training rule and refuse what NCCL would refuse later."""
    from megatronapp.cli.main import main

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    argv = (
        ["generate", "--prompt", "hi"]
        if command == "generate"
        else ["scope", "capture", "--prompt", "hi", "--out", "unused.safetensors"]
    )
    code = main([*argv, "--device", "cuda", "--load", ckpt, *extra])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and message in lines[0], lines


def test_cli_json_tp2_matches_library(ckpt):
    res = _cli(
        [
            "--load",
            ckpt,
            "--prompt",
            "Hello",
            "--max-new-tokens",
            "6",
            "--json",
            "--nproc-per-node",
            "2",
            "--tensor-model-parallel-size",
            "2",
        ]
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    torch.set_num_threads(1)
    expected = generate(
        load_model(0, 1, 1, 1, ckpt), [list(b"Hello")], SamplingConfig(max_new_tokens=6), eod_id=EOD, vocab_size=VOCAB
    )
    assert out["tokens"] == expected.tokens and out["layout"].startswith("world=2 TP=2")


def test_static_cache_equals_dynamic_cache(ckpt):
    """The fixed-shape cache behind CUDA graphs (attention over every column, masked) decodes
    the same tokens; on CUDA the graph replays exactly this computation (tests/gpu/test_gpu.py)."""
    torch.set_num_threads(1)
    model = load_model(0, 1, 1, 1, ckpt)
    sampling = SamplingConfig(max_new_tokens=9)
    dynamic = generate(model, PROMPTS, sampling, eod_id=EOD, vocab_size=VOCAB)
    original_start = model.start
    model.start = lambda b, n, pad: original_start(b, n, pad, static=True)
    static = generate(model, PROMPTS, sampling, eod_id=EOD, vocab_size=VOCAB)
    assert model.cache.static and static.tokens == dynamic.tokens


def test_greedy_equals_transformers_on_hf_export(ckpt, tmp_path):
    """Our batched greedy output equals transformers' GPTNeoX generate on the exported model
    (left-padded batch with an attention mask on their side, both stopping at end-of-text)."""
    transformers = pytest.importorskip("transformers")
    from megatronapp.inference.reference import greedy_generate_from_checkpoint
    from megatronapp.interop.hf_checkpoint import export_hf

    torch.set_num_threads(1)
    export_hf(ckpt, tmp_path / "hf")
    hf = transformers.GPTNeoXForCausalLM.from_pretrained(tmp_path / "hf").eval()
    width = max(map(len, PROMPTS))
    ids = torch.full((len(PROMPTS), width), EOD)
    mask = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    for i, p in enumerate(PROMPTS):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=9, do_sample=False, pad_token_id=EOD)
    theirs = [row[: row.index(EOD)] if EOD in row else row for row in out[:, width:].tolist()]
    ours = greedy_generate_from_checkpoint(ckpt, PROMPTS, 9, eod_id=EOD, vocab_size=VOCAB)
    assert ours == theirs
