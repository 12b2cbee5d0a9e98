"""What the benchmark entry points share: fixed random batches, single-job construction and timing
on the host clock with the device synchronised; the paired-measurement statistics are the
package's (`megatronapp.paired`, re-exported here).

Imported as `common` (a script's own folder is first on `sys.path`).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import torch

from megatronapp.config import JobConfig, build_layout, model_preset
from megatronapp.job import build_job
from megatronapp.paired import bootstrap_median_ci

__all__ = ["FixedBatches", "bootstrap_median_ci", "make_job", "sync", "timed_seconds"]


class FixedBatches:
    """The same random token microbatches every step (data loading is not what is measured).

    Drawn on the CPU from `seed + dp_rank`, so every device and every run sees the same tokens,
    then moved to `device`: `num_microbatches` tensors of (micro_batch, seq_length + 1)."""

    def __init__(self, job: JobConfig, device: torch.device | str = "cpu", dp_rank: int = 0, seed: int = 1234):
        gen = torch.Generator().manual_seed(seed + dp_rank)
        t, m = job.train, job.model
        self.mbs = [
            torch.randint(0, m.vocab_size, (t.micro_batch_size, m.seq_length + 1), generator=gen).to(device)
            for _ in range(job.num_microbatches)
        ]

    def next_microbatches(self) -> list[torch.Tensor]:
        return self.mbs


def make_job(
    preset: str,
    micro_batch: int,
    num_micro: int,
    *,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    model_overrides: dict | None = None,
    **train_kw,
) -> JobConfig:
    """A job of `preset` on a TP x PP x DP layout with `num_micro` microbatches of `micro_batch`
    per DP rank per step; trains "forever" (the benchmark decides how many steps), lr 1e-4.
    `train_kw` are further fields of the job's component configs (bf16, compile, recompute_granularity, ...)."""
    model = model_preset(preset, **(model_overrides or {}))
    train_kw = {"train_iters": 10**6, "lr": 1e-4, **train_kw}
    return build_job(
        model,
        build_layout(tp * pp * dp, tp, pp),
        micro_batch_size=micro_batch,
        global_batch_size=micro_batch * num_micro * dp,
        **train_kw,
    )


def sync(device: torch.device | str) -> None:
    """Waits for the device's queued work (nothing to wait for on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed_seconds(fn: Callable[[], object], device: torch.device | str, repeat: int = 1) -> float:
    """Host seconds for `repeat` calls of fn, the device synchronised before and after, with the
    garbage collector run first and held off, so a collection that earlier work triggered does
    not land in this measurement."""
    gc.collect()
    gc.disable()
    try:
        sync(device)
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        sync(device)
        return time.perf_counter() - t0
    finally:
        gc.enable()
