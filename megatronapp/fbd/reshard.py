"""Resharding between backward workers (TP) and forward workers (TF), and message framing.

Weights (TP -> TF): a tensor split along dim d of full length n lives as the slice
[t*n/TP, (t+1)*n/TP) on backward TP rank t and is needed as [f*n/TF, (f+1)*n/TF) on forward
TP rank f; backward t sends forward f exactly the overlap of the two, for every parameter of
the stage in named_parameters order, flattened into one message. Replicated tensors travel
from the first backward rank overlapping f only. The first element of a weight message is
its version (the number of optimizer steps behind those weights), checked by the receiver.

Activations need no reshaping (replicated over TP): they travel as packed messages
(p2p/message.py) with ids (iteration, microbatch), losses with ids (iteration,), both checked by
the receiver against what its own action list expects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class WeightPiece:
    name: str
    dim: int | None  # split dim, None when replicated
    src_start: int  # offset along dim in the backward (source) shard
    dst_start: int  # offset along dim in the forward (destination) shard
    length: int  # along dim (full size when replicated)


def compute_weight_pieces(params: dict[str, tuple[tuple[int, ...], int | None]], tp_size: int, tp_rank: int,
                          ftp_size: int, ftp_rank: int) -> list[WeightPiece]:
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
            raise ValueError(f"{name}: dim {dim} of size {n} is not divisible by TP {tp_size} "
                             f"and forward TP {ftp_size}")
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


VERSION_DIGITS = 3  # a weight message's version as base-256 digits: exact in bf16, fp16 and fp32


def weight_message_dtype(module: nn.Module) -> torch.dtype:
    """Weights travel in the parameters' dtype (bf16 under --bf16: half the bytes of fp32, exact)."""
    return next(module.parameters()).dtype


def pack_weights(module: nn.Module, pieces: list[WeightPiece], version: int, device) -> torch.Tensor:
    """[version digits, pieces...] as one tensor of the parameters' dtype on `device` (a copy:
    the optimizer may step meanwhile)."""
    if not 0 <= version < 256**VERSION_DIGITS:
        raise ValueError(f"weight version {version} does not fit {VERSION_DIGITS} base-256 digits")
    params = dict(module.named_parameters())
    home, dtype = next(iter(params.values())).device, weight_message_dtype(module)
    digits = [(version >> (8 * i)) & 255 for i in reversed(range(VERSION_DIGITS))]
    parts = [torch.tensor(digits, dtype=dtype, device=home)]  # assembled where the weights are, then one
    parts += [_view(params[pc.name].detach(), pc, pc.src_start).reshape(-1) for pc in pieces]  # copy (host staging)
    return torch.cat(parts).to(device)


def weight_message_numel(module: nn.Module, pieces: list[WeightPiece]) -> int:
    params = dict(module.named_parameters())
    return VERSION_DIGITS + sum(_view(params[pc.name], pc, pc.dst_start).numel() for pc in pieces)


def unpack_weights(module: nn.Module, pieces: list[WeightPiece], message: torch.Tensor, expected_version: int,
                   source: int) -> None:
    """Copy a weight message into the forward shard; RuntimeError if its version is not the expected one."""
    version = 0
    for digit in message[:VERSION_DIGITS].tolist():
        version = version * 256 + int(digit)
    if version != expected_version:
        raise RuntimeError(f"forward worker expected weights of version {expected_version} from rank {source}, "
                           f"got version {version}")
    params, offset = dict(module.named_parameters()), VERSION_DIGITS
    with torch.no_grad():
        for pc in pieces:
            dst = _view(params[pc.name], pc, pc.dst_start)
            dst.copy_(message[offset:offset + dst.numel()].view(dst.shape))
            offset += dst.numel()
