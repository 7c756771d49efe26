"""One process-spawning rank pool for tests, ``gdn-cp run`` and benchmarks.

Spawning ranks costs seconds (every rank imports torch), so a pool is spawned once and runs many
cases. Where the ranks run:

* ``device="cpu"``: gloo ranks on the CPU;
* ``device="cuda"`` with at least one GPU per rank (and NCCL): NCCL, rank r on ``cuda:r``;
* ``device="cuda"`` with fewer GPUs: gloo, every rank on ``cuda:0`` (NCCL refuses two ranks on one
  GPU: "Duplicate GPU detected").

``device=None`` picks CUDA when torch sees a GPU, else the CPU; ``GDN_CP_TEST_DIST_BACKEND=gloo|nccl``
forces the backend of pools that do not name one. Every rank gets the process groups of every size
that divides the world (``ctx.group(cp)``: ranks ``[0, cp)``, ``[cp, 2cp)``, ...).

Test-only collective shims (``test_shims=True``, the default) are installed in the rank processes
by the pool, never by the library:

* every ``torch.distributed`` collective is counted (``ctx.collectives``);
* on gloo: FLA (0.4.2 and 0.6) passes ``all_gather_into_tensor`` an output ``[world, n, ...]``,
  which NCCL accepts and gloo rejects: the shim views it flat ``[world*n, ...]`` for the call, and
  on CUDA ranks adds gloo to the FLA backend's ``FLA_COLLECTIVE_BACKENDS`` (logged), whose
  chunkwise native path (FLA's cp context) then runs on these gloo groups as it does on NCCL;
* on gloo: gloo stages CUDA tensors through the host (a device->host sync NCCL does not make):
  the shim suspends ``torch.cuda.set_sync_debug_mode`` while a collective runs, so a zero-sync
  check sees only the library's own syncs.

Nothing hangs: the parent waits on every rank's pipe and process sentinel at once. A rank that
raises is reported with its traceback; a rank that dies (exit code, signal) or stays silent past
the timeout is noticed at once; the other ranks get ``failure_grace_s`` to answer (they may be
waiting in a collective for the dead one), then the pool is killed and :class:`RankError` names
every rank's fate. Ranks ignore SIGINT: Ctrl-C reaches the parent, which kills the ranks, so one
interrupt gives one traceback, not one per process. A rank whose parent died exits by itself.

Usage::

    with RankPool(4, device="cpu") as pool:
        outs = pool.run(fn, arg, ...)        # fn(ctx, arg, ...) on every rank; results by rank

``fn`` must be a module-level function (pickled by name); its arguments and result are pickled
(tensors through shared memory).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
import multiprocessing.util
from multiprocessing import connection
from typing import Any, Callable, Optional

import torch

from gdn_cp.checks import as_int
from gdn_cp_testing import lazy_compile
from gdn_cp_testing.env import read as env_setting

__all__ = [
    "adapt_fla_collectives_for_gloo",
    "RankContext",
    "RankError",
    "RankPool",
    "check_pool_request",
    "choose_process_group_backend",
    "current_rank",
    "maybe_fast_autotune",
    "process_group",
    "shared_process_groups",
    "thread_census",
]

logger = logging.getLogger(__name__)

PROCESS_GROUP_BACKENDS = ("gloo", "nccl")  # torch.distributed backends (not the math backends of gdn_cp.ops)
DEVICES = ("cpu", "cuda")
_COLLECTIVES = ("all_gather_into_tensor", "all_gather", "all_reduce", "all_to_all_single", "broadcast",
                "reduce_scatter_tensor", "barrier")


# ------------------------------------------------------------------------------------------
# choosing where ranks run (parent side, before anything is spawned)
# ------------------------------------------------------------------------------------------
def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_process_group_backend(world_size: int, device: Optional[str] = None,
                                 backend: Optional[str] = None) -> tuple[str, str, bool]:
    """``(backend, device, one_gpu)`` for a pool of ``world_size`` ranks (see the module docstring):
    ``backend`` is the torch.distributed one (gloo, nccl).

    ``one_gpu``: every rank uses ``cuda:0`` (gloo ranks sharing one GPU).
    """
    gpus = _gpu_count()
    device = device or ("cuda" if gpus else "cpu")
    if backend is None:
        forced = env_setting("GDN_CP_TEST_DIST_BACKEND")
        if forced:
            backend = forced
        elif device == "cuda" and gpus >= world_size and torch.distributed.is_nccl_available():
            backend = "nccl"
        else:
            backend = "gloo"
    one_gpu = device == "cuda" and backend != "nccl"
    return backend, device, one_gpu


def check_pool_request(world_size: int, device: str, backend: str) -> None:
    """ValueError naming the argument, the value and the fix when such a pool cannot start; raised
    before any process is spawned (a rank that cannot start would otherwise die in the child)."""
    if as_int(world_size) is None or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: a rank pool needs an int >= 1")
    if device not in DEVICES:
        raise ValueError(f"device={device!r}: use one of {DEVICES}")
    if backend not in PROCESS_GROUP_BACKENDS:
        raise ValueError(f"backend={backend!r}: use one of {PROCESS_GROUP_BACKENDS}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device='cuda': torch {torch.__version__} sees no CUDA GPU (a CPU build, or no GPU "
                         "visible); use device='cpu'")
    if backend == "gloo" and not torch.distributed.is_gloo_available():
        raise ValueError(f"backend='gloo': this torch {torch.__version__} was built without gloo")
    if backend == "nccl":
        if not torch.distributed.is_nccl_available():
            raise ValueError(f"backend='nccl': this torch {torch.__version__} was built without NCCL "
                             "(a CPU build?); use backend='gloo'")
        if device != "cuda":
            raise ValueError("backend='nccl' needs device='cuda'; use backend='gloo' on the CPU")
        if _gpu_count() < world_size:
            raise ValueError(f"backend='nccl' needs one GPU per rank: {world_size} ranks, {_gpu_count()} GPU(s); "
                             "use backend='gloo' (ranks share a GPU) or fewer ranks")


# ------------------------------------------------------------------------------------------
# inside a rank
# ------------------------------------------------------------------------------------------
@dataclass
class RankContext:
    """What a case function gets as its first argument, in every rank."""

    rank: int
    world_size: int
    backend: str
    device: torch.device
    groups: dict[int, Any] = field(default_factory=dict)  # size -> the group of that size holding this rank
    collectives: dict[str, int] = field(default_factory=dict)  # name -> calls since start (test shims)

    def group(self, cp: int):
        if cp not in self.groups:
            raise ValueError(f"no group of size {cp} in a pool of {self.world_size} ranks "
                             f"(sizes: {sorted(self.groups)})")
        return self.groups[cp]

    def collective_count(self) -> int:
        return sum(self.collectives.values())


_CURRENT: Optional[RankContext] = None


def current_rank() -> Optional[RankContext]:
    """The :class:`RankContext` of this process when a :class:`RankPool` spawned it, else None."""
    return _CURRENT


def maybe_fast_autotune() -> bool:
    """Test-only, opt-in (``GDN_CP_TEST_FAST_AUTOTUNE=1``): each Triton autotuner takes the first of
    its configs that compiles and runs, without timing the others, so a fresh process compiles about
    one config per kernel instead of compiling and timing all of them (FLA 0.4.2: minutes per
    process). Every config is a valid kernel, so numerical checks stay meaningful; timings do not.
    Autotune results are neither read from nor written to the on-disk cache in this mode (no
    untuned choice can leak into a saved cache); compiled kernels still come from the cache."""
    if env_setting("GDN_CP_TEST_FAST_AUTOTUNE") != "1":
        return False
    try:
        from triton.runtime import autotuner
    except Exception:  # noqa: BLE001 - no (usable) Triton: nothing to speed up
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


_FLA_GLOO_SHIM = ("gdn_cp_testing.ranks (test shim: FLA's [world, n, ...] all_gather_into_tensor outputs viewed "
                  "flat for gloo; one GPU, ranks staged through the host)")


def _flat_all_gather_args(args, kwargs):
    """``all_gather_into_tensor``'s arguments with a ``[world, n, ...]`` output viewed flat."""
    args = list(args)
    out = args[0] if args else kwargs["output_tensor"]
    inp = args[1] if len(args) > 1 else kwargs["input_tensor"]
    if out.dim() == inp.dim() + 1 and inp.dim() >= 1:  # FLA's [world, n, ...]
        flat = out.view(out.shape[0] * out.shape[1], *out.shape[2:])
        if args:
            args[0] = flat
        else:
            kwargs["output_tensor"] = flat
    return args, kwargs


