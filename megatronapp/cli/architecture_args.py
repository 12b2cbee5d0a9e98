"""`megatronapp train`'s flags for the transformer's family, Megatron-LM's names: the GPT-NeoX
family is ModelConfig's default, the Llama family the llama presets'. Each defaults to None, so
the preset's value applies unless the flag is given (cli/args.py passes the given ones on)."""

from __future__ import annotations

import argparse

from megatronapp.config import MODEL_PRESETS, NORMALIZATIONS, ConfigError


def add_architecture_arguments(g) -> None:
    """Megatron's flags for the transformer's family (GPT-NeoX: the defaults; Llama: the llama presets)."""
    g.add_argument("--normalization", choices=NORMALIZATIONS, default=None, help="default: the preset's")
    g.add_argument(
        "--norm-epsilon",
        dest="layernorm_epsilon",
        metavar="EPS",
        type=float,
        default=None,
        help="default: the preset's",
    )
    g.add_argument("--swiglu", action="store_true", default=None, help="SwiGLU MLP instead of GeLU")
    g.add_argument(
        "--group-query-attention",
        action="store_true",
        help="grouped-query attention: --num-query-groups key/value heads (default 1)",
    )
    g.add_argument("--num-query-groups", type=int, default=None, help="with --group-query-attention")
    g.add_argument(
        "--disable-bias-linear", dest="add_bias_linear", action="store_false", default=None, help="no linear biases"
    )
    g.add_argument("--add-qkv-bias", action="store_true", default=None, help="a QKV bias even without linear biases")
    g.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        default=None,
        help="separate output layer (default for the GPT-NeoX presets)",
    )
    g.add_argument(
        "--tie-embeddings-and-output-weights",
        dest="untie_embeddings_and_output_weights",
        action="store_false",
        default=None,
        help="the output layer is the input embedding (default for the llama presets)",
    )
    g.add_argument("--rotary-base", type=float, default=None, help="default: the preset's")


def compute_query_groups_override(args: argparse.Namespace) -> dict:
    """{"num_query_groups": N} as Megatron reads --group-query-attention / --num-query-groups:
    the given N, else the preset's groups, else 1; {} without grouped-query attention."""
    if args.num_query_groups is not None and not args.group_query_attention:
        raise ConfigError("--num-query-groups needs --group-query-attention")
    if not args.group_query_attention:
        return {}
    return {"num_query_groups": args.num_query_groups or MODEL_PRESETS[args.model].num_query_groups or 1}
