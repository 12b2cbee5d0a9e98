"""A step's captured tensors as ONE device buffer, one asynchronous copy to pinned host memory,
and the items viewed back out of it.

    buffer  uint8 (N,): every item tensor flattened as bytes, in item order, each padded to a
            multiple of 8 bytes so its host slice can be viewed as any dtype

`pack_items` uses device ops only, so it can run inside a CUDA graph (the graph's output is
then a static buffer refreshed by every replay). `HostStaging` hands out slices of large pinned
blocks, so a step costs one non_blocking copy and one event, not a pinned allocation.
"""

from __future__ import annotations

import torch

from megatronapp.scope.compress import CapturedItem

PINNED_BLOCK_BYTES = 1 << 20


def pack_items(items: list[CapturedItem], device) -> torch.Tensor:
    """The items' tensors as one uint8 buffer (layout above)."""
    flat = []
    for t in (t for it in items for t in it.tensors.values()):
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        flat.append(raw)
        if raw.numel() % 8:
            flat.append(torch.zeros(-raw.numel() % 8, dtype=torch.uint8, device=raw.device))
    return torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8, device=device)


def view_items(host: torch.Tensor, items: list[CapturedItem]) -> None:
    """Point every tensor of `items` (whose shapes and dtypes describe `host`'s layout) at its
    slice of the host buffer, in place."""
    offset = 0
    for it in items:
        for key, t in it.tensors.items():
            n = t.numel() * t.element_size()
            it.tensors[key] = host[offset:offset + n].view(t.dtype).view(t.shape)
            offset += n + (-n % 8)


class HostStaging:
    """Pinned host memory for device->host copies of packed steps (CPU buffers pass through)."""

    def __init__(self, block_bytes: int = PINNED_BLOCK_BYTES):
        self.block_bytes, self.block, self.used = block_bytes, None, 0

    def copy(self, buffer: torch.Tensor) -> tuple[torch.Tensor, object]:
        """(host tensor the buffer lands in, CUDA event to wait on or None). The copy is queued
        on the current stream, so a graph replayed later cannot overwrite the buffer first."""
        if not buffer.is_cuda:
            return buffer, None
        n = buffer.numel()
        if self.block is None or self.used + n > self.block.numel():
            self.block = torch.empty(max(n, self.block_bytes), dtype=torch.uint8, pin_memory=True)
            self.used = 0
        host = self.block[self.used:self.used + n]
        self.used += n + (-n % 8)
        host.copy_(buffer, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event
