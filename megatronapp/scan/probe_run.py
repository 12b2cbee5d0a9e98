"""One rank of a standalone link probe, under torchrun (or `megatronapp trace probe`, which launches it).

    torchrun --nproc-per-node 4 -m megatronapp.scan.probe_run --pipeline-model-parallel-size 2 --out probe.json

The pairs are those of the TP x PP x DP layout given (default: every rank a pipeline stage of one
pipeline); rank 0 prints the table and writes every link's measurement as JSON.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from megatronapp.files import write_text_atomic
from megatronapp.parallel.layout import ParallelLayout
from megatronapp.scan.probe import compute_probe_pairs, find_slow_links, measure_links, render_probe


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP of the job's layout (default: 1)")
    p.add_argument(
        "--pipeline-model-parallel-size", type=int, default=None, help="PP of the job's layout (default: every rank)"
    )
    p.add_argument("--virtual-stages", type=int, default=1, help="virtual stages per pipeline rank (default: 1)")
    p.add_argument("--payload-mb", type=float, default=4.0, help="bytes sent one way per probe, in MB (default: 4)")
    p.add_argument("--repeats", type=int, default=5, help="timed round trips per link (default: 5)")
    p.add_argument("--out", default=None, help="write every link's measurement here as JSON (default: print only)")
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        pp = a.pipeline_model_parallel_size or world // a.tensor_model_parallel_size
        layout = ParallelLayout(world, a.tensor_model_parallel_size, pp, a.virtual_stages)
        links = measure_links(
            compute_probe_pairs(layout), rank, payload_bytes=int(a.payload_mb * 1e6), repeats=a.repeats, device=device
        )
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print(render_probe(links), flush=True)
        if a.out:
            slow = [[s.src, s.dst] for s, _ in find_slow_links(links)]
            write_text_atomic(a.out, json.dumps({"links": [m.as_dict() for m in links], "slow": slow}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
