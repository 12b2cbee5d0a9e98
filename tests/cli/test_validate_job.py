"""job.validate_job directly, one rule at a time: each case changes one thing of a job that
passes, and must be refused with that rule's one-line message (the CLI end-to-end cases in
test_cli.py check that the command line reaches it before launching anything)."""

from __future__ import annotations

import pytest

from megatronapp import job as job_ops
from megatronapp.config import ConfigError, JobConfig, ModelConfig
from megatronapp.job import validate_job
from megatronapp.parallel.layout import ParallelLayout

# 8 layers, 4 heads, hidden 64 (ffn 256), vocab padded to 128: fits TP 1/2/4, PP 1/2/4
MODEL = dict(
    num_layers=8,
    hidden_size=64,
    num_attention_heads=4,
    vocab_size=100,
    seq_length=32,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
TRAIN = dict(micro_batch_size=1, global_batch_size=8)
LAYOUT = dict(world_size=8, tp_size=2, pp_size=2)


def build_job(model=None, train=None, layout=None) -> JobConfig:
    """`train`: fields of any of the job's component configs (train, optimizer, precision, ...)."""
    return job_ops.build_job(
        ModelConfig(**{**MODEL, **(model or {})}),
        ParallelLayout(**{**LAYOUT, **(layout or {})}),
        **{**TRAIN, **(train or {})},
    )


BF16_FP8 = dict(bf16=True, fp8_format="e4m3")

RULES = [
    (
        "heads",
        dict(layout=dict(world_size=8, tp_size=8, pp_size=1), model=dict(num_attention_heads=4)),
        "num attention heads 4 is not divisible by tensor-parallel size 8",
    ),
    ("ffn", dict(model=dict(ffn_hidden_size=255)), "ffn hidden size 255 is not divisible by tensor-parallel size 2"),
    (
        "vocab",
        dict(model=dict(vocab_size=101, make_vocab_size_divisible_by=1)),
        "padded vocab size 101 is not divisible by tensor-parallel size 2",
    ),
    (
        "layers",
        dict(layout=dict(world_size=8, tp_size=1, pp_size=8), model=dict(num_layers=12)),
        "num layers 12 is not divisible by pipeline-parallel size 8 x virtual stages 1",
    ),
    (
        "layers x virtual",
        dict(layout=dict(virtual_pp_size=3), train=dict(schedule="interleaved")),
        "num layers 8 is not divisible by pipeline-parallel size 2 x virtual stages 3",
    ),
    (
        "batch",
        dict(train=dict(global_batch_size=6, micro_batch_size=2)),
        "global batch size 6 is not divisible by micro batch size 2 x data-parallel size 2",
    ),
    (
        "sp needs tp",
        dict(train=dict(sequence_parallel=True), layout=dict(tp_size=1)),
        "--sequence-parallel needs tensor-parallel size > 1",
    ),
    (
        "sp seq",
        dict(train=dict(sequence_parallel=True), model=dict(seq_length=33)),
        "--sequence-parallel needs seq length 33 divisible by tensor-parallel size 2",
    ),
    (
        "fp8 tokens",
        dict(train=dict(**BF16_FP8), model=dict(seq_length=24)),
        "--fp8-format needs tokens per microbatch (micro batch size x seq length) (24) to be a multiple of 16",
    ),
    (
        "fp8 hidden",
        dict(train=dict(**BF16_FP8), model=dict(hidden_size=72, num_attention_heads=4, ffn_hidden_size=256)),
        "--fp8-format needs hidden size (72) to be a multiple of 16",
    ),
    (
        "fp8 hidden/tp",
        dict(
            train=dict(**BF16_FP8),
            model=dict(hidden_size=48, num_attention_heads=4, ffn_hidden_size=256),
            layout=dict(world_size=4, tp_size=4, pp_size=1),
        ),
        "--fp8-format needs hidden size / tensor-parallel size (12) to be a multiple of 16",
    ),
    (
        "fp8 ffn/tp",
        dict(train=dict(**BF16_FP8), model=dict(ffn_hidden_size=48)),
        "--fp8-format needs ffn hidden size / tensor-parallel size (24) to be a multiple of 16",
    ),
    (
        "fp8 layers",
        dict(
            train=dict(
                **BF16_FP8, first_last_layers_bf16=True, num_layers_at_start_in_bf16=4, num_layers_at_end_in_bf16=4
            )
        ),
        "leave none of the 8 layers in FP8",
    ),
    (
        "overlap update",
        dict(train=dict(bf16=True, overlap_param_update=True, use_distributed_optimizer=True)),
        "--overlap-param-update with --use-distributed-optimizer needs DP 1",
    ),
    (
        "virtual schedule",
        dict(layout=dict(virtual_pp_size=2), train=dict(schedule="1f1b")),
        "virtual pipeline stages need the interleaved, interleaved-zb, looped-bfs or dynamic schedule, not '1f1b'",
    ),
    (
        "interleaved stages",
        dict(train=dict(schedule="interleaved")),
        "the interleaved schedule needs --num-layers-per-virtual-pipeline-stage giving >= 2 virtual stages",
    ),
    (
        "interleaved microbatches",
        dict(
            layout=dict(virtual_pp_size=2, world_size=4, tp_size=1, pp_size=4),
            train=dict(schedule="interleaved", global_batch_size=6),
        ),
        "interleaved schedule needs the number of microbatches (6) to be a multiple of pipeline-parallel size 4",
    ),
]


def test_the_base_job_and_each_rule_boundary_pass():
    validate_job(build_job())
    validate_job(build_job(train=dict(sequence_parallel=True)))
    validate_job(build_job(train=dict(**BF16_FP8)))
    validate_job(build_job(layout=dict(virtual_pp_size=2), train=dict(schedule="interleaved")))
    validate_job(
        build_job(
            train=dict(bf16=True, overlap_param_update=True, use_distributed_optimizer=True), layout=dict(world_size=4)
        )
    )  # DP 1


@pytest.mark.parametrize("changes, message", [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_each_rule_refuses_in_one_line(changes, message):
    job = build_job(**changes)
    with pytest.raises(ConfigError) as refused:
        validate_job(job)
    assert message in str(refused.value) and "\n" not in str(refused.value)
