"""CUDA graph of the decode step: one (B, 1) forward replayed instead of re-launched.

Decoding a small batch is bound by kernel launches; a graph replays the whole step's
kernels at once. It needs a static KV cache (kv_cache.py, static mode) so every step has
the same shapes and addresses, and one process (collectives are not captured here). The
graph is captured at the first decode step that needs it, after two warm-up runs on a side
stream (they write the same cache column the real step then overwrites), and replayed for
later generations too while the static cache lives (InferenceModel keeps one per batch and
recorder configuration). `step_fn` may return any structure of tensors (and plain Python
objects): `run` returns that same structure, its tensors refreshed by the replay.
"""

from __future__ import annotations

import torch


class DecodeGraph:
    def __init__(self, step_fn, batch: int, device):
        self.tokens = torch.zeros((batch, 1), dtype=torch.long, device=device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step_fn(self.tokens)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: a server thread's unrelated CUDA call must not abort this capture
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.out = step_fn(self.tokens)

    def run(self, tokens: torch.Tensor):
        """The step's output for `tokens` (B, 1); valid until the next run."""
        self.tokens.copy_(tokens)
        self.graph.replay()
        return self.out
