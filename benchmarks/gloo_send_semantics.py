"""Does a gloo send complete before its receiver posts the recv? (It does not: rendezvous.)

Rank 0 isends and waits; rank 1 posts the matching recv only after --delay-s. The static
pipeline runtime waits its comm batches whole (sends included), so this is what couples a
sender to a late receiver there, and what the simulator's "rendezvous" model encodes
(megatronapp/dpp/sim/static_agents.py).

    python benchmarks/gloo_send_semantics.py --delay-s 1
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _run(rank: int, delay_s: float, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    for numel in (16, 128 * 256):
        buf = torch.ones(numel)
        dist.barrier()
        if rank == 0:
            t0 = time.perf_counter()
            work = dist.isend(buf, 1)
            t1 = time.perf_counter()
            work.wait()
            print(f"numel {numel}: isend returned in {1e3 * (t1 - t0):.1f} ms, wait() took "
                  f"{1e3 * (time.perf_counter() - t1):.1f} ms (receiver posts after {1e3 * delay_s:.0f} ms)", flush=True)
        else:
            time.sleep(delay_s)
            dist.recv(buf, 0)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--delay-s", type=float, default=1.0)
    p.add_argument("--port", type=int, default=29631)
    a = p.parse_args()
    mp.spawn(_run, args=(a.delay_s, a.port), nprocs=2)


if __name__ == "__main__":
    main()
