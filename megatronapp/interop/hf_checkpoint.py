"""`export_hf` / `import_hf`: an engine checkpoint <-> a Hugging Face GPTNeoXForCausalLM,
LlamaForCausalLM or Qwen2ForCausalLM folder (the model's family picks the format: hf_gptneox.py,
hf_llama.py).

Both check everything (config, tokenizer, every weight's name and shape) before the first
file is written, so a refused conversion leaves nothing behind; every file is written to a
temp name and renamed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from megatronapp.config import ModelConfig
from megatronapp.data.tokenizer import ByteTokenizer, HFTokenizer
from megatronapp.engine.full_model import (
    build_full_model,
    load_full_state,
    load_model_config,
    resolve_checkpoint_folder,
    save_full_checkpoint,
)
from megatronapp.files import write_text_atomic
from megatronapp.interop import hf_gptneox, hf_llama
from megatronapp.interop.hf_gptneox import InteropError, load_hf_tensors, save_hf_tensors
from megatronapp.interop.hf_tokenizer import compute_tokenizer_files, describe_hf_tokenizer


def _write_text_files(out: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        write_text_atomic(out / name, text)


def _tokenizer_files(root: Path, tokenizer_model: str | None, cfg: ModelConfig) -> tuple[dict, int | None, list]:
    """(tokenizer files, end-of-document id, warnings) for a checkpoint whose SAVE folder is `root`.

    The checkpoint does not record its tokenizer, so: --tokenizer-model when given, else a
    tokenizer.json next to the checkpoint (import puts one there), else the byte tokenizer
    when the vocabulary is its 257 ids.
    """
    path = tokenizer_model or (root / "tokenizer.json" if (root / "tokenizer.json").is_file() else None)
    if path is not None:
        text, eod_token, tok = describe_hf_tokenizer(path)
        if tok.vocab_size != cfg.vocab_size:
            raise InteropError(
                f"tokenizer {tok.path} has {tok.vocab_size} ids but the checkpoint was trained "
                f"with vocab_size {cfg.vocab_size}"
            )
        return compute_tokenizer_files(text, eod_token, cfg.seq_length), tok.eod_id, []
    if cfg.vocab_size == ByteTokenizer().vocab_size:
        return compute_tokenizer_files(None, None, cfg.seq_length), ByteTokenizer.EOD_ID, []
    return (
        {},
        None,
        [
            f"no tokenizer files written: vocab_size {cfg.vocab_size} is not the byte tokenizer's "
            "and no tokenizer.json was found; pass --tokenizer-model"
        ],
    )


def export_hf(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    *,
    tokenizer_model: str | None = None,
    dtype: torch.dtype | None = None,
) -> list[str]:
    """Write `out`/config.json, model.safetensors and tokenizer files from a checkpoint of any
    layout (a SAVE folder or one iter_ folder). Returns warnings (e.g. no tokenizer)."""
    folder = resolve_checkpoint_folder(ckpt)
    cfg = load_model_config(folder)
    state = load_full_state(folder)
    dtype = dtype or next(iter(state.values())).dtype
    if hf_llama.llama_family(cfg):
        tensors = hf_llama.convert_to_hf_tensors(state, cfg, dtype)
    else:
        hf_gptneox.check_exportable(cfg)
        tensors = hf_gptneox.convert_to_hf_tensors(state, cfg.num_layers, dtype)
    tok_files, eos_id, warnings = _tokenizer_files(folder.parent, tokenizer_model, cfg)
    family = hf_llama if hf_llama.llama_family(cfg) else hf_gptneox
    config = family.compute_hf_config(cfg, eos_id=eos_id, dtype=dtype)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InteropError(f"--out {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    save_hf_tensors(tensors, out)
    _write_text_files(out, {"config.json": json.dumps(config, indent=2), **tok_files})
    return warnings


def read_hf_config(src: Path) -> dict:
    if not src.is_dir():
        raise FileNotFoundError(f"Hugging Face model directory not found: {src}")
    path = src / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {src}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise InteropError(f"{path} is not valid JSON: {exc}") from None


def import_hf(src: str | os.PathLike, save: str | os.PathLike) -> ModelConfig:
    """Write an iteration-0 engine checkpoint in `save` from a GPT-NeoX, Llama or Qwen2 folder;
    returns its config.

    The folder's tokenizer.json, if any, sets the unpadded vocabulary and is copied to
    `save`/tokenizer.json (train with --tokenizer-model pointing at it).
    """
    src, save = Path(src), Path(save)
    hf = read_hf_config(src)
    tok_path = src / "tokenizer.json" if (src / "tokenizer.json").is_file() else None
    llama = hf.get("model_type") in hf_llama.HF_ARCHITECTURES
    family = hf_llama if llama else hf_gptneox
    cfg = family.compute_model_config(hf, HFTokenizer(tok_path).vocab_size if tok_path else None)
    if (save / "latest").exists():
        raise InteropError(f"--save {save} already holds a checkpoint (found 'latest'); choose an empty directory")
    tensors = load_hf_tensors(src)
    state = family.convert_from_hf_tensors(tensors, cfg if llama else cfg.num_layers)
    try:
        chunks = build_full_model(cfg, state)
    except ValueError as exc:
        raise InteropError(str(exc)) from None
    save.mkdir(parents=True, exist_ok=True)
    if tok_path:
        _write_text_files(save, {"tokenizer.json": tok_path.read_text()})
    save_full_checkpoint(save, chunks)
    return cfg
