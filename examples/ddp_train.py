"""A plain PyTorch DDP training script (nothing MegaScan-specific): an MLP regression on random data.

    torchrun --nproc-per-node 2 examples/ddp_train.py --steps 20
    megatronapp trace run --nproc-per-node 2 -- examples/ddp_train.py --steps 20   # traced, unchanged

CPU (gloo) by default; on a machine with CUDA, one GPU per rank (NCCL).

STRAGGLER_RANK=R STRAGGLER_WORK=K: rank R also does K extra matmuls of the hidden size in every
forward, as a user's script with an uneven data or augmentation step would (the fault lab,
megatronapp/faultlab, sets these to make a real straggler the tracer knows nothing of).
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--bucket-mb", type=float, default=0.1, help="DDP gradient bucket size (MiB)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, args.hidden), nn.GELU(), nn.Linear(args.hidden, args.hidden), nn.GELU(), nn.Linear(args.hidden, 1)
    ).to(device)
    ddp = DDP(model, device_ids=[device.index] if cuda else None, bucket_cap_mb=args.bucket_mb)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1 + rank)
    extra = int(os.environ.get("STRAGGLER_WORK", "0")) if os.environ.get("STRAGGLER_RANK") == str(rank) else 0
    scratch = torch.randn(args.batch, args.hidden, generator=gen).to(device)
    weight = torch.randn(args.hidden, args.hidden, generator=gen).to(device) / args.hidden**0.5
    for step in range(args.steps):
        x = torch.randn(args.batch, 64, generator=gen).to(device)
        y = x[:, :1] * 0.5 + x[:, 1:2].sin()
        out = ddp(x)
        for _ in range(extra):  # this rank's uneven extra work (see the docstring)
            scratch = torch.tanh(scratch @ weight)
        loss = nn.functional.mse_loss(out + 0 * scratch[:, :1], y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
