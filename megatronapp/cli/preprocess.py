"""`megatronapp preprocess-data`: JSONL documents -> Megatron indexed datasets (data/preprocess.py).

    megatronapp preprocess-data --input corpus.jsonl --output-prefix data/corpus \\
        [--json-keys text] [--tokenizer-model tokenizer.json | --tokenizer-type NullTokenizer --vocab-size N] \\
        [--append-eod] [--workers 4]

Flags default to None here so PreprocessConfig's defaults apply; every input error is one line
and exit code 2, before any output file exists.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from megatronapp.data.config import TOKENIZER_FLAGS
from megatronapp.data.preprocess import PreprocessConfig, preprocess_data
from megatronapp.files import check_writable_path
from megatronapp.flags import add_flags
from megatronapp.launch.flags import TOKENIZER_MODEL


def add_preprocess_subcommand(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "preprocess-data", help="tokenize JSONL into Megatron indexed datasets (PREFIX_KEY_document.bin/.idx)"
    )
    p.add_argument("--input", required=True, help="JSONL file, one JSON object per line")
    p.add_argument("--output-prefix", required=True, help="outputs are OUTPUT_PREFIX_KEY_document.bin/.idx")
    p.add_argument(
        "--json-keys", nargs="+", default=None, help=f"keys to tokenize (default: {PreprocessConfig.json_keys[0]})"
    )
    add_flags(p, (TOKENIZER_FLAGS[0], TOKENIZER_MODEL, TOKENIZER_FLAGS[1]))
    p.add_argument("--append-eod", action="store_true", default=None, help="end every document with the EOD token")
    p.add_argument(
        "--workers", type=int, default=None, help=f"tokenizing processes (default: {PreprocessConfig.workers})"
    )
    p.set_defaults(build_run=build_preprocess_run, launch=run_preprocess)


def build_preprocess_run(args: argparse.Namespace) -> PreprocessConfig:
    given = {
        name: getattr(args, name)
        for name in ("json_keys", "tokenizer_type", "tokenizer_model", "vocab_size", "append_eod", "workers")
        if getattr(args, name) is not None
    }
    if "json_keys" in given:
        given["json_keys"] = tuple(given["json_keys"])
    return PreprocessConfig(input=args.input, output_prefix=args.output_prefix, **given)


def check_preprocess_run(config: PreprocessConfig) -> None:
    """The output's folder exists or can be made, the tokenizer file exists (the config checked
    its input itself)."""
    check_writable_path(config.output_prefix, "--output-prefix")
    if config.tokenizer_model is not None and not Path(config.tokenizer_model).is_file():
        raise ValueError(f"--tokenizer-model {config.tokenizer_model} does not exist")


def run_preprocess(run: PreprocessConfig, argv: list[str]) -> int:
    started = time.perf_counter()
    try:
        counts = preprocess_data(run, show_progress=sys.stderr.isatty())
    except (ValueError, OSError) as exc:
        print(f"megatronapp: error: {exc}", file=sys.stderr)
        return 2
    for key, prefix in run.output_prefixes().items():
        print(f"{prefix}.bin/.idx: {counts[key]} documents (train with --data-path {prefix})")
    print(f"done in {time.perf_counter() - started:.1f} s")
    return 0
