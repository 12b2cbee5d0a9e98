"""The parameter update overlapped with the next step's forward (--overlap-param-update).

The master-AdamW update (engine/master_adam.py) reads and writes ~30 bytes per parameter: it is
memory-bound, while the forward's GEMMs are compute-bound, so the two can share the GPU instead
of running one after the other. After the grad norm and the clip factor are known (compute
stream, as without overlap), the update runs on a side stream, one launch per *unit* in forward
order (a module and the parameters it needs: the embedding, each transformer layer, ...), and a
unit's first forward of the next step waits only for its own unit's event — as Megatron-Core
overlaps its distributed optimizer's parameter all-gather with the forward, bucket by bucket,
from forward pre-hooks.

Why no kernel reads or writes anything too early:
* the side stream waits for the compute stream before its first launch: grads, the norm and the
  clip factor are final;
* a unit's forward (pre-hook) waits for the unit's event: its parameters are updated;
* the kernels read the main grads, so a chunk's main grads are zeroed on the side stream after
  the chunk's last launch, and the chunk's forward (post-hook) waits for that zeroing; the
  chunk's backward, which writes its main grads, follows its forward;
* everything else that reads parameters or optimizer state (checkpoints, the end of
  Trainer.train) calls wait_all() first (MixedPrecisionOptimizer.finish_param_sync).

Measured on one H200 with the 1.3B preset (BENCHMARKS.md, Engine): it does not pay there
(269.9 against 269.5 ms a step). Each of the update's programs and the GEMMs' tiles fill whole SMs,
so the two alternate rather than share; a kernel confined to a few SMs (32 or 66 programs looping
over the blocks) ran so slowly that the layers waited for it (+18 and +6 ms). Hence off by default.

A model chunk names its units with `overlap_units()` -> [(module, params)], in forward order,
each module one whose pre-hook runs outside compiled code; a chunk without it is one unit (its
update overlaps with the forward of the chunks before it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from megatronapp.engine.master_adam import MasterAdamW, advance_step_counters

# GPU cycles the side stream sleeps before its first launch: 0, except where a test widens the
# window in which a missing wait would let the forward read parameters not yet updated
LAUNCH_DELAY_CYCLES = 0


def partition_by_unit(unit_params: list[list[int]], params: list[int]) -> list[list[int]]:
    """For each unit, the indices into `params` it owns: a parameter belongs to the first unit
    that lists it (tied weights are updated once, before their first use); one that no unit lists
    goes to the first unit, so it is updated before anything runs."""
    owner_of = {}
    for u, ids in enumerate(unit_params):
        for pid in ids:
            owner_of.setdefault(pid, u)
    owned: list[list[int]] = [[] for _ in unit_params]
    for i, pid in enumerate(params):
        owned[owner_of.get(pid, 0)].append(i)
    return owned


def chunk_units(chunk: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    units = getattr(chunk, "overlap_units", None)
    return units() if units is not None else [(chunk, list(chunk.parameters()))]


@dataclass
class _Unit:
    chunk: int
    kernel: MasterAdamW
    event: torch.cuda.Event


class OverlappedUpdate:
    """The master-AdamW update of `chunk_mains` (MainParams per chunk), launched unit by unit on
    a side stream; forward hooks on `chunks` make the compute stream wait where it must."""

    def __init__(
        self,
        optimizer: torch.optim.AdamW,
        model_view_of: dict[int, torch.Tensor],
        chunks: list[nn.Module],
        chunk_mains: list[list],
        device: torch.device,
        kernel_kw: dict | None = None,
    ):
        """`kernel_kw`: MasterAdamW's precision-aware arguments (grad_of, remainders), if any."""
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.units: list[_Unit] = []
        self.chunk_events = [torch.cuda.Event() for _ in chunks]
        for c, (chunk, mains) in enumerate(zip(chunks, chunk_mains)):
            units = chunk_units(chunk)
            owned = partition_by_unit(
                [[id(p) for p in params] for _, params in units], [id(m.model_param) for m in mains]
            )
            for (module, _), idx in zip(units, owned):
                if not idx:
                    continue
                only = {id(mains[i].main_param) for i in idx}
                kernel = MasterAdamW(optimizer, model_view_of, only=only, **(kernel_kw or {}))
                k = len(self.units)
                self.units.append(_Unit(c, kernel, torch.cuda.Event()))
                module.register_forward_pre_hook(lambda *_, k=k: self.wait_unit(k))
            chunk.register_forward_hook(lambda *_, c=c: self.wait_chunk(c))
        self._pending_units: set[int] = set()
        self._pending_chunks: set[int] = set()

    def invalidate(self) -> None:
        """A main param, grad, Adam state or model tensor was replaced (see MasterAdamW)."""
        for unit in self.units:
            unit.kernel.invalidate()

    @torch.no_grad()
    def launch(
        self, grad_scale: torch.Tensor | None, zero_chunk_grads: Callable[[int], None], skip: torch.Tensor | None = None
    ) -> None:
        """Queue the update (grads divided by `grad_scale`, a device scalar, or None; none at
        all where the device flag `skip` is 1) and then `zero_chunk_grads(c)` for every chunk
        on the side stream; returns at once."""
        self.wait_all()
        counters = [s for unit in self.units for s in unit.kernel.step_counters()]  # builds plans here
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            if LAUNCH_DELAY_CYCLES:
                torch.cuda._sleep(LAUNCH_DELAY_CYCLES)
            advance_step_counters(counters, skip)
            for c, event in enumerate(self.chunk_events):
                for unit in self.units:
                    if unit.chunk == c:
                        unit.kernel.launch(grad_scale, skip)
                        unit.event.record()
                zero_chunk_grads(c)
                event.record()
        for flag in (grad_scale, skip):  # allocated on the compute stream, read on the side one
            if flag is not None:
                flag.record_stream(self.stream)
        self._pending_units = set(range(len(self.units)))
        self._pending_chunks = set(range(len(self.chunk_events)))

    def wait_unit(self, k: int) -> None:
        if k in self._pending_units:
            torch.cuda.current_stream(self.device).wait_event(self.units[k].event)
            self._pending_units.discard(k)

    def wait_chunk(self, c: int) -> None:
        if c in self._pending_chunks:
            torch.cuda.current_stream(self.device).wait_event(self.chunk_events[c])
            self._pending_chunks.discard(c)
            self._pending_units -= {k for k, unit in enumerate(self.units) if unit.chunk == c}

    def wait_all(self) -> None:
        for c in sorted(self._pending_chunks):
            self.wait_chunk(c)
