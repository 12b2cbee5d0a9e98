"""A pool of spawned worker processes that run gloo jobs, paid for once per test session.

`ProcessCluster(max_world)` spawns workers (one torch thread each) as jobs first need them.
`cluster.run(fn, world_size, *args)` makes the first `world_size` workers join a fresh gloo
group (FileStore in a temp dir), call `fn(rank, world_size, *args)` and return the per-rank
results. A child exception is re-raised here with its rank and traceback; a job that exceeds
its timeout kills the pool (which restarts on the next run) and fails the test instead of
hanging. A job's `env` is set for that job only. conftest.py shares one pool (the `cluster`
fixture) across every test module.
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
        saved = dict(os.environ)
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
        finally:  # the next job (maybe another module's) must not inherit this one's environment
            os.environ.clear()
            os.environ.update(saved)


class ProcessCluster:
    def __init__(self, max_world: int, timeout: float = 120.0):
        self.max_world, self.timeout = max_world, timeout
        self._procs = []

    def _grow(self, world_size: int) -> None:
        """Spawn workers until there are `world_size` (the results queue is made with the first)."""
        ctx = mp.get_context("spawn")
        if not self._procs:
            self._results, self._tasks = ctx.Queue(), []
        for r in range(len(self._procs), world_size):
            self._tasks.append(ctx.Queue())
            p = ctx.Process(target=_worker_loop, args=(r, self._tasks[r], self._results), daemon=True)
            p.start()
            self._procs.append(p)

    def run(self, fn, world_size: int, *args, timeout: float | None = None, env: dict | None = None) -> list:
        if world_size > self.max_world:
            raise ValueError(f"cluster has {self.max_world} workers, job needs {world_size}")
        self._grow(world_size)
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
