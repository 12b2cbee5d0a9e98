"""`megatronapp export hf` and `megatronapp import hf`.

    megatronapp export hf --load CKPT --out DIR [--tokenizer-model tokenizer.json] [--dtype bfloat16]
    megatronapp import hf --from DIR --save CKPT

The top-level CLI calls `add_interop_subcommands(subparsers)`; every leaf parser sets `func`,
which takes the parsed namespace and returns the exit code (2 with one line on stderr for
anything that cannot be converted, before any file is written).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from megatronapp.config import MODEL_PRESETS, ConfigError, ModelConfig

# ModelConfig fields `megatronapp train` sets from flags (cli/args.py); the others come from
# its defaults, so an imported checkpoint that differs there needs a warning.
_TRAIN_FLAGS = {
    "num_layers": "--num-layers",
    "hidden_size": "--hidden-size",
    "num_attention_heads": "--num-attention-heads",
    "ffn_hidden_size": "--ffn-hidden-size",
    "seq_length": "--seq-length",
    "make_vocab_size_divisible_by": "--make-vocab-size-divisible-by",
    "hidden_dropout": "--hidden-dropout",
    "attention_dropout": "--attention-dropout",
    "normalization": "--normalization",
    "layernorm_epsilon": "--norm-epsilon",
    "num_query_groups": "--num-query-groups",
    "rotary_base": "--rotary-base",
}
# boolean fields: the flag that sets each value
_TRAIN_SWITCHES = {
    "swiglu": {True: "--swiglu"},
    "add_bias_linear": {False: "--disable-bias-linear"},
    "add_qkv_bias": {True: "--add-qkv-bias"},
    "untie_embeddings_and_output_weights": {
        True: "--untie-embeddings-and-output-weights",
        False: "--tie-embeddings-and-output-weights",
    },
}


def add_interop_subcommands(sub: argparse._SubParsersAction) -> None:
    export = sub.add_parser("export", help="write a checkpoint in another framework's format")
    formats = export.add_subparsers(dest="format", required=True)
    hf = formats.add_parser(
        "hf",
        help="Hugging Face folder (config.json, model.safetensors): GPTNeoXForCausalLM, or for the Llama "
        "family LlamaForCausalLM / Qwen2ForCausalLM (with a QKV bias and no other)",
    )
    hf.add_argument("--load", required=True, help="checkpoint folder (with 'latest') or one iter_ folder")
    hf.add_argument("--out", required=True, help="output folder")
    hf.add_argument(
        "--tokenizer-model",
        default=None,
        help="tokenizer.json the run trained with (default: one next to the checkpoint, else bytes)",
    )
    hf.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default=None, help="weight dtype (default: as stored)"
    )
    hf.set_defaults(func=run_export_hf)

    imp = sub.add_parser("import", help="write an engine checkpoint from another framework's model")
    formats = imp.add_subparsers(dest="format", required=True)
    hf = formats.add_parser("hf", help="Hugging Face GPT-NeoX, Llama or Qwen2 folder the engine's GPT can express")
    hf.add_argument("--from", dest="src", required=True, help="folder with config.json and model.safetensors")
    hf.add_argument("--save", required=True, help="checkpoint folder to create (must not hold one)")
    train = sub.choices.get("train")  # registered first by cli/main.py; its flags make the printed hint
    known = {s for a in train._actions for s in a.option_strings} if train else set()
    hf.set_defaults(func=run_import_hf, train_flags=known, train_preset=train.get_default("model") if train else None)


def _fail(exc: Exception) -> int:
    print(f"megatronapp: error: {exc}", file=sys.stderr)
    return 2


def run_export_hf(args: argparse.Namespace) -> int:
    from megatronapp.interop.hf_checkpoint import export_hf
    from megatronapp.interop.hf_gptneox import parse_dtype

    try:
        warnings = export_hf(args.load, args.out, tokenizer_model=args.tokenizer_model, dtype=parse_dtype(args.dtype))
    except (ConfigError, ValueError, FileNotFoundError) as exc:  # InteropError is a ValueError
        return _fail(exc)
    for w in warnings:
        print(f"megatronapp: warning: {w}", file=sys.stderr)
    architecture = json.loads((Path(args.out) / "config.json").read_text())["architectures"][0]
    print(f"wrote {args.out}: load it with transformers.{architecture}.from_pretrained({str(args.out)!r})")
    return 0


def compute_train_hint(
    cfg: ModelConfig, save: str, has_tokenizer: bool, train_flags: set[str], train_preset: str | None
) -> tuple[str, list[str]]:
    """(the `megatronapp train` command that rebuilds `cfg` with the flags it has, the fields
    no flag sets that differ from those of the preset `train` starts from)."""
    settable = {name: flag for name, flag in _TRAIN_FLAGS.items() if flag in train_flags and hasattr(cfg, name)}
    flags = [f"{flag} {getattr(cfg, name)}" for name, flag in settable.items() if getattr(cfg, name) is not None]
    if cfg.num_query_groups is not None and "--num-query-groups" in settable.values():
        flags.append("--group-query-attention")
    for name, by_value in _TRAIN_SWITCHES.items():
        flag = by_value.get(getattr(cfg, name))
        if flag in train_flags:
            flags.append(flag)
            settable[name] = flag
    if has_tokenizer:
        flags.append(f"--tokenizer-model {save}/tokenizer.json")
    default = MODEL_PRESETS.get(train_preset) or ModelConfig()
    unsettable = [
        f"{f.name}={getattr(cfg, f.name)}"
        for f in fields(ModelConfig)
        if f.name not in settable and f.name != "vocab_size" and getattr(cfg, f.name) != getattr(default, f.name)
    ]
    return f"megatronapp train --load {save} " + " ".join(flags), unsettable


def run_import_hf(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megatronapp.interop.hf_checkpoint import import_hf

    try:
        cfg = import_hf(args.src, args.save)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        return _fail(exc)
    hint, unsettable = compute_train_hint(
        cfg, args.save, (Path(args.save) / "tokenizer.json").is_file(), args.train_flags, args.train_preset
    )
    if unsettable:
        print(
            f"megatronapp: warning: {', '.join(unsettable)} differ from the train defaults and have no "
            "`megatronapp train` flag",
            file=sys.stderr,
        )
    print(f"wrote {args.save}/iter_0000000 ({cfg.num_parameters():,} parameters); continue training with:\n  {hint}")
    return 0
