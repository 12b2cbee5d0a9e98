"""Checkpoints that resume exactly and load under any other TP x PP x DP layout.

Layout on disk (one folder per saved iteration):

    SAVE/latest                      text: the newest complete iteration (written last)
    SAVE/iter_0000020/meta.json      iteration, job config, layout
    SAVE/iter_0000020/model_tp{t}_pp{p}.pt   params + AdamW state of one (tp, pp) shard,
                                     keyed by layout-independent names, with each tensor's
                                     tp split dim (written by DP rank 0 only); the optimizer
                                     state is whole along DP (the distributed optimizer's
                                     shards are gathered first), plus the fp32 main params
                                     under bf16/fp16 and the loss-scaler state
    SAVE/iter_0000020/rank{r:05d}.pt RNG states and data position of one rank

Loading under the same layout reads one shard; under another layout every shard holding
a needed name is read (memory-mapped), full tensors are re-assembled along their split dim
and sliced for the new TP rank. Every file is written to a temp name and renamed.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from megatronapp.files import atomic_path, write_text_atomic
from megatronapp.parallel.fp8 import delayed_state_dict, load_delayed_state_dict


def _atomic_torch_save(obj, path: Path) -> None:
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


def _barrier(group) -> None:
    """Barrier over the layout's ranks (groups.world); a single process has none."""
    if group is not None and dist.is_initialized():
        dist.barrier(group=group)


def _named_params(chunks) -> dict:
    return {name: p for c in chunks for name, p in c.named_parameters()}


def gather_shard_state(trainer) -> dict:
    """This rank's (tp, pp) shard: params, optimizer state and tp split dim by layout-independent
    name, the optimizer's own state and the FP8 states. Collective over DP (the distributed
    optimizer gathers its shards)."""
    param_state = trainer.optimizer.param_state()
    params, split, optim = {}, {}, {}
    for name, p in _named_params(trainer.chunks).items():
        params[name] = p.detach().cpu()
        split[name] = p.tp_split_dim
        if p in param_state:
            optim[name] = {k: v.cpu() if torch.is_tensor(v) else v for k, v in param_state[p].items()}
    return {
        "params": params,
        "split": split,
        "optim": optim,
        "optimizer": trainer.optimizer.state_dict(),
        "fp8": delayed_state_dict(trainer.fp8_states),
    }


def save_checkpoint(save_dir: str | os.PathLike, trainer, data) -> Path:
    """Collective: every rank calls it after the same optimizer step."""
    g, it = trainer.groups, trainer.iteration
    folder = Path(save_dir) / f"iter_{it:07d}"
    if g.rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        job = trainer.job  # the settings beside the model are a record only: a resume takes its own flags
        meta = {
            "iteration": it,
            "layout": asdict(job.layout),
            "model": asdict(job.model),
            **{name: asdict(getattr(job, name)) for name in ("train", "optimizer", "precision")},
        }
        write_text_atomic(folder / "meta.json", json.dumps(meta, indent=1))
    _barrier(g.world)
    state = gather_shard_state(trainer)
    if g.dp_rank == 0:
        _atomic_torch_save(state, folder / f"model_tp{g.tp_rank}_pp{g.pp_rank}.pt")
    rng = {
        "torch": torch.get_rng_state(),
        "python": random.getstate()[1],
        "cuda": torch.cuda.get_rng_state() if trainer.device.type == "cuda" else None,
        "tracker": trainer.rng_tracker.get_states(),
    }
    _atomic_torch_save({"rng": rng, "data": data.state_dict()}, folder / f"rank{g.rank:05d}.pt")
    _barrier(g.world)
    if g.rank == 0:
        write_text_atomic(Path(save_dir) / "latest", str(it))
    _barrier(g.world)  # every rank returns with the checkpoint complete: any rank may load it next
    return folder


def find_latest(load_dir: str | os.PathLike) -> Path:
    marker = Path(load_dir) / "latest"
    if not marker.is_file():
        raise FileNotFoundError(f"no complete checkpoint in {load_dir} (missing 'latest')")
    return Path(load_dir) / f"iter_{int(marker.read_text().strip()):07d}"


class _ShardReader:
    """Full tensors by name from the shards of a saved layout (memory-mapped)."""

    def __init__(self, folder: Path):
        self.folder = folder
        meta = json.loads((folder / "meta.json").read_text())
        self.tp_size = meta["layout"]["tp_size"]
        self.pp_size = meta["layout"]["pp_size"]
        self._shards = {}

    def _shard(self, tp: int, pp: int) -> dict:
        if (tp, pp) not in self._shards:
            path = self.folder / f"model_tp{tp}_pp{pp}.pt"
            self._shards[(tp, pp)] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return self._shards[(tp, pp)]

    def _find_pp(self, name: str) -> int:
        for pp in range(self.pp_size):
            if name in self._shard(0, pp)["params"]:
                return pp
        raise KeyError(f"parameter {name} not found in checkpoint {self.folder}")

    def has_optim_state(self, name: str) -> bool:
        return name in self._shard(0, self._find_pp(name))["optim"]

    def optim_keys(self, name: str) -> tuple[str, ...]:
        return tuple(self._shard(0, self._find_pp(name))["optim"][name])

    def optimizer_state(self) -> dict:
        return self._shard(0, 0).get("optimizer", {})

    def fp8_states(self) -> dict:
        """The delayed FP8 recipe's states of every stage (equal over TP: tp 0's serve)."""
        found = {}
        for pp in range(self.pp_size):
            found.update(self._shard(0, pp).get("fp8", {}))
        return found

    def local(self, name: str, field: str, key: str | None, tp_size: int, tp_rank: int):
        """The tensor TP rank `tp_rank` of `tp_size` holds (re-assembled, then sliced)."""
        full = self.full(name, field, key)
        return (
            full
            if key == "step"
            else _slice(full, self._shard(0, self._find_pp(name))["split"][name], tp_size, tp_rank)
        )

    def full(self, name: str, field: str, key: str | None = None):
        pp = self._find_pp(name)
        parts = []
        for tp in range(self.tp_size):
            shard = self._shard(tp, pp)
            value = shard[field][name] if key is None else shard[field][name][key]
            parts.append(value)
        dim = self._shard(0, pp)["split"][name]
        if key == "step":
            return parts[0]
        return parts[0] if dim is None else torch.cat(parts, dim=dim)