def _install_fla_gloo_adapter() -> None:
    """Only the flattening of FLA's ``all_gather_into_tensor`` outputs (no counting, no sync-debug
    handling): for pools that run FLA's cp context on gloo without the other test shims."""
    import torch.distributed as dist

    orig = dist.all_gather_into_tensor

    def wrapped(*args, **kwargs):
        args, kwargs = _flat_all_gather_args(args, kwargs)
        return orig(*args, **kwargs)

    functools.update_wrapper(wrapped, orig)
    dist.all_gather_into_tensor = wrapped


def adapt_fla_collectives_for_gloo() -> None:
    """Test-only, for processes whose gloo ranks share one GPU outside a :class:`RankPool` (e.g. the
    Megatron-LM launcher, :mod:`gdn_cp_testing.megatron.lm`): FLA's ``[world, n, ...]``
    ``all_gather_into_tensor`` outputs viewed flat, and the FLA backend told so (logged), so the
    native chunkwise path runs there as in a pool."""
    _install_fla_gloo_adapter()
    _admit_gloo_for_fla()


def _admit_gloo_for_fla() -> None:
    """Add gloo to the backends whose groups the FLA backend runs its cp context on
    (``gdn_cp.ops.fla.spec.FLA_COLLECTIVE_BACKENDS``, NCCL alone in the library): this process
    flattened FLA's outputs for gloo. Logged."""
    from gdn_cp.ops.fla import spec as fla_spec

    if "gloo" not in fla_spec.FLA_COLLECTIVE_BACKENDS:
        fla_spec.FLA_COLLECTIVE_BACKENDS = (*fla_spec.FLA_COLLECTIVE_BACKENDS, "gloo")
        logging.getLogger(__name__).info("FLA's cp context may run on gloo groups in this process: %s", _FLA_GLOO_SHIM)


