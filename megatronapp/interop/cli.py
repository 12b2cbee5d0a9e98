"""`megatronapp export hf` and `megatronapp import hf`.

    megatronapp export hf --load CKPT --out DIR [--tokenizer-model tokenizer.json] [--dtype bfloat16]
    megatronapp import hf --from DIR --save CKPT

The top-level CLI calls `add_interop_subcommands(subparsers)`; every leaf parser sets `build_run`
(parsed flags -> ExportRun / ImportRun) and `launch`; cli/validate.py checks the run in between
(the checkpoint's files, the folders), and anything that cannot be converted is one line on
stderr and exit code 2, before any file is written.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, fields
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


@dataclass(frozen=True)
class ExportRun:
    load: str
    out: str
    tokenizer_model: str | None = None
    dtype: str | None = None  # None: as stored


@dataclass(frozen=True)
class ImportRun:
    src: str
    save: str
    train_flags: frozenset[str] = frozenset()  # `train`'s options: those the printed hint may use
    train_preset: str | None = None  # the model preset `train` starts from


def check_export_run(run: ExportRun) -> None:
    """The checkpoint's files whole (sizes and checksums), the tokenizer file, OUT not a file."""
    from megatronapp.engine.checkpoint_files import verify_checkpoint_files
    from megatronapp.engine.full_model import resolve_checkpoint_folder

    verify_checkpoint_files(resolve_checkpoint_folder(run.load))
    if run.tokenizer_model is not None and not Path(run.tokenizer_model).is_file():
        raise FileNotFoundError(f"--tokenizer-model {run.tokenizer_model} does not exist")
    if Path(run.out).is_file():
        raise ValueError(f"--out {run.out} is a file; give a folder")


def check_import_run(run: ImportRun) -> None:
    """The Hugging Face folder holds its config; SAVE is not a file (import_hf then checks what
    the config asks of the engine, and the weights, before it writes anything)."""
    if not (Path(run.src) / "config.json").is_file():
        raise FileNotFoundError(f"--from {run.src}: config.json not found")
    if Path(run.save).is_file():
        raise ValueError(f"--save {run.save} is a file; give a folder")


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
    hf.set_defaults(build_run=lambda a: ExportRun(a.load, a.out, a.tokenizer_model, a.dtype), launch=run_export_hf)

    imp = sub.add_parser("import", help="write an engine checkpoint from another framework's model")
    formats = imp.add_subparsers(dest="format", required=True)
    hf = formats.add_parser("hf", help="Hugging Face GPT-NeoX, Llama or Qwen2 folder the engine's GPT can express")
    hf.add_argument("--from", dest="src", required=True, help="folder with config.json and model.safetensors")
    hf.add_argument("--save", required=True, help="checkpoint folder to create (must not hold one)")
    train = sub.choices.get("train")  # registered first by cli/main.py; its flags make the printed hint
    known = {s for a in train._actions for s in a.option_strings} if train else set()
    preset = train.get_default("model") if train else None
    hf.set_defaults(build_run=lambda a: ImportRun(a.src, a.save, frozenset(known), preset), launch=run_import_hf)


def _fail(exc: Exception) -> int:
    print(f"megatronapp: error: {exc}", file=sys.stderr)
    return 2


def run_export_hf(run: ExportRun, argv: list[str]) -> int:
    from megatronapp.interop.hf_checkpoint import export_hf
    from megatronapp.interop.hf_gptneox import parse_dtype

    try:
        warnings = export_hf(run.load, run.out, tokenizer_model=run.tokenizer_model, dtype=parse_dtype(run.dtype))
    except (ConfigError, ValueError, FileNotFoundError) as exc:  # InteropError is a ValueError
        return _fail(exc)
    for w in warnings:
        print(f"megatronapp: warning: {w}", file=sys.stderr)
    architecture = json.loads((Path(run.out) / "config.json").read_text())["architectures"][0]
    print(f"wrote {run.out}: load it with transformers.{architecture}.from_pretrained({str(run.out)!r})")
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


def run_import_hf(run: ImportRun, argv: list[str]) -> int:
    from megatronapp.interop.hf_checkpoint import import_hf

    try:
        cfg = import_hf(run.src, run.save)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        return _fail(exc)
    hint, unsettable = compute_train_hint(
        cfg, run.save, (Path(run.save) / "tokenizer.json").is_file(), set(run.train_flags), run.train_preset
    )
    if unsettable:
        print(
            f"megatronapp: warning: {', '.join(unsettable)} differ from the train defaults and have no "
            "`megatronapp train` flag",
            file=sys.stderr,
        )
    print(f"wrote {run.save}/iter_0000000 ({cfg.num_parameters():,} parameters); continue training with:\n  {hint}")
    return 0
