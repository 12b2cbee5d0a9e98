"""Bit-level faults that know the number format: fp32, bf16 and fp16.

A value is reinterpreted as an integer of the same width (int32 / int16), bits are flipped,
forced to 0 or 1, and the result is reinterpreted back. Field layout, bit 0 = least
significant mantissa bit:

    format  width  sign  exponent   mantissa
    fp32    32     31    23..30     0..22
    bf16    16     15    7..14      0..6
    fp16    16     15    10..14     0..9

A tensor stored in another dtype is cast to the fault's format, hit there and cast back, which
models a fault in lower-precision storage of that value. All functions here are pure.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class NumberFormat:
    name: str
    dtype: torch.dtype
    int_dtype: torch.dtype
    width: int
    exponent_bits: int
    mantissa_bits: int

    def field_bits(self, field: str) -> range:
        """Bit positions of 'sign', 'exponent' or 'mantissa'."""
        m, e = self.mantissa_bits, self.exponent_bits
        ranges = {"mantissa": range(0, m), "exponent": range(m, m + e), "sign": range(m + e, m + e + 1)}
        if field not in ranges:
            raise ValueError(f"unknown bit field {field!r}; choose from sign, exponent, mantissa")
        return ranges[field]


FORMATS = {
    "fp32": NumberFormat("fp32", torch.float32, torch.int32, 32, 8, 23),
    "bf16": NumberFormat("bf16", torch.bfloat16, torch.int16, 16, 8, 7),
    "fp16": NumberFormat("fp16", torch.float16, torch.int16, 16, 5, 10),
}
_BY_DTYPE = {f.dtype: f for f in FORMATS.values()}


def format_of(name: str | None, dtype: torch.dtype) -> NumberFormat:
    """The named format, or the one of `dtype` when name is None."""
    if name is None:
        if dtype not in _BY_DTYPE:
            raise ValueError(f"no bit format for dtype {dtype}; name one of {', '.join(FORMATS)}")
        return _BY_DTYPE[dtype]
    if name not in FORMATS:
        raise ValueError(f"unknown number format {name!r}; choose from {', '.join(FORMATS)}")
    return FORMATS[name]


def apply_bit_op(
    x: torch.Tensor, fmt: NumberFormat, where: torch.Tensor, bit_masks: torch.Tensor, op: str
) -> torch.Tensor:
    """New tensor: at `where`, XOR ('flip'), clear ('stuck0') or set ('stuck1') the bits of
    `bit_masks` (integers of the format's width, broadcastable to x) in x's `fmt` encoding."""
    y = x.detach().to(fmt.dtype).contiguous()
    as_int = y.view(fmt.int_dtype)
    masks = bit_masks.to(device=x.device, dtype=fmt.int_dtype).expand_as(as_int)
    if op == "flip":
        hit = as_int ^ masks
    elif op == "stuck0":
        hit = as_int & ~masks
    elif op == "stuck1":
        hit = as_int | masks
    else:
        raise ValueError(f"unknown bit operation {op!r}")
    out = torch.where(where.to(x.device), hit, as_int).view(fmt.dtype)
    return out.to(x.dtype)


def masks_for_bits(fmt: NumberFormat, bits: list[int]) -> torch.Tensor:
    """One integer mask (scalar tensor of the format's width) with every bit of `bits` set."""
    total = 0
    for b in bits:
        if not 0 <= b < fmt.width:
            raise ValueError(f"bit {b} is outside {fmt.name} (0..{fmt.width - 1})")
        total |= 1 << b
    return _to_signed(fmt, torch.tensor(total, dtype=torch.int64))


def _to_signed(fmt: NumberFormat, value: torch.Tensor) -> torch.Tensor:
    """Unsigned bit patterns (int64) as the format's signed integer type (two's complement)."""
    top = 1 << (fmt.width - 1)
    return torch.where(value >= top, value - 2 * top, value).to(fmt.int_dtype)


def random_bit_masks(
    fmt: NumberFormat, candidates: range, num_bits: int, shape: tuple[int, ...], gen: torch.Generator
) -> torch.Tensor:
    """Per element, `num_bits` distinct random bits from `candidates`, as integer masks (shape)."""
    if not 1 <= num_bits <= len(candidates):
        raise ValueError(f"num_bits {num_bits} must be in 1..{len(candidates)} for this field")
    order = torch.rand((*shape, len(candidates)), generator=gen).argsort(dim=-1)[..., :num_bits]
    bits = torch.tensor(list(candidates))[order]  # (*shape, num_bits)
    total = torch.zeros(shape, dtype=torch.int64)
    for i in range(num_bits):
        total = total | (torch.ones_like(bits[..., i]) << bits[..., i])
    return _to_signed(fmt, total)