def _install_collective_shims(ctx: RankContext, gloo: bool) -> None:
    """Test-only (see the module docstring): count collectives; on gloo flatten FLA's
    ``all_gather_into_tensor`` output and suspend the sync-debug mode during the collective."""
    import torch.distributed as dist

    for name in _COLLECTIVES:
        orig = getattr(dist, name)

        def wrapped(*args, __orig=orig, __name=name, **kwargs):
            ctx.collectives[__name] = ctx.collectives.get(__name, 0) + 1
            if not gloo:
                return __orig(*args, **kwargs)
            if __name == "all_gather_into_tensor":
                args, kwargs = _flat_all_gather_args(args, kwargs)
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


_SHARED_GROUPS: dict = {}  # (sorted ranks, backend) -> the group over them (or NON_GROUP_MEMBER)


def process_group(ranks, backend: Optional[str] = None, **new_group_kwargs):
    """The process group over exactly ``ranks``, created on the first request and the same object
    after: every gloo group holds threads until it is destroyed, so test processes share one group
    per rank set (a rank is in at most 2**(world-1) of them) instead of creating one per use.
    ``backend`` None: the default group's. Every rank must ask for the same sets in the same order
    (creating a group is collective), as cases that run the same code on every rank do. Groups
    of the same ranks serve several roles (e.g. TP and DP): fine for code that issues its
    collectives in the same order on every rank, as tests do; not a pattern for training."""
    import torch.distributed as dist

    members = tuple(sorted(int(r) for r in ranks))
    key = (members, str(backend or dist.get_backend()))
    if key not in _SHARED_GROUPS:
        if members == tuple(range(dist.get_world_size())) and key[1] == str(dist.get_backend()):
            _SHARED_GROUPS[key] = dist.group.WORLD
        else:
            _SHARED_GROUPS[key] = _NEW_GROUP(list(members), backend=backend, **new_group_kwargs)
    return _SHARED_GROUPS[key]


_NEW_GROUP = torch.distributed.new_group


@contextlib.contextmanager
def shared_process_groups():
    """Inside: ``torch.distributed.new_group(ranks)`` returns :func:`process_group` ``(ranks)``, so
    code that creates its groups (e.g. Megatron's ``initialize_model_parallel``: dozens per call)
    reuses those of the same ranks; restored on exit. Calls with ``pg_options`` or without ``ranks``
    go to torch unchanged."""
    import torch.distributed as dist

    def new_group(ranks=None, timeout=None, backend=None, pg_options=None, **kwargs):
        if ranks is None or pg_options is not None:
            return _NEW_GROUP(ranks, timeout, backend, pg_options, **kwargs)
        return process_group(ranks, backend, **kwargs)

    saved = dist.new_group
    dist.new_group = new_group
    try:
        yield
    finally:
        dist.new_group = saved


