"""A step's captured tensors as ONE device buffer, one asynchronous copy to pinned host memory,
and the items viewed back out of it.

    buffer   uint8 (N,): each block tensor (batching.py: the items' tensors as rows) flattened
             as bytes, widest element size first (fp32 / int32, then fp16, then int8), so every
             piece starts aligned for its dtype with no padding
    offsets  per item, {key: byte offset of its tensor}; shapes and dtypes are the items' own

`pack_blocks` is one cat (no per-item or padding kernels) of device tensors, so it can run
inside a CUDA graph (the graph's output is then a static buffer refreshed by every replay).
`HostStaging` hands out slices of large pinned blocks, so a step costs one non_blocking copy
(on a side stream, off the token's critical path) and one event, not a pinned allocation.
"""

from __future__ import annotations

import torch

from megatronapp.scope.compress import CapturedItem

PINNED_BLOCK_BYTES = 1 << 20


def pack_blocks(blocks, items: list[CapturedItem], device) -> tuple[torch.Tensor, list[dict[str, int]]]:
    """(buffer, offsets of each of `items`) of the blocks that hold `items` (layout above)."""
    pieces = [(key, t.contiguous(), b) for b in blocks for key, t in b.tensors.items()]
    at = {}  # id(item) -> {key: offset}
    flat, offset = [], 0
    for key, t, block in sorted(pieces, key=lambda p: -p[1].element_size()):  # stable: block order kept
        row_bytes = t[0].numel() * t.element_size() if t.shape[0] else 0
        for i, it in enumerate(block.items):
            at.setdefault(id(it), {})[key] = offset + i * row_bytes
        flat.append(t.reshape(-1).view(torch.uint8))
        offset += t.numel() * t.element_size()
    offsets = [at[id(it)] for it in items]
    buffer = torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8, device=device)
    return buffer, offsets


def view_items(host: torch.Tensor, items: list[CapturedItem], offsets: list[dict[str, int]]) -> None:
    """Point every tensor of `items` (whose shapes and dtypes describe their slices) at its
    slice of the host buffer at `offsets` (pack_blocks', in the same item order), in place."""
    for it, at in zip(items, offsets, strict=True):
        for key, t in it.tensors.items():
            n = t.numel() * t.element_size()
            it.tensors[key] = host[at[key] : at[key] + n].view(t.dtype).view(t.shape)


# Copies run on a side stream (see HostStaging); False: on the current stream, queued right
# behind the step (the behaviour before 2026-12-04; a switch for A/B timing).
SIDE_STREAM_COPIES = True


class HostStaging:
    """Pinned host memory for device->host copies of packed steps (CPU buffers pass through).

    A copy runs on a side stream once the work queued so far on the current stream is done, so
    the current stream goes on (e.g. to sampling the step's token and generate()'s one sync per
    token) without waiting for the copy engine: a copy queued on it between the step and the
    sampling put a compute->copy->compute hand-over on every token's critical path. In return,
    `guard()` must be called before anything on the current stream may write a buffer handed to
    `copy` (a replayed decode graph's static output: Capture.step_begin calls it): it orders the
    current stream after the copies. Until then the buffers are kept alive here, so the caching
    allocator cannot give their memory to new work while a copy still reads it."""

    def __init__(self, block_bytes: int = PINNED_BLOCK_BYTES):
        self.block_bytes, self.block, self.used = block_bytes, None, 0
        self.stream, self.last_copy, self.reading = None, None, []

    def copy(self, buffer: torch.Tensor) -> tuple[torch.Tensor, object]:
        """(host tensor the buffer lands in, CUDA event to wait on or None)."""
        if not buffer.is_cuda:
            return buffer, None
        n = buffer.numel()
        if self.block is None or self.used + n > self.block.numel():
            self.block = torch.empty(max(n, self.block_bytes), dtype=torch.uint8, pin_memory=True)
            self.used = 0
        host = self.block[self.used : self.used + n]
        self.used += n + (-n % 8)
        if not SIDE_STREAM_COPIES:  # behind the step on the current stream: ordered by construction
            host.copy_(buffer, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            return host, event
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=buffer.device)
        if self.last_copy is not None and self.last_copy.query():  # copies land in order: none reads
            self.reading = []  # any more (bounds what is kept without a guard, e.g. chunk targets)
        self.stream.wait_stream(torch.cuda.current_stream(buffer.device))  # the step's work first
        with torch.cuda.stream(self.stream):
            host.copy_(buffer, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.last_copy = event
        self.reading.append(buffer)
        return host, event

    def guard(self) -> None:
        """Order the current stream after every copy queued so far (a no-op when there is none)."""
        if self.last_copy is not None:
            torch.cuda.current_stream(self.stream.device).wait_event(self.last_copy)
            self.last_copy, self.reading = None, []
