"""Compression of captured tensors, from a fixed registry chosen by name (never by code).

A pipeline is a list of ops, each a dict {"name": NAME, ...params}; text form for the CLI:
"slice:tokens=-8:,heads=0-1;reduce:op=absmax,width=64;quantize:dtype=fp16".

    slice     layers=[..] (drop other layers' items), heads=[..] (head dim), tokens=[start, end)
              (token dim, Python slice semantics: -8: is the last 8 tokens)
    reduce    op=mean|max|absmax|l2 over `width` contiguous buckets of the last dim
    topk      k largest |values| of the last dim: values + int32 indices
    quantize  dtype=fp16, or int8 with one fp32 scale (absmax / 127) per last-dim row

Ops act on a CapturedItem: named dims, a dict of tensors ("data", and "scale" / "indices"
when an op adds them) and a record of what was done. quantize must come last; nothing but
quantize may follow topk. Every op acts per last-dim row (or on named dims), never across
the leading dim, so items stacked along a new leading dim are compressed in one go
(batching.py). An op computes in fp32 unless working in the capture's own dtype gives the
same bits (slice, max / absmax over equal buckets, the fp16 cast); an unquantized result
ends in fp32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

# The default compressed capture: 64 bucket maxima of |x| per token and site, in fp16.
DEFAULT_COMPRESS = "reduce:op=absmax,width=64;quantize:dtype=fp16"


@dataclass
class CapturedItem:
    name: str  # "step3/layer1/q", "step3/topk"
    site: str
    step: int
    layer: int | None
    dims: tuple[str, ...]  # names of data's dims, e.g. ("batch", "head", "token", "dim")
    tensors: dict[str, torch.Tensor]
    ops: list[dict] = field(default_factory=list)  # what was done, in order, with shapes

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def manifest(self) -> dict:
        return {
            "name": self.name,
            "site": self.site,
            "step": self.step,
            "layer": self.layer,
            "dims": list(self.dims),
            "tensors": {
                k: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                for k, t in self.tensors.items()
            },
            "ops": self.ops,
            "nbytes": self.nbytes,
        }


def _slice(item: CapturedItem, layers=None, heads=None, tokens=None) -> CapturedItem | None:
    if layers is not None and item.layer is not None and item.layer not in layers:
        return None
    data = item.tensors["data"]
    if heads is not None and "head" in item.dims:
        data = select_indices(data, item.dims.index("head"), heads)
    if tokens is not None and "token" in item.dims:
        dim = item.dims.index("token")
        start, end = tokens
        data = data.narrow(dim, *_window(data.shape[dim], start, end))
    item.tensors["data"] = data
    return item


def select_indices(data: torch.Tensor, dim: int, indices) -> torch.Tensor:
    """data's entries `indices` (a list of ints) along `dim`, by views and one cat: no index tensor
    is copied to the device, so this can be recorded into a CUDA graph."""
    return torch.cat([data.narrow(dim, int(i), 1) for i in indices], dim=dim)


@functools.lru_cache(maxsize=64)
def compute_buckets(n: int, width: int, device) -> torch.Tensor:
    """Bucket of each of n positions (n,) for `width` buckets, as torch.tensor_split makes them
    (the first n % width buckets one longer); built on the device from an arange, once per
    (n, width, device) (memoised: a decode graph then holds no kernels for it). Read-only."""
    size, extra = divmod(n, width)
    i = torch.arange(n, device=device)
    long_part = extra * (size + 1)
    return torch.where(i < long_part, i // (size + 1), extra + (i - long_part) // max(size, 1))


def _window(length: int, start, end) -> tuple[int, int]:
    lo, hi, _ = slice(start, end).indices(length)
    return lo, max(0, hi - lo)


def _reduce(item: CapturedItem, op: str, width: int) -> CapturedItem:
    data = item.tensors["data"]
    n = data.shape[-1]
    width = min(width, n)
    if op in ("max", "absmax", "mean") and n % width == 0:
        item.tensors["data"] = reduce_equal_buckets(data, op, width)
        return item
    # Uneven buckets, l2: one scatter_reduce over all buckets in fp32 (not one kernel per
    # bucket); device ops only, so a CUDA graph can record it.
    data = data.float()
    bucket = compute_buckets(n, width, data.device).expand_as(data)  # (..., n): bucket of each column
    src = data.abs() if op == "absmax" else data * data if op == "l2" else data
    how = {"mean": "mean", "max": "amax", "absmax": "amax", "l2": "sum"}[op]
    out = torch.zeros((*data.shape[:-1], width), device=data.device)
    out = out.scatter_reduce(-1, bucket, src, reduce=how, include_self=False)
    item.tensors["data"] = out.sqrt() if op == "l2" else out
    return item


def reduce_equal_buckets(data: torch.Tensor, op: str, width: int) -> torch.Tensor:
    """max / absmax / mean of `width` equal contiguous buckets of the last dim, as one reduction.
    max / absmax in data's own dtype: a maximum is one of its inputs, so this is exactly the fp32
    scatter's value (NaN propagates as on the CPU there), without its cast, abs, fill and scatter
    kernels. mean accumulates in fp32 (the cast fused in); its sum may round in another order
    than the scatter's, and unlike CUDA's atomic scatter it is the same on every run."""
    buckets = data.reshape(*data.shape[:-1], width, data.shape[-1] // width)
    if op == "mean":
        return buckets.mean(dim=-1, dtype=torch.float32)
    if op == "absmax":
        if data.device.type in FUSED_ABSMAX_DEVICES:
            return torch.linalg.vector_norm(buckets, float("inf"), dim=-1)  # max |x|: abs fused in
        buckets = buckets.abs()
    return buckets.amax(dim=-1)


# Where absmax is the inf-norm kernel (one launch) rather than abs + amax: on the CPU the
# norm is ~40x slower than the two ops for short buckets (and launches cost nothing there).
FUSED_ABSMAX_DEVICES = ("cuda",)


def _topk(item: CapturedItem, k: int) -> CapturedItem:
    data = item.tensors["data"].float()
    k = min(k, data.shape[-1])
    idx = data.abs().topk(k, dim=-1).indices
    item.tensors["data"] = data.gather(-1, idx)
    item.tensors["indices"] = idx.to(torch.int32)
    item.dims = (*item.dims[:-1], "k")
    return item


def _quantize(item: CapturedItem, dtype: str) -> CapturedItem:
    data = item.tensors["data"]
    if dtype == "fp16":  # straight from bf16: the same rounding as via fp32 (exact), one kernel
        item.tensors["data"] = data.half()
        return item
    data = data.float()
    scale = (data.abs().amax(-1, keepdim=True) / 127.0).clamp(min=1e-30)
    item.tensors["data"] = (data / scale).round().clamp(-127, 127).to(torch.int8)
    item.tensors["scale"] = scale
    return item


def _as_int_list(v, what: str) -> list[int]:
    if isinstance(v, str):
        lo, _, hi = v.partition("-")
        return list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, int) for x in v):
        raise ValueError(f"{what} must be a list of integers, got {v!r}")
    return list(v)


def _check_slice(p: dict) -> dict:
    out = {}
    for key in ("layers", "heads"):
        if key in p:
            out[key] = _as_int_list(p[key], f"slice {key}")
    if "tokens" in p:
        t = p["tokens"]
        if isinstance(t, str):
            lo, sep, hi = t.partition(":")
            if not sep:
                raise ValueError(f"slice tokens must be START:END, got {t!r}")
            t = [int(lo) if lo else None, int(hi) if hi else None]
        if not (isinstance(t, (list, tuple)) and len(t) == 2):
            raise ValueError(f"slice tokens must be [start, end], got {t!r}")
        out["tokens"] = list(t)
    return out


def _check_reduce(p: dict) -> dict:
    if p.get("op") not in ("mean", "max", "absmax", "l2"):
        raise ValueError(f"reduce op must be mean, max, absmax or l2, got {p.get('op')!r}")
    width = int(p.get("width", 0))
    if width < 1:
        raise ValueError(f"reduce width must be >= 1, got {p.get('width')!r}")
    return {"op": p["op"], "width": width}


def _check_topk(p: dict) -> dict:
    k = int(p.get("k", 0))
    if k < 1:
        raise ValueError(f"topk k must be >= 1, got {p.get('k')!r}")
    return {"k": k}


def _check_quantize(p: dict) -> dict:
    if p.get("dtype") not in ("fp16", "int8"):
        raise ValueError(f"quantize dtype must be fp16 or int8, got {p.get('dtype')!r}")
    return {"dtype": p["dtype"]}


# name -> (parameter checker, implementation): the whole of what a client can ask for
REGISTRY = {
    "slice": (_check_slice, _slice),
    "reduce": (_check_reduce, _reduce),
    "topk": (_check_topk, _topk),
    "quantize": (_check_quantize, _quantize),
}


def check_pipeline(ops) -> tuple[dict, ...]:
    """Validated, normalised ops (one-line ValueError on an unknown op, bad params or order)."""
    out = []
    for op in ops or ():
        if not isinstance(op, dict) or op.get("name") not in REGISTRY:
            name = op.get("name") if isinstance(op, dict) else op
            raise ValueError(f"unknown compression {name!r}; choose from {', '.join(REGISTRY)}")
        params = REGISTRY[op["name"]][0]({k: v for k, v in op.items() if k != "name"})
        out.append({"name": op["name"], **params})
    names = [o["name"] for o in out]
    if "quantize" in names[:-1]:
        raise ValueError("quantize must be the last compression op")
    if "topk" in names and any(n not in ("quantize",) for n in names[names.index("topk") + 1 :]):
        raise ValueError("only quantize may follow topk")
    return tuple(out)


def parse_pipeline(text: str) -> tuple[dict, ...]:
    """'reduce:op=absmax,width=64;quantize:dtype=fp16' -> validated ops."""
    ops = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, rest = part.partition(":")
        params = {}
        for kv in filter(None, rest.split(",")):
            key, eq, value = kv.partition("=")
            if not eq:
                raise ValueError(f"compression parameter must be KEY=VALUE, got {kv!r}")
            params[key.strip()] = value.strip()
        ops.append({"name": name.strip(), **params})
    return check_pipeline(ops)


def apply_pipeline(item: CapturedItem, ops: tuple[dict, ...]) -> CapturedItem | None:
    """Run validated ops on item, recording each with the resulting data shape; None if sliced
    away. Floating results come back in fp32 unless quantized."""
    for op in ops:
        params = {k: v for k, v in op.items() if k != "name"}
        item = REGISTRY[op["name"]][1](item, **params)
        if item is None:
            return None
        item.ops.append({**op, "shape": list(item.tensors["data"].shape)})
    if not any(op["name"] == "quantize" for op in ops):  # ops may have kept an exact bf16 result
        item.tensors = {k: t.float() if t.is_floating_point() else t for k, t in item.tensors.items()}
    return item
