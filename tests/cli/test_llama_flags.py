"""Megatron's Llama-family flags: they reach the model config, and bad combinations are
refused in one line before any rank starts."""

from __future__ import annotations

import pytest

from megatronapp.cli.args import build_job_config
from megatronapp.cli.main import build_parser


def _model(args: list[str], world: int = 1):
    parsed = build_parser().parse_args(["train", "--device", "cpu", *args])
    return build_job_config(parsed, world).model


def test_llama_flags_turn_the_gptneox_preset_into_a_llama():
    model = _model(
        [
            "--model",
            "tiny",
            "--normalization",
            "RMSNorm",
            "--norm-epsilon",
            "1e-6",
            "--swiglu",
            "--group-query-attention",
            "--num-query-groups",
            "2",
            "--disable-bias-linear",
            "--add-qkv-bias",
            "--tie-embeddings-and-output-weights",
            "--rotary-base",
            "500000",
        ]
    )
    assert (model.normalization, model.layernorm_epsilon, model.swiglu, model.num_query_groups) == (
        "RMSNorm",
        1e-6,
        True,
        2,
    )
    assert (model.add_bias_linear, model.add_qkv_bias, model.untie_embeddings_and_output_weights) == (
        False,
        True,
        False,
    )
    assert model.rotary_base == 500000.0


def test_presets_keep_their_family_unless_a_flag_says_otherwise():
    gptneox, llama = _model(["--model", "tiny"]), _model(["--model", "llama-tiny"])
    assert gptneox.untie_embeddings_and_output_weights and gptneox.query_groups == gptneox.num_attention_heads
    assert not llama.untie_embeddings_and_output_weights and llama.query_groups == 2
    assert _model(
        ["--model", "llama-tiny", "--untie-embeddings-and-output-weights"]
    ).untie_embeddings_and_output_weights
    assert _model(["--model", "llama-tiny", "--group-query-attention"]).num_query_groups == 2  # the preset's
    assert _model(["--model", "tiny", "--group-query-attention"]).num_query_groups == 1  # Megatron's default


def test_llama32_1b_preset_has_the_published_shape():
    m = _model(["--model", "llama3.2-1b"])
    shape = (m.num_layers, m.hidden_size, m.num_attention_heads, m.query_groups, m.ffn_size, m.rotary_base)
    assert shape == (16, 2048, 32, 8, 8192, 500000.0)
    assert (m.normalization, m.swiglu, m.add_bias_linear, m.untie_embeddings_and_output_weights) == (
        "RMSNorm",
        True,
        False,
        False,
    )
    # with Llama 3's 128256-id vocabulary: 1.236 B parameters, as published
    assert round(m.__class__(**{**m.__dict__, "vocab_size": 128256}).num_parameters() / 1e9, 3) == 1.236


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--model", "llama-tiny", "--tensor-model-parallel-size", "4", "--nproc-per-node", "4"],
            "num query groups 2 is not divisible by tensor-parallel size 4",
        ),
        (["--group-query-attention", "--num-query-groups", "3"], "num attention heads 4 is not divisible by num query"),
        (["--num-query-groups", "2"], "--num-query-groups needs --group-query-attention"),
        (
            [
                "--model",
                "llama-tiny",
                "--forward-backward-disaggregating",
                "--nproc-per-node",
                "5",
                "--forward-tensor-model-parallel-size",
                "4",
            ],
            "num query groups 2 is not divisible by forward tensor-parallel size 4",
        ),
        (["--normalization", "BatchNorm"], "argument --normalization: invalid choice: 'BatchNorm'"),
    ],
)
def test_bad_llama_flags_fail_before_launch(args, message, train_before_launch):
    code, lines = train_before_launch(args)
    assert code == 2 and len(lines) == 1 and message in lines[0], lines
