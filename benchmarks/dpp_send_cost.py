"""What a dynamic-pipeline send costs the compute thread, with and without the sender thread.

gloo's isend writes to the socket before it returns, so on the compute thread each message
(header + payload isends) delays the rank's next task. This runs one PP x V2 dynamic
(in-order) job on gloo (one thread per rank, the demo model at dpp_bench's sizes) and
alternates, step by step in ABBA order, the sender thread on and off (--dpp-send-thread
on / off; auto picks it where each rank has a spare core). Per variant it reports rank 0's compute-thread time per
`send_task_message` (median, mean) and per step, and the step time; the paired per-step ratio
(inline / threaded: > 1 means the thread is faster) with its median and range.

    python benchmarks/dpp_send_cost.py --pp 2 --steps 40              # the 2-core VM
    python benchmarks/dpp_send_cost.py --pp 8 --steps 40 --num-layers 16   # the 16-core host
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _timed_send(times: list):
    from megatronapp.dpp.transport import send_task_message

    def timed_send(*args, **kwargs) -> None:
        t0 = time.perf_counter()
        send_task_message(*args, **kwargs)
        times.append(time.perf_counter() - t0)

    return timed_send


def _worker(rank: int, a, port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=a.pp)
    import megatronapp.dpp.runtime as runtime
    from engine_jobs import RandomTokenBatches
    from megatronapp.config import JobConfig, TrainConfig, build_layout, model_preset
    from megatronapp.dpp.config import DppConfig
    from megatronapp.dpp.setup import build_dynamic_runtime_factory
    from megatronapp.engine.trainer import Trainer
    from megatronapp.parallel.groups import build_process_groups

    model = model_preset("demo", num_layers=a.num_layers, hidden_size=a.hidden_size, seq_length=a.seq_length)
    train = TrainConfig(micro_batch_size=1, global_batch_size=a.microbatches, train_iters=10**6, schedule="dynamic")
    job = JobConfig(model=model, train=train, layout=build_layout(a.pp, 1, a.pp, 2))
    send_times: list = []
    runtime.send_task_message = _timed_send(send_times)
    trainer = Trainer(job, build_process_groups(job.layout, rank), torch.device("cpu"), RandomTokenBatches(job, 0),
                      runtime_factory=build_dynamic_runtime_factory(DppConfig("in-order"), job))
    for _ in range(a.warmup):
        trainer.train_step()
    rows = {True: {"step_s": [], "send_s": []}, False: {"step_s": [], "send_s": []}}
    for k in range(a.steps):
        threaded = (k % 2) ^ ((k // 2) % 2) == 0  # ABBA: a slow phase of the host hits both
        trainer.runtime.send_thread = threaded  # what DppConfig's on / off resolve to
        send_times.clear()
        dist.barrier()
        t0 = time.perf_counter()
        trainer.train_step()
        rows[threaded]["step_s"].append(time.perf_counter() - t0)
        rows[threaded]["send_s"].append(list(send_times))
    if rank == 0:
        Path(out).write_text(json.dumps({"threaded": rows[True], "inline": rows[False]}))
    dist.destroy_process_group()


def summarize(rows: dict) -> dict:
    out = {}
    for name, r in rows.items():
        sends = [s for step in r["send_s"] for s in step]
        out[name] = {"step_ms_median": statistics.median(r["step_s"]) * 1e3,
                     "send_us_median": statistics.median(sends) * 1e6, "send_us_mean": statistics.fmean(sends) * 1e6,
                     "send_ms_per_step": sum(sends) / len(r["step_s"]) * 1e3, "messages_per_step": len(sends) / len(r["step_s"])}
    ratios = [i / t for i, t in zip(rows["inline"]["step_s"], rows["threaded"]["step_s"])]
    out["inline_over_threaded"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                                   "n": len(ratios)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--steps", type=int, default=40, help="measured steps, half each way")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--port", type=int, default=29541)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.pp < 2 or a.num_layers % (2 * a.pp) or a.microbatches % a.pp or a.steps < 4:
        p.error("needs --pp >= 2, --num-layers divisible by 2 * pp, --microbatches by pp, --steps >= 4")
    raw = Path(a.json or "/tmp/dpp_send_cost.raw.json").with_suffix(".raw.json")
    mp.spawn(_worker, args=(a, a.port, str(raw)), nprocs=a.pp)
    result = {"args": vars(a), **summarize(json.loads(raw.read_text()))}
    print(json.dumps(result, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