def thread_census() -> Optional[tuple[int, dict[str, int]]]:
    """``(threads, {thread name: count})`` of this process, from ``/proc/self/task/*/comm`` (None
    where there is no /proc). A gloo process group holds threads (``pt_gloo_runloop``,
    ``gloo_tcp_loop``) until it is destroyed: this is how a pool rank's leaked groups show."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    names: dict[str, int] = {}
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        names[name] = names.get(name, 0) + 1
    return sum(names.values()), dict(sorted(names.items(), key=lambda kv: -kv[1]))


def _thread_census_case(ctx) -> Optional[tuple[int, dict[str, int]]]:  # noqa: ARG001 - a pool case
    return thread_census()


def _exit_when_orphaned(parent_pid: int) -> None:
    """A rank whose parent died (killed, crashed) has nobody to answer: exit instead of lingering."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(3)


def _format_exception() -> str:
    return traceback.format_exc()


def _format_case_failure(err: BaseException) -> str:
    """The traceback of a failed case, from the case function down (without the pool's frame)."""
    tb = err.__traceback__.tb_next if err.__traceback__ is not None else None
    return "".join(traceback.format_exception(type(err), err, tb))


def _rank_main(rank: int, world: int, backend: str, device_type: str, one_gpu: bool, init_file: str,
               env: dict, conn, test_shims: bool, parent_pid: int, fla_on_gloo: bool = False) -> None:
    """Body of a rank process: start, then answer tasks from the parent until told to stop."""
    global _CURRENT
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    os.environ.update(env)
    try:
        import torch.distributed as dist

        torch.set_num_threads(1)
        maybe_fast_autotune()
        if device_type == "cuda":
            device = torch.device("cuda", 0 if one_gpu else rank)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
            if test_shims:  # megatron-core's import without TorchInductor's (gdn_cp_testing.lazy_compile)
                lazy_compile.install()
        timeout = datetime.timedelta(seconds=env_setting("GDN_CP_TEST_PG_TIMEOUT"))
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timeout)
        ctx = RankContext(rank=rank, world_size=world, backend=backend, device=device)
        for size in range(1, world + 1):
            if world % size:
                continue
            for start in range(0, world, size):
                members = list(range(start, start + size))
                grp = process_group(members)
                if rank in members:
                    ctx.groups[size] = grp
        if test_shims:
            _install_collective_shims(ctx, gloo=(backend == "gloo"))
        if backend == "gloo" and device_type == "cuda" and (test_shims or fla_on_gloo):
            if not test_shims:  # the test shims flatten FLA's outputs themselves
                _install_fla_gloo_adapter()
            _admit_gloo_for_fla()
        _CURRENT = ctx
        conn.send(("ready", True, None))
    except BaseException:  # noqa: BLE001 - reported to the parent, then this rank ends
        conn.send(("ready", False, _format_exception()))
        _leave(0)
    while True:
        try:
            item = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            break
        if item is None:
            break
        task_id, fn, args, kwargs = item
        try:
            reply = (task_id, True, fn(ctx, *args, **kwargs))
        except BaseException as err:  # noqa: BLE001 - every failure goes back to the parent
            reply = (task_id, False, _format_case_failure(err))
        try:
            conn.send(reply)
        except Exception:  # noqa: BLE001 - e.g. a result that cannot be pickled
            conn.send((task_id, False, f"the result of {getattr(fn, '__name__', fn)} could not be sent back:\n"
                                       f"{_format_exception()}"))
    _leave(0)


def _leave(code: int) -> None:
    """End the rank now: flush what it printed, skip interpreter teardown (process-group and CUDA
    destructors can take seconds, or block on peers that are already gone)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)


# ------------------------------------------------------------------------------------------
# the parent side
# ------------------------------------------------------------------------------------------
class RankError(RuntimeError):
    """One or more ranks failed: ``failures`` maps rank -> what happened (a traceback, an exit
    code, a time-out). ``pool_broken``: the pool had to be killed (death, hang, time-out)."""

    def __init__(self, failures: dict[int, str], pool_broken: bool = False):
        self.failures = dict(failures)
        self.pool_broken = pool_broken
        body = "\n".join(f"--- rank {r} ---\n{text.rstrip()}" for r, text in sorted(self.failures.items()))
        super().__init__(f"{len(self.failures)} rank(s) failed:\n{body}")


@contextlib.contextmanager
def _children_ignore_sigint():
    """Spawn with SIGINT ignored, so the ranks inherit "ignore" from their first instruction (a
    Ctrl-C while they import torch would print a traceback per rank); the parent's own handler is
    back as soon as they are started."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _exit_text(code: Optional[int]) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}" + (" (out of memory?)" if -code == signal.SIGKILL else "")
    return f"exited with code {code}"


