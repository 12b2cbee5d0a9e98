"""A pool of spawned worker processes that run gloo jobs, paid for once per test module.

`ProcessCluster(max_world)` spawns the workers (one torch thread each). `cluster.run(fn,
world_size, *args)` makes the first `world_size` workers join a fresh gloo group (FileStore
in a temp dir), call `fn(rank, world_size, *args)` and return the per-rank results. A child
exception is re-raised here with its rank and traceback; a job that exceeds its timeout
kills the pool (which restarts on the next run) and fails the test instead of hanging.
"""

from __future__ import annotations

import os
import queue
import tempfile
import traceback

import torch.multiprocessing as mp


def _worker_loop(rank: int, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    while True:
        task = tasks.get()
        if task is None:
            return
        fn, world_size, args, store_path, env = task
        os.environ.update(env)
        try:
            store = dist.FileStore(store_path, world_size)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
            try:
                out = fn(rank, world_size, *args)
            finally:
                dist.destroy_process_group()
            results.put((rank, True, out))
        except BaseException:  # report everything, including assertion errors, with the rank
            results.put((rank, False, traceback.format_exc()))


class ProcessCluster:
    def __init__(self, max_world: int, timeout: float = 120.0):
        self.max_world, self.timeout = max_world, timeout
        self._procs = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.max_world)]
        self._procs = [ctx.Process(target=_worker_loop, args=(r, self._tasks[r], self._results), daemon=True)
                       for r in range(self.max_world)]
        for p in self._procs:
            p.start()

    def run(self, fn, world_size: int, *args, timeout: float | None = None, env: dict | None = None) -> list:
        if world_size > self.max_world:
            raise ValueError(f"cluster has {self.max_world} workers, job needs {world_size}")
        if not self._procs:
            self._start()
        tmp = tempfile.mkdtemp(prefix="mapp-store-")
        store_path = os.path.join(tmp, "store")
        for r in range(world_size):
            self._tasks[r].put((fn, world_size, args, store_path, env or {}))
        out, errors = [None] * world_size, []
        for _ in range(world_size):
            try:
                rank, ok, value = self._results.get(timeout=timeout or self.timeout)
            except queue.Empty:
                self.close()
                raise TimeoutError(f"distributed job {fn.__name__} (world {world_size}) timed out") from None
            if ok:
                out[rank] = value
            else:
                errors.append((rank, value))
                self.close()  # peers may be stuck in a collective; restart the pool next time
                break
        if errors:
            rank, tb = errors[0]
            raise RuntimeError(f"rank {rank} failed in {fn.__name__}:\n{tb}")
        return out

    def close(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        self._procs = []
