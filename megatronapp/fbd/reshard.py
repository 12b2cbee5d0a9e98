"""Resharding between backward workers (TP) and forward workers (TF), and its weight messages.

Weights (TP -> TF): a tensor split along dim d of full length n lives as the slice
[t*n/TP, (t+1)*n/TP) on backward TP rank t and is needed as [f*n/TF, (f+1)*n/TF) on forward
TP rank f; backward t sends forward f exactly the overlap of the two, for every parameter of
the stage in named_parameters order, flattened into one message. Replicated tensors travel
from the first backward rank overlapping f only. A weight message is a packed message
(p2p/message.py) in the parameters' dtype whose id is its version (the number of optimizer
steps behind those weights), checked by the receiver.

Activations need no reshaping (replicated over TP): they travel as packed messages
(p2p/message.py) with ids (iteration, microbatch), losses with ids (iteration,), both checked by
the receiver against what its own action list expects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megatronapp.p2p.message import pack_flat_message, split_message


@dataclass(frozen=True)
class WeightPiece:
    name: str
    dim: int | None  # split dim, None when replicated
    src_start: int  # offset along dim in the backward (source) shard
    dst_start: int  # offset along dim in the forward (destination) shard
    length: int  # along dim (full size when replicated)


def compute_weight_pieces(
    params: dict[str, tuple[tuple[int, ...], int | None]], tp_size: int, tp_rank: int, ftp_size: int, ftp_rank: int
) -> list[WeightPiece]:
    """What backward TP rank tp_rank sends forward TP rank ftp_rank.

    params: name -> (full shape, split dim or None), in a fixed order both sides share.
    """
    first_source = ftp_rank * tp_size // ftp_size
    pieces = []
    for name, (shape, dim) in params.items():
        if dim is None:
            if tp_rank == first_source:
                pieces.append(WeightPiece(name, None, 0, 0, shape[0] if shape else 1))
            continue
        n = shape[dim]
        if n % tp_size or n % ftp_size:
            raise ValueError(
                f"{name}: dim {dim} of size {n} is not divisible by TP {tp_size} and forward TP {ftp_size}"
            )
        src_lo, src_hi = tp_rank * n // tp_size, (tp_rank + 1) * n // tp_size
        dst_lo, dst_hi = ftp_rank * n // ftp_size, (ftp_rank + 1) * n // ftp_size
        lo, hi = max(src_lo, dst_lo), min(src_hi, dst_hi)
        if lo < hi:
            pieces.append(WeightPiece(name, dim, lo - src_lo, lo - dst_lo, hi - lo))
    return pieces


def full_param_specs(module: nn.Module, tp_size: int) -> dict[str, tuple[tuple[int, ...], int | None]]:
    """name -> (full shape, split dim) of a TP-sharded module's parameters."""
    specs = {}
    for name, p in module.named_parameters():
        shape, dim = list(p.shape), p.tp_split_dim
        if dim is not None:
            shape[dim] *= tp_size
        specs[name] = (tuple(shape), dim)
    return specs


def _view(p: torch.Tensor, piece: WeightPiece, start: int) -> torch.Tensor:
    return p if piece.dim is None else p.narrow(piece.dim, start, piece.length)


def weight_message_dtype(module: nn.Module) -> torch.dtype:
    """Weights travel in the parameters' dtype (bf16 under --bf16: half the bytes of fp32, exact)."""
    return next(module.parameters()).dtype


def pack_weights(module: nn.Module, pieces: list[WeightPiece], version: int, device) -> torch.Tensor:
    """The pieces as one packed message (p2p/message.py) on `device`, the version as its id (a
    copy: the optimizer may step meanwhile); assembled where the weights are, then copied once."""
    params = dict(module.named_parameters())
    parts = [_view(params[pc.name].detach(), pc, pc.src_start).reshape(-1) for pc in pieces]
    if not parts:  # nothing of this stage overlaps: an empty payload still carries the version
        first = next(iter(params.values()))
        parts = [torch.empty(0, dtype=first.dtype, device=first.device)]
    return pack_flat_message(parts, (version,), device)


def weight_message_shape(module: nn.Module, pieces: list[WeightPiece]) -> tuple[int]:
    """Shape of the payload of the weight message carrying `pieces` (empty_message allocates it)."""
    params = dict(module.named_parameters())
    return (sum(_view(params[pc.name], pc, pc.dst_start).numel() for pc in pieces),)


def unpack_weights(
    module: nn.Module, pieces: list[WeightPiece], message: torch.Tensor, expected_version: int, source: int
) -> None:
    """Copy a weight message into the forward shard; RuntimeError if its version is not the expected one."""
    header, payload = split_message(message, "weights", source)
    if header.ids != (expected_version,):
        raise RuntimeError(
            f"forward worker expected weights of version {expected_version} from rank {source}, "
            f"got version {header.ids[0] if header.ids else None}"
        )
    params, offset = dict(module.named_parameters()), 0
    with torch.no_grad():
        for pc in pieces:
            dst = _view(params[pc.name], pc, pc.dst_start)
            dst.copy_(payload[offset : offset + dst.numel()].view(dst.shape))
            offset += dst.numel()
