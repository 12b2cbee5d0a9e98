"""MegaFBD benchmark: throughput and memory of backward workers against the plain engine.

    python benchmarks/fbd_bench.py --device cpu --pp 2 --dp 2 --rounds 3          # 8 CPU processes
    python benchmarks/fbd_bench.py --device cuda --pp 2 --model small --micro-batch 8 \\
        --variants plain recompute fbd fbd_cpu_forward free_forward --out fbd.json   # GPU (the lead)
    python benchmarks/fbd_bench.py --device cuda --pp 2 --max-micro-batch 64        # largest that fits

Variants (same model, data and backward layout TP x PP x DP; FBD adds TF x PP x DP forward ranks):
  plain            the engine, 1F1B
  recompute        the engine with full activation recompute (the fair baseline: FBD recomputes)
  fbd              FBD, forward workers on --device (on CUDA: the GPU of their backward twin)
  fbd_cpu_forward  FBD, forward workers on CPUs
  free_forward     FBD whose forward workers send zeros without computing: the upper bound of
                   backward workers that never wait (its losses are meaningless)
Variants are interleaved round by round (A B C A B C ...); each round is a fresh job. Reported
per variant: median and min..max over rounds of tokens/s (steady state: the first `--warmup`
steps are dropped) and of peak memory allocated on backward workers (CUDA only).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

from megatronapp.config import JobConfig, TrainConfig, build_layout, model_preset, validate_job

VARIANTS = ("plain", "recompute", "fbd", "fbd_cpu_forward", "free_forward")


class RandomBatches:
    """Fixed random microbatches of this DP rank (data loading is not what is measured)."""

    def __init__(self, job: JobConfig, dp_rank: int):
        gen = torch.Generator().manual_seed(1234 + dp_rank)
        t, m = job.train, job.model
        self.mbs = [torch.randint(0, m.vocab_size, (t.micro_batch_size, m.seq_length + 1), generator=gen)
                    for _ in range(job.num_microbatches)]

    def next_microbatches(self):
        return self.mbs


def _device(kind: str, index: int) -> torch.device:
    if kind == "cpu":
        return torch.device("cpu")
    index %= torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _run_rank(rank: int, world: int, variant: str, job: JobConfig, args, store_path: str) -> dict:
    import torch.distributed as dist

    from megatronapp.engine.trainer import Trainer
    from megatronapp.fbd.backward import BackwardWorker
    from megatronapp.fbd.config import FbdConfig
    from megatronapp.fbd.forward import ForwardWorker
    from megatronapp.parallel.groups import build_process_groups, build_role_groups
    from megatronapp.parallel.layout import RoleLayout

    torch.set_num_threads(args.threads)
    fbd = variant in ("fbd", "fbd_cpu_forward", "free_forward")
    fwd_kind = "cpu" if variant == "fbd_cpu_forward" else args.device
    backend = "gloo" if args.device == "cpu" else ("nccl" if fwd_kind == "cuda" else "cpu:gloo,cuda:nccl")
    dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    steps = args.warmup + args.steps
    if not fbd:
        device = _device(args.device, rank)
        groups = build_process_groups(job.layout, rank)
        trainer = Trainer(job, groups, device, RandomBatches(job, groups.dp_rank))
        return _timed(trainer, steps, args.warmup, device)
    lay = RoleLayout(world, args.tp, args.pp, args.tf)
    groups = build_role_groups(lay, rank)
    c = groups.coords
    twin = lay.backward_rank(c.tp % lay.tp_size, c.dp, c.pp) if c.is_forward else rank
    device = _device(fwd_kind if c.is_forward else args.device, twin)
    link = torch.device("cpu") if "gloo" in backend else device
    cfg = FbdConfig(forward_tp_size=args.tf, max_ahead=args.max_ahead, free_forward=variant == "free_forward")
    data = RandomBatches(job, c.dp)
    if c.is_forward:
        ForwardWorker(job, cfg, groups, device, data, link_device=link).train(steps)
        return {}
    return _timed(BackwardWorker(job, cfg, groups, device, data, link_device=link).trainer, steps, args.warmup, device)


def _timed(trainer, steps: int, warmup: int, device) -> dict:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.train_step()  # resolves its metrics: one host sync per step
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"step_s": statistics.median(times[warmup:]), "peak_gb": peak}


def _child(rank, world, variant, job, args, store_path, results):
    try:
        results.put((rank, _run_rank(rank, world, variant, job, args, store_path), None))
    except BaseException as e:  # noqa: BLE001 - an OOM is a result when searching the largest batch
        results.put((rank, None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))


def run_variant(variant: str, job: JobConfig, args) -> dict:
    """One fresh job of `variant`; tokens/s of the step (global batch) and peak backward memory."""
    backward_world = args.tp * args.pp * args.dp
    world = backward_world + (args.tf * args.pp * args.dp if variant not in ("plain", "recompute") else 0)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = os.path.join(tempfile.mkdtemp(prefix="fbd-bench-"), "store")
    procs = [ctx.Process(target=_child, args=(r, world, variant, job, args, store, results)) for r in range(world)]
    for p in procs:
        p.start()
    outs, error = {}, None
    try:
        for _ in range(world):
            rank, out, err = results.get(timeout=args.timeout)
            if err:
                error = f"rank {rank}: {err}"
                break
            outs[rank] = out
    except queue.Empty:
        error = f"timed out after {args.timeout} s"
    for p in procs:
        if error:
            p.kill()
        p.join(timeout=30)
    if error:
        return {"error": error}
    step_s = max(o["step_s"] for r, o in outs.items() if r < backward_world)
    peaks = [o["peak_gb"] for r, o in outs.items() if r < backward_world and o.get("peak_gb") is not None]
    tokens = job.train.global_batch_size * job.model.seq_length
    return {"tokens_per_s": tokens / step_s, "peak_gb": max(peaks) if peaks else None}


def build_bench_job(args, micro_batch: int, variant: str) -> JobConfig:
    model = model_preset(args.model, **({"seq_length": args.seq_length} if args.seq_length else {}))
    train = TrainConfig(micro_batch_size=micro_batch, global_batch_size=micro_batch * args.dp * args.microbatches,
                        train_iters=10**6, lr=1e-4, bf16=args.device == "cuda",
                        recompute_granularity="full" if variant == "recompute" else "none")
    job = JobConfig(model=model, train=train, layout=build_layout(args.tp * args.pp * args.dp, args.tp, args.pp))
    validate_job(job)
    return job


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def bench_throughput(args) -> dict:
    runs: dict[str, list[dict]] = {v: [] for v in args.variants}
    for r in range(args.rounds):
        for v in args.variants:  # interleaved
            runs[v].append(run_variant(v, build_bench_job(args, args.micro_batch, v), args))
            print(f"round {r} {v}: {runs[v][-1]}", file=sys.stderr)
    report = {}
    for v, rs in runs.items():
        ok = [x for x in rs if "error" not in x]
        report[v] = {"tokens_per_s": _summary([x["tokens_per_s"] for x in ok]) if ok else None,
                     "peak_gb": _summary([x["peak_gb"] for x in ok]) if ok and ok[0]["peak_gb"] else None,
                     "errors": [x["error"] for x in rs if "error" in x]}
    return report


def bench_max_micro_batch(args) -> dict:
    """Largest power-of-two micro batch (up to --max-micro-batch) each variant trains without error."""
    out = {}
    for v in args.variants:
        best, mbs = None, 1
        while mbs <= args.max_micro_batch:
            res = run_variant(v, build_bench_job(args, mbs, v), replace_args(args, warmup=0, steps=2))
            print(f"{v} micro batch {mbs}: {res}", file=sys.stderr)
            if "error" in res:
                break
            best, mbs = mbs, mbs * 2
        out[v] = best
    return out


def replace_args(args, **kw):
    return argparse.Namespace(**{**vars(args), **kw})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model", default="tiny")
    p.add_argument("--seq-length", type=int, default=None)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--tf", type=int, default=1, help="forward workers' TP size")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=4, help="per DP rank and step")
    p.add_argument("--max-ahead", type=int, default=2)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=["plain", "recompute", "fbd", "free_forward"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per job before it is killed")
    p.add_argument("--max-micro-batch", type=int, default=0, help="search the largest micro batch instead")
    p.add_argument("--out", default=None, help="write the JSON report here")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("fbd_bench: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    report = {"args": vars(args)}
    report["max_micro_batch" if args.max_micro_batch else "throughput"] = (
        bench_max_micro_batch(args) if args.max_micro_batch else bench_throughput(args))
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
