"""Engine integrity: throughput accounting over the device's real time."""

from __future__ import annotations

import pytest
import torch

from engine_jobs import RandomTokenBatches, make_job
from megatronapp.engine.throughput import compute_run_throughput
from megatronapp.engine.trainer import Trainer
from megatronapp.parallel.groups import single_process_groups


class FakeDevice:
    """A clock and a device queue: enqueueing a step costs the host `host_s`, the device
    runs it for `device_s` after whatever is queued, and a sync waits for the queue."""

    def __init__(self, host_s: float, device_s: float):
        self.now, self.free_at, self.host_s, self.device_s = 0.0, 0.0, host_s, device_s

    def clock(self) -> float:
        return self.now

    def enqueue_step(self) -> None:
        self.free_at = max(self.free_at, self.now) + self.device_s
        self.now += self.host_s

    def sync(self) -> None:
        self.now = max(self.now, self.free_at)


def _device_bound_trainer(fake: FakeDevice, log_interval: int, iters: int) -> Trainer:
    job = make_job(1, iters=iters, global_batch=2, num_layers=1, log_interval=log_interval)
    trainer = Trainer(job, single_process_groups(), torch.device("cpu"), RandomTokenBatches(job, 0),
                      clock=fake.clock)
    run_step, copy_to_host = trainer._run_step, trainer._copy_to_host

    def enqueued_step():
        fake.enqueue_step()
        return run_step()

    def synced_copy(steps):
        fake.sync()
        return copy_to_host(steps)

    trainer._run_step, trainer._copy_to_host = enqueued_step, synced_copy
    return trainer


@pytest.mark.parametrize("log_interval", [1, 3])
def test_step_time_is_the_devices_time_when_the_host_runs_ahead(log_interval):
    """The host enqueues a step in 10 ms, the device needs 100 ms: the accounting that reads
    the clock before the interval's sync reports 10 ms steps (and a 10x tokens/s)."""
    fake = FakeDevice(host_s=0.01, device_s=0.1)
    history = _device_bound_trainer(fake, log_interval, iters=6).train()
    assert [m.step_time_s for m in history] == pytest.approx([0.1] * 6)
    tokens_per_step = 2 * 16
    assert [m.tokens_per_s for m in history] == pytest.approx([tokens_per_step / 0.1] * 6)
    assert sum(m.step_time_s for m in history) == pytest.approx(fake.now)


def test_run_throughput_leaves_out_the_first_interval_and_weighs_by_time():
    rows = [{"iteration": i, "step_time_s": s, "tokens_per_s": 100 / s}
            for i, s in ((1, 5.0), (2, 5.0), (3, 1.0), (4, 1.0), (5, 3.0), (6, 3.0))]
    step_s, tokens_per_s = compute_run_throughput(rows, log_interval=2)
    assert step_s == pytest.approx(2.0)
    assert tokens_per_s == pytest.approx(400 / 8.0)  # not the mean of 100 and 33.3
    assert compute_run_throughput(rows[:1], log_interval=2) == pytest.approx((5.0, 20.0))
