"""Move whole layers between pipeline stages while training, without a restart or a file.

`repartition(trainer, stage_layers)` is collective over the job's ranks, between two optimizer
steps. Every rank gathers its shard's state by layout-independent name (the checkpoint's own
gather: params, fp32 main params, Adam moments, FP8 scale histories), sends the layers whose
owner changes to their new pipeline rank over the job's own process group (same TP and DP
coordinates), rebuilds its chunks, grad buffers and DP buckets, optimizer and runtime for the new
partition, and loads the states it kept and received. A run continued after the move is therefore
the run a checkpoint saved before it and loaded in the new partition would give, bit for bit.
"""

from __future__ import annotations

import re
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from megatronapp.engine.checkpoint import apply_shard_state, gather_shard_state
from megatronapp.parallel.partition import compute_chunk_layer_ranges, compute_stage_layers

_LAYER = re.compile(r"^layers\.(\d+)\.")


def compute_layer_owners(stage_layers: tuple[int, ...], pp_size: int) -> list[int]:
    """Pipeline rank of every layer under a partition (parallel/partition.py)."""
    owners = []
    for p, chunks in enumerate(compute_chunk_layer_ranges(stage_layers, pp_size)):
        for first, last in chunks:
            owners += [(layer, p) for layer in range(first, last)]
    return [p for _, p in sorted(owners)]


def compute_moves(old: tuple[int, ...], new: tuple[int, ...], pp_size: int) -> dict[tuple[int, int], list[int]]:
    """(from pp rank, to pp rank) -> the layers that change owner."""
    moves: dict[tuple[int, int], list[int]] = {}
    for layer, (a, b) in enumerate(zip(compute_layer_owners(old, pp_size), compute_layer_owners(new, pp_size))):
        if a != b:
            moves.setdefault((a, b), []).append(layer)
    return moves


class _HandedOverStates:
    """The checkpoint reader's interface over states in memory: this rank's TP shard, by name."""

    def __init__(self, shard: dict):
        self.shard = shard

    def local(self, name: str, field: str, key: str | None, tp_size: int, tp_rank: int):
        value = self.shard[field][name]
        return value if key is None else value[key]

    def has_optim_state(self, name: str) -> bool:
        return name in self.shard["optim"]

    def optim_keys(self, name: str) -> tuple[str, ...]:
        return tuple(self.shard["optim"][name])

    def optimizer_state(self) -> dict:
        return self.shard["optimizer"]

    def fp8_states(self) -> dict:
        return self.shard["fp8"]


def _layer_of(name: str) -> int | None:
    found = _LAYER.match(name)
    return int(found.group(1)) if found else None


def _split_out(shard: dict, layers: set[int]) -> dict:
    """Remove from `shard` (in place) and return the entries of `layers`."""
    out = {}
    for field in ("params", "split", "optim", "fp8"):
        names = [n for n in shard[field] if _layer_of(n) in layers]
        out[field] = {n: shard[field].pop(n) for n in names}
    return out


def _exchange(trainer, shard: dict, moves: dict[tuple[int, int], list[int]]) -> None:
    """Send the moved layers' states to their new owners and merge what arrives into `shard`.

    Pairs of pipeline ranks talk in one global order (the lower rank sends first): the pair
    earliest in that order always has both ranks at it, so no order of moves can deadlock.
    """
    g, lay = trainer.groups, trainer.job.layout
    me = g.pp_rank
    pairs = sorted({tuple(sorted(k)) for k in moves})
    for a, b in pairs:
        if me not in (a, b):
            continue
        peer = b if me == a else a
        peer_global = lay.rank_of(g.tp_rank, g.dp_rank, peer)
        outgoing = [_split_out(shard, set(moves.get((me, peer), [])))]
        incoming = [None]
        for step in ("send", "recv") if me == a else ("recv", "send"):
            if step == "send":
                dist.send_object_list(outgoing, dst=peer_global, group=g.pp, device=_object_device(trainer))
            else:
                dist.recv_object_list(incoming, src=peer_global, group=g.pp, device=_object_device(trainer))
        for field, entries in incoming[0].items():
            shard[field].update(entries)


def _object_device(trainer) -> torch.device | None:
    return trainer.device if trainer.device.type == "cuda" else None


def repartition(trainer, stage_layers: tuple[int, ...]) -> float:
    """Move layers so that virtual stage v holds `stage_layers[v]` layers; the seconds it took.

    Collective over every rank of the job, between optimizer steps; a partition equal to the
    current one returns at once."""
    lay = trainer.job.layout
    new = compute_stage_layers(trainer.job.model.num_layers, lay.pp_size, lay.virtual_pp_size, per_stage=stage_layers)
    old = lay.stage_layers or compute_stage_layers(trainer.job.model.num_layers, lay.pp_size, lay.virtual_pp_size)
    if new == old:
        return 0.0
    t0 = time.perf_counter()
    shard = gather_shard_state(trainer)
    _exchange(trainer, shard, compute_moves(old, new, lay.pp_size))
    # building chunks must not move the streams dropout draws from
    rng = torch.get_rng_state(), torch.cuda.get_rng_state() if trainer.device.type == "cuda" else None
    trainer.rebuild(replace(trainer.job, layout=replace(lay, stage_layers=new)))
    torch.set_rng_state(rng[0])
    if rng[1] is not None:
        torch.cuda.set_rng_state(rng[1])
    apply_shard_state(trainer, _HandedOverStates(shard))
    return time.perf_counter() - t0
