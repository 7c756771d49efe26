"""Spawned rank pools for every distributed test: CPU gloo, one GPU (gloo), N GPUs (NCCL).

Spawning ranks costs seconds, so a pool is spawned once and runs many cases. On the CPU the
ranks use gloo; on a GPU machine NCCL with one rank per GPU when there are enough GPUs. NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so with fewer GPUs than ranks every
rank uses cuda:0 over gloo. Two test-only adaptations are installed in the rank processes then
(never in the library):

* gloo wants ``all_gather_into_tensor``'s output flat ``[world*n, ...]``; FLA 0.4.2 passes
  ``[world, n, ...]`` (which NCCL accepts). The shim views the output flat for the call.
* gloo stages CUDA tensors through the host, which is a device->host sync that NCCL does not
  make. While a collective runs the shim suspends ``torch.cuda.set_sync_debug_mode`` so that a
  zero-sync check sees only the library's (and FLA's) own syncs. Collectives are counted.

Usage::

    pool = RankPool(4)                      # spawns 4 ranks, rendezvous, CP groups of every size
    outs = pool.run(fn, arg, ...)           # fn(rank_ctx, arg, ...) on every rank; list by rank
    pool.close()

    pool = GlooPool(2)                      # CPU tests: fn(rank, world, arg, ...) on every rank

``fn`` must be a module-level function (it is pickled by name). ``rank_ctx.group(cp)`` is the
process group of size ``cp`` that holds this rank (ranks [0..cp), [cp..2cp), ...).
Environment: ``GDN_CP_TEST_DIST_BACKEND=gloo|nccl`` forces a backend.
"""

from __future__ import annotations

import datetime
import functools
import os
import queue as queue_mod
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["RankContext", "RankError", "RankPool", "choose_backend", "maybe_fast_autotune"]


def maybe_fast_autotune() -> bool:
    """Test-only, opt-in (``GDN_CP_TEST_FAST_AUTOTUNE=1``): each Triton autotuner takes the first of
    its configs that compiles and runs, without timing the others, so a fresh process compiles about
    one config per kernel instead of compiling and timing all of them (FLA 0.4.2: minutes per
    process). Every config is a valid kernel, so numerical checks stay meaningful; timings do not.
    Autotune results are neither read from nor written to the on-disk cache in this mode (no
    untuned choice can leak into a saved cache); compiled kernels still come from the cache."""
    if os.environ.get("GDN_CP_TEST_FAST_AUTOTUNE") != "1":
        return False
    try:
        from triton.runtime import autotuner
    except Exception:  # noqa: BLE001
        return False
    cls = autotuner.Autotuner
    if getattr(cls, "_gdn_cp_fast", False):
        return True
    orig_run, orig_bench = cls.run, cls._bench

    def run(self, *args, **kwargs):
        self.cache_results = False
        self._gdn_cp_found = False
        return orig_run(self, *args, **kwargs)

    def bench(self, *args, config, **meta):
        if getattr(self, "_gdn_cp_found", False):
            return [float("inf")] * 3  # not compiled, never chosen
        timing = orig_bench(self, *args, config=config, **meta)  # inf if it does not fit
        if timing and timing[0] != float("inf"):
            self._gdn_cp_found = True
        return timing

    cls.run, cls._bench = run, bench
    cls._gdn_cp_fast = True
    return True


def choose_backend(world_size: int) -> tuple[str, bool]:
    """(backend, one_gpu): NCCL with one rank per GPU when there are enough GPUs, else gloo."""
    forced = os.environ.get("GDN_CP_TEST_DIST_BACKEND")
    has_cuda = torch.cuda.is_available()
    n = torch.cuda.device_count() if has_cuda else 0
    if forced:
        return forced, forced != "nccl" and has_cuda
    if has_cuda and n >= world_size:
        return "nccl", False
    return "gloo", has_cuda


class RankError(RuntimeError):
    def __init__(self, failures: dict[int, str]):
        self.failures = failures
        body = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        super().__init__(f"{len(failures)} rank(s) failed:\n{body}")


@dataclass
class RankContext:
    rank: int
    world_size: int
    backend: str
    device: torch.device
    groups: dict[int, Any] = field(default_factory=dict)
    collectives: dict[str, int] = field(default_factory=dict)  # name -> calls since start

    def group(self, cp: int):
        if cp not in self.groups:
            raise ValueError(f"no CP group of size {cp} in a pool of {self.world_size} ranks")
        return self.groups[cp]

    def collective_count(self) -> int:
        return sum(self.collectives.values())


_COLLECTIVES = ("all_gather_into_tensor", "all_gather", "all_reduce", "all_to_all_single", "broadcast",
                "reduce_scatter_tensor", "barrier")


def _install_shims(ctx: RankContext, gloo: bool) -> None:
    """Test-only: count collectives; for gloo also flatten FLA's all_gather_into_tensor output and
    suspend the sync-debug mode while the collective runs."""
    for name in _COLLECTIVES:
        orig = getattr(dist, name)

        def wrapped(*args, __orig=orig, __name=name, **kwargs):
            ctx.collectives[__name] = ctx.collectives.get(__name, 0) + 1
            if not gloo:
                return __orig(*args, **kwargs)
            if __name == "all_gather_into_tensor":
                args = list(args)
                out = args[0] if args else kwargs["output_tensor"]
                inp = args[1] if len(args) > 1 else kwargs["input_tensor"]
                if out.dim() == inp.dim() + 1 and inp.dim() >= 1:  # FLA's [world, n, ...]
                    flat = out.view(out.shape[0] * out.shape[1], *out.shape[2:])
                    if args:
                        args[0] = flat
                    else:
                        kwargs["output_tensor"] = flat
            mode = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else 0
            if mode:
                torch.cuda.set_sync_debug_mode(0)
            try:
                return __orig(*args, **kwargs)
            finally:
                if mode:
                    torch.cuda.set_sync_debug_mode(mode)

        functools.update_wrapper(wrapped, orig)
        setattr(dist, name, wrapped)


