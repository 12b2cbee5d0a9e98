"""A plain PyTorch FSDP2 (fully_shard) training script: a small MLP stack on random data.

    torchrun --nproc-per-node 2 examples/fsdp2_train.py --steps 20
    megatronapp trace run --nproc-per-node 2 -- examples/fsdp2_train.py --steps 20   # traced, unchanged

CPU (gloo) by default; on a machine with CUDA, one GPU per rank (NCCL).

STRAGGLER_RANK=R STRAGGLER_WORK=K: rank R also does K extra matmuls of the hidden size in every
step's data preparation, as a user's script with an uneven data step would (the fault lab,
megatronapp/faultlab, sets these to make a real straggler the tracer knows nothing of).
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = (
            nn.LayerNorm(hidden),
            nn.Linear(hidden, 4 * hidden),
            nn.Linear(4 * hidden, hidden),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(args.hidden) for _ in range(args.layers)], nn.Linear(args.hidden, 1)).to(device)
    for block in model[:-1]:
        fully_shard(block)  # one all-gather (forward, backward) and reduce-scatter per block
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1 + rank)
    extra = int(os.environ.get("STRAGGLER_WORK", "0")) if os.environ.get("STRAGGLER_RANK") == str(rank) else 0
    weight = torch.randn(args.hidden, args.hidden, generator=gen).to(device) / args.hidden**0.5
    for step in range(args.steps):
        x = torch.randn(args.batch, args.hidden, generator=gen).to(device)
        for _ in range(extra):  # this rank's uneven data step (see the docstring)
            x = torch.tanh(x @ weight)
        loss = nn.functional.mse_loss(model(x), x[:, :1].cos())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
