"""A checkpoint of any TP x PP layout as one full model in one process: load, logits, save.

For tools that read or convert a trained model rather than train it (Hugging Face
export/import, MegaScope):

    chunks = load_full_model("ckpt", device="cpu")       # SAVE dir (with `latest`) or an iter_ folder
    logits = compute_logits(chunks, tokens)              # (B, S) ids -> (B, S, padded vocab)
    save_full_checkpoint("ckpt2", chunks)                # iteration 0, one shard, loads under any layout

The model is built with TP 1 and one pipeline chunk, so no process group is needed; its
parameters are the checkpoint's full tensors (TP shards concatenated along their split dim).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, fields
from pathlib import Path

import torch

from megatronapp.config import ConfigError, ModelConfig, TrainConfig
from megatronapp.engine.checkpoint import _atomic_torch_save, _ShardReader, find_latest
from megatronapp.engine.checkpoint_files import read_checkpoint_meta
from megatronapp.files import write_text_atomic
from megatronapp.model.gpt import GPTChunk, TPContext, build_model_chunks
from megatronapp.parallel.layout import ParallelLayout


def resolve_checkpoint_folder(path: str | os.PathLike) -> Path:
    """An iter_XXXXXXX folder: `path` itself when it holds meta.json, else the one `latest` names."""
    path = Path(path)
    if (path / "meta.json").is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    folder = find_latest(path)
    if not (folder / "meta.json").is_file():
        raise FileNotFoundError(f"checkpoint {folder} has no meta.json")
    return folder


def load_model_config(folder: Path) -> ModelConfig:
    """The ModelConfig saved in `folder`/meta.json; fields this version does not know are an error."""
    saved = read_checkpoint_meta(folder)["model"]
    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(saved) - known)
    if unknown:
        raise ConfigError(f"checkpoint {folder} has model fields this version does not know: {', '.join(unknown)}")
    return ModelConfig(**saved)


def load_full_state(folder: Path) -> dict[str, torch.Tensor]:
    """Every parameter of the checkpoint as a full tensor, keyed by its layout-independent name.

    Under bf16/fp16 training the fp32 main params (saved with the optimizer state) are the
    model, as in load_checkpoint; the low-precision copies are only their rounding.
    """
    reader = _ShardReader(folder)
    names = [name for pp in range(reader.pp_size) for name in reader._shard(0, pp)["params"]]
    state = {}
    for name in names:
        has_main = reader.has_optim_state(name) and "main_param" in reader.optim_keys(name)
        state[name] = reader.full(name, "optim", "main_param") if has_main else reader.full(name, "params")
    return state


def load_full_model(ckpt: str | os.PathLike, device: str | torch.device = "cpu") -> list[GPTChunk]:
    """The whole model of a checkpoint (any saved layout) as one-process chunks, in eval mode."""
    folder = resolve_checkpoint_folder(ckpt)
    cfg = load_model_config(folder)
    return build_full_model(cfg, load_full_state(folder), device)


def build_full_model(
    cfg: ModelConfig, state: dict[str, torch.Tensor], device: str | torch.device = "cpu"
) -> list[GPTChunk]:
    """One-process chunks of `cfg` holding the full tensors of `state` (names and shapes must match)."""
    chunks = build_model_chunks(
        cfg, pp_rank=0, pp_size=1, num_chunks=1, tp=TPContext(None, 1, 0), seed=0, device=device
    )
    params = {name: p for c in chunks for name, p in c.named_parameters()}
    missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint tensors do not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    with torch.no_grad():
        for name, p in params.items():
            if tuple(state[name].shape) != tuple(p.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(state[name].shape)} != model {tuple(p.shape)}")
            p.copy_(state[name])
    for c in chunks:
        c.eval()
    return chunks


@torch.no_grad()
def compute_logits(chunks: list[GPTChunk], tokens: torch.Tensor) -> torch.Tensor:
    """Full-sequence logits (B, S, padded vocab) of one-process chunks (TP 1) for ids (B, S).

    No dropout key is passed, so no hidden dropout; put the chunks in eval mode (as
    load_full_model does) to turn attention dropout off too.
    """
    last = chunks[-1]
    if not last.has_head or last.tp.size != 1:
        raise ValueError("compute_logits needs one-process chunks ending with the output head (TP 1)")
    x = tokens
    for chunk in chunks:
        x = chunk(x)  # hidden states (B, S, H); the head chunk returns logits when given no labels
    return x


def save_full_checkpoint(save_dir: str | os.PathLike, chunks: list[GPTChunk], *, seed: int = 1234) -> Path:
    """Write one-process `chunks` as an iteration-0 checkpoint in the engine's format.

    One shard (tp0, pp0) with each tensor's TP split dim, no optimizer state (the first
    step initialises it) and a data position of 0; `latest` is written last, every file
    atomically. `megatronapp train --load` resumes from it under any layout.
    """
    cfg = chunks[0].cfg
    folder = Path(save_dir) / f"iter_{0:07d}"
    folder.mkdir(parents=True, exist_ok=True)
    meta = {
        "iteration": 0,
        "layout": asdict(ParallelLayout(world_size=1)),
        "model": asdict(cfg),
        "train": asdict(TrainConfig(seed=seed)),
    }
    named = {name: p for c in chunks for name, p in c.named_parameters()}
    shard = {
        "params": {n: p.detach().cpu().contiguous() for n, p in named.items()},
        "split": {n: p.tp_split_dim for n, p in named.items()},
        "optim": {},
    }
    files = {"model_tp0_pp0.pt": _atomic_torch_save(shard, folder / "model_tp0_pp0.pt")}
    rng = {
        "torch": torch.Generator().manual_seed(seed).get_state(),
        "python": random.Random(seed).getstate()[1],
        "cuda": None,
    }
    files["rank00000.pt"] = _atomic_torch_save({"rng": rng, "data": {"consumed_samples": 0}}, folder / "rank00000.pt")
    write_text_atomic(folder / "meta.json", json.dumps({**meta, "files": files}, indent=1))
    write_text_atomic(Path(save_dir) / "latest", "0")
    return folder