def _worker(rank: int, world: int, backend: str, one_gpu: bool, init_file: str, env: dict,
            tasks, results) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)
    maybe_fast_autotune()
    try:
        if torch.cuda.is_available():
            device = torch.device("cuda", 0 if one_gpu else rank)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=float(env.get("GDN_CP_TEST_PG_TIMEOUT", 180))))
        ctx = RankContext(rank=rank, world_size=world, backend=backend, device=device)
        for size in range(1, world + 1):
            if world % size:
                continue
            for start in range(0, world, size):
                members = list(range(start, start + size))
                grp = dist.group.WORLD if size == world else dist.new_group(members)
                if rank in members:
                    ctx.groups[size] = grp
        _install_shims(ctx, gloo=(backend == "gloo"))
        results.put(("ready", rank, True, None))
    except BaseException:  # noqa: BLE001
        results.put(("ready", rank, False, traceback.format_exc()))
        return
    while True:
        item = tasks.get()
        if item is None:
            break
        task_id, fn, args, kwargs = item
        try:
            out = fn(ctx, *args, **kwargs)
            results.put((task_id, rank, True, out))
        except BaseException:  # noqa: BLE001
            results.put((task_id, rank, False, traceback.format_exc()))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


class RankPool:
    """``world_size`` spawned ranks that stay up and run many cases (spawning costs seconds)."""

    def __init__(self, world_size: int, *, backend: str | None = None, timeout_s: float = 480.0,
                 env: dict | None = None):
        self.world_size = world_size
        chosen, one_gpu = choose_backend(world_size)
        self.backend = backend or chosen
        self.one_gpu = one_gpu if backend is None else (backend != "nccl" and torch.cuda.is_available())
        self.timeout_s = timeout_s
        self._ctx = mp.get_context("spawn")
        self._tmp = tempfile.mkdtemp(prefix="gdn_cp_pool_")
        init_file = os.path.join(self._tmp, "rendezvous")
        child_env = {k: v for k, v in os.environ.items()
                     if k.startswith(("TRITON_", "FLA_", "NCCL_", "GDN_CP_", "CUDA_", "TORCH_"))}
        child_env.update(env or {})
        self._results = self._ctx.Queue()
        self._tasks = [self._ctx.Queue() for _ in range(world_size)]
        self._procs = [
            self._ctx.Process(target=_worker, args=(r, world_size, self.backend, self.one_gpu, init_file,
                                                    child_env, self._tasks[r], self._results), daemon=True)
            for r in range(world_size)
        ]
        self._next_id = 0
        self.broken: str | None = None
        t0 = time.perf_counter()
        for p in self._procs:
            p.start()
        failures = {}
        for _ in range(world_size):
            tag, rank, ok, payload = self._get(timeout_s)
            if not ok:
                failures[rank] = payload
        self.startup_s = time.perf_counter() - t0
        if failures:
            self.close()
            raise RankError(failures)

    def _get(self, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._results.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [i for i, p in enumerate(self._procs) if not p.is_alive()]
                if dead:
                    self.broken = f"rank process(es) {dead} died (exit codes " \
                                  f"{[self._procs[i].exitcode for i in dead]})"
                    raise RuntimeError(self.broken) from None
                if time.monotonic() > deadline:
                    self.broken = f"no answer from the ranks within {timeout:.0f}s"
                    raise TimeoutError(self.broken) from None

    def run(self, fn: Callable, *args, raise_on_error: bool = True, **kwargs) -> list:
        """Run ``fn(rank_ctx, *args, **kwargs)`` on every rank; results ordered by rank.

        With ``raise_on_error=False`` a failed rank's entry is a ``RankError`` instead.
        """
        if self.broken:
            raise RuntimeError(f"rank pool is broken: {self.broken}")
        task_id = self._next_id
        self._next_id += 1
        for q in self._tasks:
            q.put((task_id, fn, args, kwargs))
        out: list[Any] = [None] * self.world_size
        failures = {}
        for _ in range(self.world_size):
            tid, rank, ok, payload = self._get(self.timeout_s)
            if tid != task_id:
                self.broken = f"result of task {tid} arrived during task {task_id}"
                raise RuntimeError(self.broken)
            if ok:
                out[rank] = payload
            else:
                failures[rank] = payload
                out[rank] = RankError({rank: payload})
        if failures and raise_on_error:
            raise RankError(failures)
        return out

    def close(self) -> None:
        for q in self._tasks:
            try:
                q.put(None)
            except Exception:  # noqa: BLE001
                pass
        for p in self._procs:
            p.join(timeout=20)
        for p in self._procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _call_with_rank(ctx: RankContext, fn: Callable, *args):
    return fn(ctx.rank, ctx.world_size, *args)


class GlooPool:
    """A gloo :class:`RankPool` whose cases are ``fn(rank, world, *args)`` (the CPU tests' form)."""

    def __init__(self, world: int):
        self.world = world
        self._pool = RankPool(world, backend="gloo", timeout_s=300.0)

    def run(self, fn: Callable, *args, timeout: float = 300.0) -> list:
        """``fn(rank, world, *args)`` on every rank; a rank silent for ``timeout`` s fails the call."""
        if self._pool.broken:  # a hung or dead case: start over for the next one
            self._pool.close()
            self._pool = RankPool(self.world, backend="gloo", timeout_s=timeout)
        self._pool.timeout_s = timeout
        return self._pool.run(_call_with_rank, fn, *args)

    def close(self) -> None:
        self._pool.close()
