"""A plain DDP script (gloo, CPU) whose rank SLOW_RANK does about twice its peers' compute in its
forward (extra matmuls) and, before building DDP, ran LOCAL_STEPS optimizer steps of its own, so
its iteration counter runs ahead of its peers'. With --no-collectives no rank builds DDP: each
trains alone, and the ranks share no collective at all.

    megatronapp trace run --nproc-per-node 4 -- tests/scan/scripts/ddp_local_steps.py --steps 12
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Regressor(nn.Module):
    """An MLP whose forward optionally does `extra` more matmuls of the hidden size (a straggler's
    uneven work, inside the forward the tracer times)."""

    def __init__(self, hidden: int, extra: int, seed: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, hidden), nn.GELU(), nn.Linear(hidden, 1))
        gen = torch.Generator().manual_seed(seed)
        self.register_buffer("mix", torch.randn(hidden, hidden, generator=gen) / hidden**0.5)
        self.extra, self.hidden = extra, hidden

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        scratch = torch.ones(x.shape[0], self.hidden)
        for _ in range(self.extra):
            scratch = torch.tanh(scratch @ self.mix)
        return out + 0 * scratch[:, :1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--extra", type=int, default=3, help="extra matmuls in the slow rank's forward")
    parser.add_argument("--no-collectives", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    slow = rank == int(os.environ.get("SLOW_RANK", "-1"))
    torch.manual_seed(0)
    model = Regressor(args.hidden, args.extra if slow else 0, seed=0)
    gen = torch.Generator().manual_seed(1 + rank)

    def train_step(net, optimizer) -> None:
        x = torch.randn(args.batch, 64, generator=gen)
        loss = nn.functional.mse_loss(net(x), x[:, :1])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    if slow:
        local = torch.optim.SGD(model.parameters(), lr=1e-3)
        for _ in range(int(os.environ.get("LOCAL_STEPS", "0"))):
            train_step(model, local)
    net = model if args.no_collectives else DDP(model, bucket_cap_mb=0.1)
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)
    for _ in range(args.steps):
        train_step(net, optimizer)
    if args.no_collectives:
        dist.barrier()  # untraced teardown: every rank has finished its steps
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
