"""Randomness that parallelism cannot change: keyed hidden dropout and tracked RNG streams.

Two kinds of dropout, as in Megatron-Core, but with one improvement:

* **Hidden dropout** (after attention and MLP, on the replicated / sequence-parallel
  residual stream) draws its mask from a *counter-based* hash keyed by
  (seed, iteration, global sample, layer, site, position, hidden index). Each rank computes
  only the slice it holds (its microbatch's samples, its sequence shard), so the mask of a
  given element is the same under every TP x PP x DP layout, micro-batch size and recompute
  setting: with attention dropout 0, every layout trains the numbers of one process.
* **Attention dropout** acts on per-TP-rank heads, so it draws from a *tracked stream*
  ("model-parallel" in Megatron-Core), seeded from (seed, tp rank, pp rank): `RNGStatesTracker`
  swaps the stream's state into the device's default generator for the duration of a
  `fork()`. Recompute snapshots and restores these states (see model/recompute.py), and
  checkpoints save them, so replays and resumes draw the same masks.

The hash is Wellons' "lowbias32" 32-bit integer mixer applied stage by stage (sample, then
position, then hidden index), computed in int64 with explicit 32-bit masks so it gives the
same bits on CPU and CUDA.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from megatronapp.parallel.eager_only import eager_only

_MASK32 = 0xFFFFFFFF
SITES = {"embedding": 0, "attention": 1, "mlp": 2}  # hidden-dropout sites of a transformer layer


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def _mix32_int(x: int) -> int:
    x &= _MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


@dataclass(frozen=True)
class DropoutKey:
    """Identifies one microbatch's forward: dropout masks are a pure function of this key,
    the layer, the site and the element's global (sample, position, hidden) coordinates."""

    seed: int
    iteration: int
    first_sample: int  # index in the global batch of this microbatch's first sample
    position_offset: int = 0  # global position of this rank's first sequence element (SP)

    def base(self, layer: int, site: str) -> int:
        h = _mix32_int(self.seed)
        for v in (self.iteration, layer, SITES[site]):
            h = _mix32_int(h ^ _mix32_int(v + 0x9E3779B9))
        return h


def keyed_uniform(key: DropoutKey, layer: int, site: str, shape: tuple[int, int, int], device) -> torch.Tensor:
    """U[0, 1) float32 of shape (B, S, H), a pure function of the key and global coordinates."""
    b, s, h = shape
    base = key.base(layer, site)
    sample = torch.arange(key.first_sample, key.first_sample + b, device=device, dtype=torch.int64)
    pos = torch.arange(key.position_offset, key.position_offset + s, device=device, dtype=torch.int64)
    hid = torch.arange(h, device=device, dtype=torch.int64)
    x = _mix32((sample.view(b, 1, 1) + base) & _MASK32)
    x = _mix32(x ^ pos.view(1, s, 1))
    x = _mix32((x + hid.view(1, 1, h) * 0x9E3779B1) & _MASK32)
    return (x >> 8).to(torch.float32) * (1.0 / (1 << 24))


@eager_only
def keyed_dropout(x: torch.Tensor, p: float, key: DropoutKey | None, layer: int, site: str) -> torch.Tensor:
    """Inverted dropout with a layout-invariant mask; identity when p == 0 or key is None (eval)."""
    if p == 0.0 or key is None:
        return x
    keep = keyed_uniform(key, layer, site, tuple(x.shape), x.device) >= p
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p))


class RNGStatesTracker:
    """Named RNG streams of one device, swapped into its default generator by `fork`."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._states: dict[str, torch.Tensor] = {}

    def _get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists")
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        self._states[name] = gen.get_state()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        if set(states) != set(self._states):
            raise ValueError(f"RNG streams {sorted(states)} do not match {sorted(self._states)}")
        self._states = {k: v.clone() for k, v in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel"):
        saved = self._get()
        self._set(self._states[name])
        try:
            yield
        finally:
            self._states[name] = self._get()
            self._set(saved)


def build_rng_tracker(seed: int, tp_rank: int, pp_rank: int, device) -> RNGStatesTracker:
    """Megatron-Core's streams: "model-parallel" differs per TP and PP rank (offset 2718)."""
    tracker = RNGStatesTracker(device)
    tracker.add("model-parallel", seed + 2718 + tp_rank + 100 * pp_rank)
    return tracker
