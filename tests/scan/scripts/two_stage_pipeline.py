"""A two-stage pipeline by hand (gloo, CPU, 2 ranks): rank 0 computes the first layer and sends
its activations to rank 1, which computes the loss; gradients flow back the same way.

    megatronapp trace run --nproc-per-node 2 -- tests/scan/scripts/two_stage_pipeline.py --steps 4
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    layer = nn.Linear(32, 32)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.01)
    for _ in range(args.steps):
        x = torch.randn(16, 32)
        if rank == 0:
            out = layer(x)
            dist.send(out.detach(), 1)
            grad = torch.empty_like(out)
            dist.recv(grad, 1)
            out.backward(grad)
        else:
            activations = torch.empty(16, 32, requires_grad=False)
            dist.recv(activations, 0)
            activations.requires_grad_()
            layer(activations).square().mean().backward()
            dist.send(activations.grad, 0)
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
