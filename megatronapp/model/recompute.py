"""Activation recompute (Megatron's --recompute-granularity / -method / -num-layers).

* `selective`: only the attention core (softmax(QK^T)V) is recomputed in backward; its
  inputs Q, K, V are kept.
* `full`: whole transformer layers keep only their input; with method `uniform` the layers
  of a chunk are recomputed in consecutive groups of `num_layers` (each group keeps one
  input), with `block` only the first `num_layers` layers of each chunk are recomputed.

Replays draw the same random numbers as the original forward: torch's checkpoint restores
the default generators, and `recompute` additionally snapshots the tracked RNG streams
(parallel.random.RNGStatesTracker) at the original forward and replays from the snapshot,
restoring the live streams afterwards. Hidden dropout is keyed (no state at all). The replay
also prefers the SDPA kernels the forward preferred (--attention-backend is set around the
forward step only). So gradients with recompute are bit-identical to gradients without it.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from megatronapp.config import RecomputeConfig
from megatronapp.model.attention_kernels import replay_sdpa_preference


def compute_full_recompute_groups(num_layers: int, cfg: RecomputeConfig) -> list[tuple[int, int, bool]]:
    """Split a chunk's `num_layers` layers into [start, end) runs and whether each is recomputed."""
    if cfg.granularity != "full":
        return [(0, num_layers, False)] if num_layers else []
    if cfg.method == "block":  # each of the first n layers keeps only its own input
        n = min(cfg.num_layers, num_layers)
        return [(i, i + 1, True) for i in range(n)] + ([(n, num_layers, False)] if n < num_layers else [])
    return [(s, min(s + cfg.num_layers, num_layers), True) for s in range(0, num_layers, cfg.num_layers)]


def recompute(fn, *args, rng_tracker=None):
    """checkpoint(fn, *args) that also replays the tracked RNG streams and the SDPA kernel
    preference of the original forward (see module docstring)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    # Traced code fixed its SDPA kernel when it was compiled; eager replays restore the preference.
    kw = {} if torch.compiler.is_compiling() else {"context_fn": replay_sdpa_preference}
    if rng_tracker is None:  # nothing tracked to replay (and nothing stateful for torch.compile)
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **kw)
    snapshot = rng_tracker.get_states() if rng_tracker is not None else None
    calls = [0]

    def run(*a):
        calls[0] += 1
        if snapshot is None or calls[0] == 1:
            return fn(*a)
        live = rng_tracker.get_states()
        rng_tracker.set_states(snapshot)
        try:
            return fn(*a)
        finally:
            rng_tracker.set_states(live)

    return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, **kw)
