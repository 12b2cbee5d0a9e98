"""Live progress of a training run on the terminal (rank 0 only).

On a terminal: a rich progress bar with loss and throughput. Elsewhere (CI logs, pipes):
one plain line every `log_interval` iterations.
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class TrainProgress:
    def __init__(self, job, *, enabled: bool, log_interval: int = 1):
        self.job, self.enabled, self.log_interval = job, enabled, max(1, log_interval)
        self.live = enabled and sys.stdout.isatty()
        self._progress = None

    def __enter__(self) -> TrainProgress:
        if not self.enabled:
            return self
        print(
            f"megatronapp: training {self.job.model.num_parameters() / 1e6:.2f}M params, "
            f"{self.job.layout.describe()}, schedule {self.job.train.schedule}, "
            f"{self.job.num_microbatches} microbatches/step",
            flush=True,
        )
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]:.4f}  {task.fields[tps]:,.0f} tok/s"),
                TimeRemainingColumn(),
                console=Console(),
                transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task("train", total=self.job.train.train_iters, loss=float("nan"), tps=0.0)
        return self

    def update(self, m: dict) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.update(self._task, completed=m["iteration"], loss=m["loss"], tps=m["tokens_per_s"])
        elif m["iteration"] % self.log_interval == 0 or m["iteration"] == self.job.train.train_iters:
            mfu = f"  MFU {m['mfu'] * 100:.1f}%" if m.get("mfu") is not None else ""
            print(
                f"iter {m['iteration']:>6}/{self.job.train.train_iters}  loss {m['loss']:.4f}  "
                f"lr {m['lr']:.2e}  grad_norm {m['grad_norm']:.3f}  "
                f"step {m['step_time_s'] * 1e3:.1f} ms  {m['tokens_per_s']:,.0f} tok/s  "
                f"{m['tflops_per_gpu']:.2f} TFLOP/s/GPU{mfu}",
                flush=True,
            )

    def note(self, message: str) -> None:
        """A line between the step lines (an evaluation's result)."""
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.console.print(message, markup=False, highlight=False)
        else:
            print(message, flush=True)

    def warn(self, message: str, source: str = "MegaScan online") -> None:
        """A live line shown above the progress bar: a slow-rank warning (online detection), a move of layers."""
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.console.print(f"[yellow]{source}: {message}[/yellow]")
        else:
            print(f"{source}: {message}", flush=True)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
