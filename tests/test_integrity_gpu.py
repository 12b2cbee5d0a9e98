"""Engine integrity on CUDA: reported throughput against a wall clock, and --deterministic
bit identity. Skipped on CPU (see conftest); run with `pytest -m gpu tests/test_integrity_gpu.py`."""

from __future__ import annotations

import time

import pytest
import torch

from engine_jobs import RandomTokenBatches
from megatronapp.config import JobConfig, TrainConfig, build_layout, model_preset
from megatronapp.engine.trainer import Trainer
from megatronapp.parallel.groups import single_process_groups

pytestmark = pytest.mark.gpu


def _gpu_bound_job(log_interval: int, **train_kw) -> JobConfig:
    # ~30-60 ms a step on an H100: the device, not the host, sets the pace
    model = model_preset("350m", num_layers=8, seq_length=1024)
    train = TrainConfig(micro_batch_size=4, global_batch_size=8, train_iters=1000, lr=1e-4, lr_warmup_iters=0,
                        bf16=True, log_interval=log_interval, **train_kw)
    return JobConfig(model=model, train=train, layout=build_layout(1, 1, 1))


@pytest.mark.parametrize("log_interval", [1, 10])
def test_reported_tokens_per_s_within_two_percent_of_wall_clock(log_interval):
    job = _gpu_bound_job(log_interval)
    trainer = Trainer(job, single_process_groups(), torch.device("cuda"), RandomTokenBatches(job, 0))
    trainer.train(num_steps=10)  # warm-up: allocator, autotuning
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    history = trainer.train(num_steps=30)
    torch.cuda.synchronize()
    wall_s = time.perf_counter() - t0
    tokens = 30 * job.train.global_batch_size * job.model.seq_length
    reported = tokens / sum(m.step_time_s for m in history)
    assert reported == pytest.approx(tokens / wall_s, rel=0.02), (reported, tokens / wall_s)
