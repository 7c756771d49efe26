"""A pool of spawned gloo ranks that runs many test cases in one process group.

Spawning ranks costs seconds, so each world size gets one pool per test session and
every case runs inside it: ``pool.run(fn, *args)`` calls ``fn(rank, world, *args)`` on
every rank (``fn`` must be a module-level function) and returns the per-rank results.
A rank's exception fails the call with that rank's traceback; a hang fails after
``timeout`` seconds and the pool is restarted for the next call.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import sys
import traceback

import torch.multiprocessing as mp

DEVICE_ENV = "GDN_CP_TEST_DEVICE"  # "cpu" (default) or "cuda": where test tensors live


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, tasks, results, path, backend):
    sys.path[:] = path
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl" or os.environ.get(DEVICE_ENV) == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, True, fn(rank, world, *args)))
        except BaseException:  # report everything, keep serving
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class GlooPool:
    def __init__(self, world: int, backend: str = "gloo"):
        self.world = world
        self.backend = backend
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.tasks = [ctx.Queue() for _ in range(self.world)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world, port, self.tasks[r], self.results, list(sys.path), self.backend),
                daemon=True,
            )
            for r in range(self.world)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, timeout: float = 300.0):
        for q in self.tasks:
            q.put((fn, args))
        out: dict[int, object] = {}
        errors: dict[int, str] = {}
        try:
            while len(out) + len(errors) < self.world:
                rank, ok, value = self.results.get(timeout=timeout)
                (out if ok else errors)[rank] = value
        except queue.Empty:
            self.close(force=True)
            self._start()
            raise AssertionError(
                f"{fn.__name__}: ranks {sorted(set(range(self.world)) - set(out) - set(errors))} did not "
                f"finish within {timeout}s (a hung collective); errors so far: {errors}"
            ) from None
        if errors:
            rank = min(errors)
            raise AssertionError(f"{fn.__name__} failed on rank {rank} of {self.world}:\n{errors[rank]}")
        return [out[r] for r in range(self.world)]

    def close(self, force: bool = False) -> None:
        for q, p in zip(self.tasks, self.procs):
            if not force and p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=0 if force else 10)
            if p.is_alive():
                p.kill()
