"""`megatronapp trace probe`: measure every directed link of a job's layout, on its own ranks.

    megatronapp trace probe --nproc-per-node 4 --pipeline-model-parallel-size 2 --out probe.json
    torchrun --nproc-per-node 4 -m megatronapp.scan.probe_run --pipeline-model-parallel-size 2

The pairs are those of the TP x PP x DP layout given (probe.compute_probe_pairs: pipeline
neighbours, and ring neighbours of each data- and tensor-parallel group), measured over the
job's backend (NCCL on GPUs, else gloo); rank 0 prints the table (MB/s per directed link beside
the median of its comparable links) and writes every measurement as JSON.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from megatronapp.flags import add_flags, read_flags
from megatronapp.launch.flags import LAYOUT_FLAGS, NPROC_PER_NODE, VIRTUAL_STAGES
from megatronapp.launch.local import launched_world_size, rank_argv, run_local_ranks, under_launcher
from megatronapp.launch.roles import backend_for, init_default_group
from megatronapp.parallel.device import select_device
from megatronapp.parallel.layout import ParallelLayout
from megatronapp.scan.probe import compute_probe_pairs, find_slow_links, measure_links, render_probe
from megatronapp.scan.probe_config import PROBE_FLAGS, ProbeConfig, save_probe


@dataclass(frozen=True)
class ProbeRun:
    """What `trace probe` will launch: the layout's links measured on `layout.world_size` ranks."""

    layout: ParallelLayout
    config: ProbeConfig
    out: str | None = None  # JSON written here by rank 0 (print only without)


def add_probe_arguments(parser: argparse.ArgumentParser) -> None:
    """`trace probe`'s flags: the launch and layout flags `train` takes, and the probe's own."""
    add_flags(parser, (NPROC_PER_NODE, *LAYOUT_FLAGS), ParallelLayout)
    add_flags(parser, (VIRTUAL_STAGES,))
    add_flags(parser, PROBE_FLAGS, ProbeConfig)
    parser.add_argument("--out", default=None, help="write every link's measurement here as JSON")
    parser.set_defaults(build_run=build_probe_run, launch=launch_probe)


def build_probe_run(args: argparse.Namespace) -> ProbeRun:
    """The run of the parsed flags; ValueError (one line) for a run that cannot measure anything."""
    world = launched_world_size(args.nproc_per_node)
    if world < 2:
        raise ValueError("trace probe needs at least 2 ranks: give --nproc-per-node N (N >= 2) or run under torchrun")
    layout = ParallelLayout(
        world,
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.num_virtual_stages_per_pipeline_rank or 1,
    )
    return ProbeRun(layout, ProbeConfig(**read_flags(args, PROBE_FLAGS)), args.out)


def check_probe_run(run: ProbeRun) -> None:
    """The output's folder exists (the layout and the probe's settings checked themselves)."""
    if run.out is not None and not Path(run.out).resolve().parent.is_dir():
        raise ValueError(f"--out {run.out}: folder {Path(run.out).parent} does not exist")


def launch_probe(run: ProbeRun, argv: list[str]) -> int:
    """Measure as a rank (under torchrun) or launch the command on its local ranks; the exit code."""
    if under_launcher():
        return run_probe_rank(run)
    return run_local_ranks("megatronapp.cli.main", rank_argv(argv), run.layout.world_size, "megatronapp trace probe")


def run_probe_rank(run: ProbeRun) -> int:
    """One rank of the probe: join the world, measure every link, rank 0 prints and writes."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    device = select_device(None, int(os.environ.get("LOCAL_RANK", "0")))  # a GPU where there is one
    init_default_group(backend_for(device), world, rank)
    try:
        pairs = compute_probe_pairs(run.layout)
        start = time.perf_counter()
        links = measure_links(
            pairs, rank, payload_bytes=run.config.payload_bytes, repeats=run.config.repeats, device=device
        )
        seconds = time.perf_counter() - start
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank == 0:
        print(render_probe(links), flush=True)
        print(f"measured {len(links)} directed links in {seconds:.2f} s")
        if run.out:
            slow = [[s.src, s.dst] for s, _ in find_slow_links(links)]
            config = run.config
            links_json = [m.as_dict() for m in links]
            save_probe(run.out, links_json, slow=slow, payload_bytes=config.payload_bytes, repeats=config.repeats)
            print(f"wrote {run.out}")
    return 0


def main(argv=None) -> int:
    """torchrun entry point: the same flags as `megatronapp trace probe`, minus --nproc-per-node."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_probe_arguments(parser)
    return run_probe_rank(build_probe_run(parser.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
