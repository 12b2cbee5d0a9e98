"""Shared setup for the MegaScope UI tests: a small checkpoint, servers in this process, a browser."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import threading

import torch
from engine_jobs import RandomTokenBatches

from megatronapp.config import JobConfig, build_layout, model_preset
from megatronapp.engine.checkpoint import save_checkpoint
from megatronapp.engine.trainer import Trainer
from megatronapp.job import build_job, replace_fields, validate_job
from megatronapp.parallel.groups import build_process_groups
from megatronapp.scope_ui.protocol import Limits
from megatronapp.scope_ui.server import Hub, RunningServer, ServerConfig

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


def ui_job(iters: int = 3) -> JobConfig:
    """Tiny GPT with room for a prompt and a few tokens (seq 48), byte vocabulary."""
    model = model_preset("tiny", num_layers=4, seq_length=48, vocab_size=257)
    job = build_job(
        model,
        build_layout(1, 1, 1, 1),
        micro_batch_size=1,
        global_batch_size=4,
        train_iters=iters,
        lr=3e-3,
        lr_warmup_iters=0,
        min_lr=0.0,
        grad_bucket_mb=0.01,
        log_interval=1,
    )
    validate_job(job)
    return job


def build_trainer(iters: int = 3) -> Trainer:
    job = ui_job(iters)
    return Trainer(job, build_process_groups(job.layout, 0), torch.device("cpu"), RandomTokenBatches(job, 0))


def save_ui_checkpoint(path: str) -> None:
    trainer = build_trainer()
    trainer.train()
    save_checkpoint(path, trainer, trainer.data)


def start_generation_server(
    ckpt: str, limits: Limits | None = None, token: str | None = None, host: str = "127.0.0.1"
) -> RunningServer:
    from megatronapp.scope_ui.cli import build_generation_backend

    cfg = ServerConfig(host=host, port=0, token=token, limits=limits or Limits())
    backend = build_generation_backend(ckpt, None, "cpu", False, cfg.limits)
    return RunningServer(Hub(backend, cfg.limits), cfg).start()


class TrainingServer:
    """A Trainer stepping in a thread with the training view attached (as train --scope does)."""

    def __init__(self, trainer: Trainer | None = None, eval_every: int | None = None):
        from megatronapp.data.tokenizer import load_tokenizer
        from megatronapp.scope_ui.training import TrainingScope

        self.trainer = trainer or build_trainer(iters=10**6)
        self.eval_every = eval_every  # a validation loss every N steps (2 batches of held-out tokens)
        if eval_every:
            self.trainer.job = replace_fields(self.trainer.job, eval_interval=eval_every, eval_iters=2)
        cfg = ServerConfig(port=0)
        self.backend = TrainingScope(
            self.trainer, load_tokenizer(None), "The quick brown fox", 5, cfg.limits.max_perturbations
        )
        hub = Hub(self.backend, cfg.limits)
        self.backend.hub = hub
        self.server = RunningServer(hub, cfg).start()
        self.stop_flag = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        on_step = self.backend.wrap(lambda m: None)
        while not self.stop_flag.is_set():
            self.trainer.train(num_steps=1, on_step=on_step)
            if self.eval_every and self.trainer.iteration % self.eval_every == 0:
                from eval_jobs import HeldOutTokenBatches

                self.trainer.evaluate("valid", HeldOutTokenBatches(self.trainer.job, 0))

    def stop(self) -> None:
        self.stop_flag.set()
        self.backend.close()
        self.thread.join(timeout=60)
        self.server.stop()


def weights_digest(model) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.chunk.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def chromium_or_skip():
    """Path of Debian's chromium, installing it when we are root and apt works; skip otherwise."""
    import pytest

    if not os.path.exists(CHROMIUM) and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], capture_output=True, timeout=600)
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian chromium is missing at /usr/bin/chromium and could not be installed")
    pytest.importorskip("playwright.sync_api", reason="the playwright Python package is not installed")
    return CHROMIUM