def _slice(full: torch.Tensor, dim: int | None, tp_size: int, tp_rank: int) -> torch.Tensor:
    return full if dim is None else full.chunk(tp_size, dim=dim)[tp_rank]


def load_model_params(load_dir: str | os.PathLike, chunks, tp_size: int, tp_rank: int) -> dict:
    """Copy the latest checkpoint's parameters (any saved layout) into `chunks`; returns its meta.

    For inference and tools: no optimizer state, RNG or data position is touched.
    """
    folder = find_latest(load_dir)
    reader = _ShardReader(folder)
    with torch.no_grad():
        for name, p in _named_params(chunks).items():
            p.copy_(_slice(reader.full(name, "params"), p.tp_split_dim, tp_size, tp_rank))
    return json.loads((folder / "meta.json").read_text())


def load_checkpoint(load_dir: str | os.PathLike, trainer, data=None) -> int:
    """Load the latest checkpoint into `trainer` (any saved layout); returns its iteration."""
    folder = find_latest(load_dir)
    reader = _ShardReader(folder)
    meta = json.loads((folder / "meta.json").read_text())
    apply_shard_state(trainer, reader)
    trainer.iteration = meta["iteration"]
    same_world = meta["layout"]["world_size"] == trainer.job.layout.world_size
    _restore_rank_state(folder, trainer, data, same_world=same_world)
    return trainer.iteration


def apply_shard_state(trainer, reader) -> None:
    """Copy params, optimizer and FP8 state into `trainer`'s chunks from `reader` (the shards of
    a checkpoint, or states handed over in memory): every name the trainer holds must be there."""
    g, lay = trainer.groups, trainer.job.layout
    trainer.optimizer.finish_param_sync()
    optim = {}
    with torch.no_grad():
        for name, p in _named_params(trainer.chunks).items():
            local = reader.local(name, "params", None, lay.tp_size, g.tp_rank)
            if reader.has_optim_state(name):
                keys = reader.optim_keys(name)
                optim[p] = {key: reader.local(name, "optim", key, lay.tp_size, g.tp_rank) for key in keys}
                # an fp32 checkpoint's params are the main params of a bf16/fp16 run
                local = optim[p].setdefault("main_param", local.float())
            p.copy_(local)
    trainer.optimizer.load_param_state(optim.get)
    trainer.optimizer.load_state_dict(reader.optimizer_state())
    load_delayed_state_dict(trainer.fp8_states, reader.fp8_states())


def _restore_rank_state(folder: Path, trainer, data, same_world: bool) -> None:
    # The data position is global (consumed samples), so any rank's file serves any layout.
    own = folder / f"rank{trainer.groups.rank:05d}.pt"
    path = own if (same_world and own.is_file()) else folder / "rank00000.pt"
    state = torch.load(path, map_location="cpu", weights_only=True)
    if data is not None:
        data.load_state_dict(state["data"])
    if same_world:
        torch.set_rng_state(state["rng"]["torch"])
        if state["rng"]["cuda"] is not None and trainer.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"])
        if "tracker" in state["rng"]:  # attention-dropout streams (absent in older checkpoints)
            trainer.rng_tracker.set_states(state["rng"]["tracker"])


def has_checkpoint(load_dir: str | os.PathLike) -> bool:
    """Whether `load_dir` holds a complete checkpoint (Megatron: an empty --load starts fresh)."""
    return (Path(load_dir) / "latest").is_file()


def read_saved_model_fields(load_dir: str | os.PathLike) -> dict | None:
    """The model fields of the latest checkpoint in `load_dir`; None when it holds none."""
    if not has_checkpoint(load_dir):
        return None
    return json.loads((find_latest(load_dir) / "meta.json").read_text())["model"]


def compute_model_config_mismatch(saved: dict, model_config) -> list[str]:
    """`field saved -> current` for every model-shape field that differs from a checkpoint's
    `saved` model fields (read_saved_model_fields).

    Dropout rates are training settings, not shape: they may change on resume.
    """
    current = asdict(model_config)
    return [
        f"{k} {saved[k]} -> {current[k]}"
        for k in sorted(current)
        if k in saved and saved[k] != current[k] and not k.endswith("dropout")
    ]