class RankPool:
    """``world_size`` spawned ranks that stay up and run many cases; see the module docstring.

    ``timeout_s``: the longest a case (and the start-up) may take before the pool is killed.
    ``failure_grace_s``: how long the other ranks may still answer after one rank failed or died.
    ``env``: environment variables set in the ranks before anything is imported there.
    ``fla_on_gloo``: with ``test_shims=False``, still adapt FLA's collectives on gloo CUDA ranks (one
    GPU), so that the FLA backend's native chunkwise path runs there (``gdn-cp run --device cuda``);
    the test shims always do.
    """

    def __init__(self, world_size: int, *, device: Optional[str] = None, backend: Optional[str] = None,
                 timeout_s: float = 480.0, failure_grace_s: float = 10.0, test_shims: bool = True,
                 env: Optional[dict] = None, fla_on_gloo: bool = False):
        import multiprocessing

        self.world_size = world_size
        self.backend, self.device, self.one_gpu = choose_process_group_backend(world_size, device, backend)
        check_pool_request(world_size, self.device, self.backend)
        self.timeout_s = timeout_s
        self.failure_grace_s = failure_grace_s
        self.fla_on_gloo = fla_on_gloo
        self.broken: Optional[str] = None
        self._next_id = 0
        self._tmp = tempfile.mkdtemp(prefix="gdn_cp_pool_")
        ctx = multiprocessing.get_context("spawn")
        self._conns = []
        self._procs = []
        t0 = time.perf_counter()
        try:
            with _children_ignore_sigint():
                self._spawn(ctx, env, test_shims)
            answers = self._collect("ready", timeout_s, "starting")
        except BaseException:
            self.kill()
            raise
        self.startup_s = time.perf_counter() - t0
        failures = {r: payload for r, (ok, payload) in answers.items() if not ok}
        if failures:
            self.kill()
            raise RankError(failures, pool_broken=True)
        logger.debug("rank pool of %d up in %.1fs (%s, %s)", world_size, self.startup_s, self.backend, self.device)

    def _spawn(self, ctx, env: Optional[dict], test_shims: bool) -> None:
        # multiprocessing's temporary folder (pymp-*: where a rank's sockets for sending tensors back
        # live) made here, before spawning, is the ranks' too (they inherit it) and is removed when
        # this process exits; a rank's own would outlive it (a rank ends by os._exit: no finalizers).
        multiprocessing.util.get_temp_dir()
        for rank in range(self.world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_rank_main, name=f"gdn-cp-rank-{rank}", daemon=True,
                args=(rank, self.world_size, self.backend, self.device, self.one_gpu,
                      os.path.join(self._tmp, "rendezvous"), dict(env or {}), child_end, test_shims, os.getpid(),
                      self.fla_on_gloo),
            )
            self._procs.append(proc)
            self._conns.append(parent_end)
            proc.start()
            child_end.close()  # the child holds its end; a dead child then reads as EOF here

    @property
    def pids(self) -> list[Optional[int]]:
        """Process ids of the ranks, by rank."""
        return [p.pid for p in self._procs]

    # -- waiting ----------------------------------------------------------------------------
    def _collect(self, tag, timeout_s: float, what: str) -> dict[int, tuple[bool, Any]]:
        """Each rank's ``(ok, payload)`` for message ``tag``; ranks that died, were stopped or timed
        out raise :class:`RankError` after the pool is killed."""
        answers: dict[int, tuple[bool, Any]] = {}
        lost: dict[int, str] = {}
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout_s
        first_failure: Optional[float] = None
        try:
            while pending:
                limit = deadline if first_failure is None else min(deadline, first_failure + self.failure_grace_s)
                left = limit - time.monotonic()
                if left <= 0:
                    break
                by_conn = {self._conns[r]: r for r in pending}
                by_sentinel = {self._procs[r].sentinel: r for r in pending}
                ready = connection.wait(list(by_conn) + list(by_sentinel), timeout=left)
                readable = {by_conn[o] for o in ready if o in by_conn}
                exited = {by_sentinel[o] for o in ready if o in by_sentinel}
                for r in sorted(readable | exited):
                    conn = self._conns[r]
                    got = None
                    try:
                        if r in readable or conn.poll():
                            got = conn.recv()
                    except (EOFError, OSError):
                        got = None
                    if got is not None and got[0] == tag:
                        answers[r] = (got[1], got[2])
                        if not got[1] and first_failure is None:
                            first_failure = time.monotonic()
                        pending.discard(r)
                    elif got is not None:
                        raise RuntimeError(f"rank {r} answered {got[0]!r} while the pool waited for {tag!r}")
                    elif r in exited or not self._procs[r].is_alive():
                        self._procs[r].join(timeout=1)
                        lost[r] = (f"the rank process {_exit_text(self._procs[r].exitcode)} while {what}, "
                                   "without an answer (anything it printed is above)")
                        pending.discard(r)
                        first_failure = first_failure or time.monotonic()
        except BaseException:  # Ctrl-C or a protocol error: nobody may be left behind
            self.broken = f"interrupted while {what}"
            self.kill()
            raise
        if pending:
            if first_failure is not None:
                for r in pending:
                    lost[r] = (f"stopped: no answer within {self.failure_grace_s:g}s after another rank failed "
                               "(probably waiting in a collective for it)")
            else:
                for r in pending:
                    lost[r] = f"timed out: no answer within {timeout_s:g}s while {what}"
        if lost:
            self.broken = "; ".join(f"rank {r}: {text.splitlines()[0]}" for r, text in sorted(lost.items()))
            self.kill()
            failures = {r: payload for r, (ok, payload) in answers.items() if not ok}
            failures.update(lost)
            raise RankError(failures, pool_broken=True)
        return answers

    # -- running ----------------------------------------------------------------------------
    def run(self, fn: Callable, *args, timeout_s: Optional[float] = None, raise_on_error: bool = True,
            **kwargs) -> list:
        """``fn(ctx, *args, **kwargs)`` on every rank; the results, ordered by rank.

        A rank that raises: :class:`RankError` (with ``raise_on_error=False`` its entry in the list
        is a :class:`RankError` instead, as long as the pool itself survived). A rank that dies,
        hangs past ``timeout_s`` (default: the pool's) or never answers after another failed:
        :class:`RankError` with ``pool_broken=True``, the pool killed.
        """
        if self.broken:
            raise RuntimeError(f"rank pool is broken ({self.broken}); start a new one")
        task_id = self._next_id
        self._next_id += 1
        name = getattr(fn, "__name__", repr(fn))
        try:
            for conn in self._conns:
                conn.send((task_id, fn, args, kwargs))
        except BaseException:
            self.broken = f"could not send task {name}"
            self.kill()
            raise
        answers = self._collect(task_id, self.timeout_s if timeout_s is None else timeout_s, f"running {name}")
        out: list[Any] = [None] * self.world_size
        failures = {}
        for r, (ok, payload) in answers.items():
            if ok:
                out[r] = payload
            else:
                failures[r] = payload
                out[r] = RankError({r: payload})
        if failures and raise_on_error:
            raise RankError(failures)
        return out

    def thread_census(self) -> list[Optional[tuple[int, dict[str, int]]]]:
        """Each rank's :func:`thread_census`, by rank (a leak check: a rank's thread count should
        not grow with the cases it ran)."""
        return self.run(_thread_census_case, timeout_s=60.0)

    # -- ending -----------------------------------------------------------------------------
    def close(self, wait_s: float = 5.0) -> None:
        """Ask every rank to stop; kill whatever has not stopped after ``wait_s``."""
        for conn, proc in zip(self._conns, self._procs):
            if proc.is_alive():
                try:
                    conn.send(None)
                except Exception:  # noqa: BLE001 - a rank that cannot hear is killed below
                    pass
        deadline = time.monotonic() + wait_s
        for proc in self._procs:
            if proc.pid is not None:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Stop every rank now (SIGTERM, then SIGKILL) and release the pool's resources."""
        started = [p for p in self._procs if p.pid is not None]
        for proc in started:
            if proc.is_alive():
                proc.terminate()
        for proc in started:
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=2)
        for conn in self._conns:
            conn.close()
        self._conns = [_ClosedConn() for _ in self._conns]
        if not self.broken and self._procs:
            self.broken = "closed"
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _ClosedConn:
    """Stands in for a closed pipe end, so a second close() or kill() is harmless."""

    def send(self, obj) -> None:
        raise OSError("the rank pool is closed")

    def close(self) -> None:
        pass
