"""MegaDPP's dynamic runtime on CUDA: the stream and event rules of dpp/streams.py on one GPU,
the runtime on one GPU, and, where two GPUs are visible, a PP2 job over NCCL against the
static interleaved schedule. Skipped on CPU (see conftest); `pytest -m gpu`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from engine_jobs import RandomTokenBatches, make_job

from megatronapp.dpp.config import DppConfig, JitterSpec
from megatronapp.dpp.jitter import JitterInjector
from megatronapp.dpp.job_hooks import build_dynamic_runtime_factory
from megatronapp.dpp.streams import CudaOrder
from megatronapp.engine.trainer import Trainer
from megatronapp.injection.inject import calibrate_spin
from megatronapp.parallel.groups import single_process_groups

pytestmark = pytest.mark.gpu
TASK_MS = 40.0


def _spin(ms: float) -> None:
    torch.cuda._sleep(int(ms * _spin.cycles_per_ms))


_spin.cycles_per_ms = 0.0


@pytest.fixture(scope="module", autouse=True)
def _calibrated():
    _spin.cycles_per_ms = calibrate_spin()


def test_the_pacer_keeps_the_host_one_task_ahead():
    """Five 40 ms GPU tasks: unpaced, the host enqueues them all at once; paced, it returns
    from the fifth only once the fourth has run (>= 4 x 40 ms), with the fifth still running."""
    order, dev = CudaOrder(torch.device("cuda", torch.cuda.current_device())), torch.device("cuda")
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(5):
        _spin(TASK_MS)
    unpaced = time.perf_counter() - t0
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(5):
        _spin(TASK_MS)
        order.after_task()
    paced = time.perf_counter() - t0
    still_running = not torch.cuda.current_stream().query()
    torch.cuda.synchronize(dev)
    assert unpaced < 0.5 * TASK_MS / 1000, unpaced
    assert 0.9 * 4 * TASK_MS / 1000 < paced < 5 * TASK_MS / 1000, paced
    assert still_running


def test_a_send_on_the_side_stream_waits_for_its_producer():
    """The sender thread reads the tensor on its own stream after the compute thread's mark:
    it sees the producer's values, though the producer ran 40 ms behind the host."""
    order = CudaOrder(torch.device("cuda", torch.cuda.current_device()))
    x = torch.zeros(1 << 20, device="cuda")
    _spin(TASK_MS)
    x.fill_(7.0)  # the producer, behind the spin on the compute stream
    mark = order.mark()
    got = {}

    def sender():
        with order.side_stream():
            order.after_mark(mark)
            got["copy"] = x.clone()
            torch.cuda.current_stream().synchronize()

    t = threading.Thread(target=sender)
    t.start()
    t.join(timeout=30)
    assert bool((got["copy"] == 7.0).all())


def test_a_message_counts_as_arrived_only_once_it_is_on_the_gpu():
    """complete() returns after the receive's work is done on the device, not when posted."""
    order = CudaOrder(torch.device("cuda", torch.cuda.current_device()))
    _spin(TASK_MS)
    produced = torch.cuda.Event()
    produced.record()

    class Work:  # an NCCL receive's wait(): the current stream waits for the data
        def wait(self):
            torch.cuda.current_stream().wait_event(produced)

    t0 = time.perf_counter()
    with order.side_stream():
        order.complete(Work(), None, src=0)
    assert time.perf_counter() - t0 > 0.9 * TASK_MS / 1000
    assert produced.query()


def test_jitter_on_the_gpu_stretches_each_kind_of_task_by_its_own_factor():
    """A 10 ms forward and a 20 ms backward alternate; each takes its drawn factor x its own
    time (one running mean over both would give the forward (factor - 1) x 15 ms extra)."""
    inj = JitterInjector(JitterSpec(0, 2.0, seed=3), torch.device("cuda"))

    def task(key: str, ms: float):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with inj.compute(key):
            _spin(ms)
        end.record()
        return start, end, ms

    for _ in range(6):  # settle both estimates
        task("forward", 10.0), task("backward", 20.0)
    first = len(inj.factors)
    timed = [task(key, ms) for _ in range(4) for key, ms in (("forward", 10.0), ("backward", 20.0))]
    torch.cuda.synchronize()
    for (start, end, ms), factor in zip(timed, inj.factors[first:]):
        assert abs(start.elapsed_time(end) / (factor * ms) - 1.0) < 0.08, (ms, factor, start.elapsed_time(end))


def test_dynamic_runtime_on_one_gpu_trains_as_1f1b():
    """PP1 on CUDA: the pacer and the CUDA order inside the runtime, the same losses as 1F1B."""

    def losses(schedule: str) -> list[float]:
        job = make_job(1, 1, 1, 1, schedule, global_batch=4)
        factory = build_dynamic_runtime_factory(DppConfig(), job) if schedule == "dynamic" else None
        trainer = Trainer(
            job,
            single_process_groups(job.layout),
            torch.device("cuda"),
            RandomTokenBatches(job, 0),
            runtime_factory=factory,
        )
        return [m.loss for m in trainer.train(3)]

    torch.testing.assert_close(losses("dynamic"), losses("1f1b"), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL between distinct devices)")
def test_dynamic_pp2_over_nccl_matches_interleaved(tmp_path):
    """PP2 V2 over NCCL, payloads on a group per direction (dpp/channels.py): the same losses
    as static interleaved 1F1B, for in-order and depth-first under the tightest cap."""

    def run(schedule: str, *extra: str) -> list[float]:
        metrics = tmp_path / f"{schedule}{len(extra)}.jsonl"
        args = [
            "train",
            "--device",
            "cuda",
            "--model",
            "tiny",
            "--nproc-per-node",
            "2",
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
            "--pipeline-schedule",
            schedule,
            *extra,
            "--global-batch-size",
            "8",
            "--micro-batch-size",
            "1",
            "--train-iters",
            "3",
            "--metrics-file",
            str(metrics),
        ]
        res = subprocess.run(
            [sys.executable, "-m", "megatronapp.cli.main", *args],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert res.returncode == 0, res.stderr[-3000:]
        return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]

    static = run("interleaved")
    for extra in (("--dpp-traversal", "in-order"), ("--dpp-traversal", "depth-first", "--dpp-max-inflight", "2")):
        torch.testing.assert_close(run("dynamic", *extra), static, rtol=1e-4, atol=1e-5)
