"""Starting inference ranks: local launch through torch.distributed.run, and per-rank setup."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatronapp.engine.launch_failures import pick_root_failure
from megatronapp.parallel.device import select_device


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip or a == "--nproc-per-node":
            skip = not skip
            continue
        if not a.startswith("--nproc-per-node="):
            out.append(a)
    return out


def launch_ranks(argv: list[str], nproc: int, result_file: Path) -> int:
    """Run the same command on `nproc` local ranks; rank 0 writes `result_file`. Exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    os.environ.setdefault("LOGLEVEL", "ERROR")
    run_args = get_args_parser().parse_args(
        ["--standalone", "--nproc-per-node", str(nproc), "--monitor-interval", "0.1", "--module",
         "megatronapp.cli.main", *_without_nproc(argv), "--result-file", str(result_file)])
    try:
        run(run_args)
    except ChildFailedError as exc:
        rank, failure, message = pick_root_failure(exc.failures)
        print(f"megatronapp: rank {rank} failed (exit code {failure.exitcode}): {message}", file=sys.stderr)
        return 1
    return 0


def start_worker(args: argparse.Namespace):
    """Join the process group (when launched), build groups and load this rank's model."""
    from megatronapp.config import build_layout
    from megatronapp.inference.model import build_inference_model, read_model_config
    from megatronapp.parallel.groups import build_process_groups

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    device = select_device(args.device, int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    layout = build_layout(world, args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    groups = build_process_groups(layout, rank)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    return build_inference_model(read_model_config(args.load), groups, device, load_dir=args.load, dtype=dtype)


def finish_worker() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
