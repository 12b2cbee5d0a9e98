"""GPU benchmarks, side by side in one process: engine MFU vs a plain PyTorch GPT, and
MegaScan tracing overhead (off / base / full) on a compute-bound and a launch-bound model.

    python benchmarks/gpu_bench.py --out results.json [--compile-baseline]

MFU modes are interleaved in rounds (A B C A B C ...) so clock/thermal drift hits all alike;
each figure is the median over rounds of (wall time of `--steps` steps / steps), measured
with torch.cuda.synchronize around the steps. Tracing overhead uses paired rounds (off /
base / full back to back in random order, median of per-round ratios with a bootstrap CI;
see scan_overhead.py), one line per variant:

    python benchmarks/gpu_bench.py --only trace_small --overhead-rounds 30

MFU counts 6*params + 12*layers*hidden*seq FLOPs per token
against 989 TFLOP/s (H200 dense bf16).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import scan_overhead  # noqa: E402
from plain_gpt import PlainGPT, plain_train_step  # noqa: E402

from megatronapp.config import JobConfig, TrainConfig, build_layout, model_preset  # noqa: E402
from megatronapp.engine.trainer import Trainer  # noqa: E402
from megatronapp.parallel.groups import single_process_groups  # noqa: E402

PEAK_FLOPS = 989e12


class GpuRandomBatches:
    def __init__(self, job: JobConfig, device):
        t, m = job.train, job.model
        self.mbs = [torch.randint(0, m.padded_vocab_size, (t.micro_batch_size, m.seq_length + 1), device=device)
                    for _ in range(job.num_microbatches)]

    def next_microbatches(self):
        return self.mbs


def make_job(preset: str, micro_batch: int, num_micro: int, distributed_optimizer: bool = False) -> JobConfig:
    """Megatron bf16 (bf16 params, fp32 main grads and master weights), optionally ZeRO-1."""
    model = model_preset(preset, vocab_size=50304)
    train = TrainConfig(micro_batch_size=micro_batch, global_batch_size=micro_batch * num_micro,
                        train_iters=10**6, lr=1e-4, bf16=True, use_distributed_optimizer=distributed_optimizer,
                        overlap_param_gather=distributed_optimizer)
    return JobConfig(model=model, train=train, layout=build_layout(1, 1, 1))


def compiled_job(job: JobConfig) -> JobConfig:
    return replace(job, train=replace(job.train, compile=True))


def timed(fn, steps: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def bench_mfu(args, results: dict) -> None:
    job = make_job("1.3b", 4, args.num_micro, args.use_distributed_optimizer)
    dev = torch.device("cuda")
    tokens = job.train.global_batch_size * job.model.seq_length
    flops = job.model.flops_per_token() * tokens
    data = GpuRandomBatches(job, dev)
    trainer = Trainer(job, single_process_groups(), dev, data)
    ctrainer = Trainer(compiled_job(job), single_process_groups(), dev, data)
    plain = PlainGPT(job.model, dev)
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-4, fused=True)
    compiled = torch.compile(plain)
    modes = {"engine": trainer.train_step, "engine_compiled": ctrainer.train_step,
             "plain": lambda: plain_train_step(plain, popt, data.mbs),
             "plain_compiled": lambda: plain_train_step(compiled, popt, data.mbs)}
    for fn in modes.values():
        for _ in range(args.warmup):
            fn()
    times = {k: [] for k in modes}
    for _ in range(args.rounds):
        for k, fn in modes.items():
            times[k].append(timed(fn, args.steps))
    out = {}
    for k, ts in times.items():
        t = statistics.median(ts)
        out[k] = {"step_s": t, "tokens_per_s": tokens / t, "mfu": flops / t / PEAK_FLOPS,
                  "spread": (max(ts) - min(ts)) / t}
    out["params"] = job.model.num_parameters()
    out["engine_vs_plain"] = out["plain"]["step_s"] / out["engine"]["step_s"]
    out["engine_compiled_vs_plain_compiled"] = out["plain_compiled"]["step_s"] / out["engine_compiled"]["step_s"]
    out["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
    # model-state bytes of the engine by kind (bf16 params, fp32 main grads/params, Adam)
    out["engine_state_gb"] = {k: v / 2**30 for k, v in trainer.optimizer.state_bytes().items()}
    results["mfu_1.3b"] = out
    del trainer, ctrainer, plain, popt, compiled
    torch.cuda.empty_cache()


def bench_trace_overhead(args, results: dict, preset: str, micro_batch: int, label: str, steps: int) -> None:
    """Step time with tracing off / base / full on the compiled engine: paired rounds, median
    of per-round ratios with a bootstrap CI (scan_overhead.py says why and how)."""
    summary = scan_overhead.bench(preset, micro_batch, args.num_micro, torch.device("cuda"), steps,
                                  args.overhead_rounds, args.warmup, compile_model=True, seed=args.seed)
    for variant in scan_overhead.VARIANTS[1:]:
        print(scan_overhead.format_line(label, variant, summary), flush=True)
    results[f"trace_overhead_{label}"] = summary
    torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="gpu_bench.json")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--num-micro", type=int, default=2)
    p.add_argument("--only", default="mfu,trace_big,trace_small")
    p.add_argument("--overhead-rounds", type=int, default=30, help="paired rounds of the tracing-overhead benchmarks")
    p.add_argument("--seed", type=int, default=0, help="order of the variants within the paired rounds")
    p.add_argument("--use-distributed-optimizer", action="store_true", help="engine modes with ZeRO-1 (DP 1 here)")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args)}
    only = args.only.split(",")
    if "mfu" in only:
        bench_mfu(args, results)
        print(json.dumps(results["mfu_1.3b"], indent=1), flush=True)
    if "trace_small" in only:
        bench_trace_overhead(args, results, "small", 2, "small", steps=10)
    if "trace_big" in only:
        bench_trace_overhead(args, results, "1.3b", 4, "1.3b", steps=3)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
