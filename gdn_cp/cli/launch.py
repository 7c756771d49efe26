"""The ranks of ``gdn-cp run``: spawn ``world`` processes, one process group, one function, its
answers, and never a hang.

Each rank is a fresh ``spawn``-ed process (forking after torch ran can hang) with one torch thread,
joins a process group over a file in a private folder (``gloo`` on the CPU or on ranks sharing one
GPU, ``nccl`` with one GPU per rank), calls ``fn(rank_context, *args)`` and sends back what it
returned or its traceback. The parent waits on every rank's pipe and process at once: a rank that
raises or dies ends the run at once, the others are given a moment (they may be waiting in a
collective for the dead one) and then stopped, and :class:`RankError` carries every rank's
traceback; past ``timeout_s`` every rank is stopped. The test suites' rank pool, with its shims and
reuse across cases, is the tests' own (``gdn_cp_testing.ranks``).

While a rank works it can talk: ``ctx.emit(payload)`` hands ``payload`` to the parent's ``on_event(rank,
payload)`` at once (``gdn-cp run`` prints each mode's line from these), and with ``log_level`` set the
rank's ``logging`` records at that level and above reach the parent's loggers, prefixed ``rank r:``
(spawned processes inherit no logging configuration: without this a rank's log never showed).
"""

from __future__ import annotations

import datetime
import logging
import os
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing import connection, get_context
from typing import Any, Callable, Optional

import torch

__all__ = ["RankContext", "RankError", "run_ranks"]

_GRACE_S = 10.0  # how long the other ranks may take to fail after one did


def _ignore(payload: Any) -> None:
    """``emit`` of a context without a parent to hear it."""


@dataclass(frozen=True)
class RankContext:
    """What the function gets in every rank: its rank, the world size, its device, and ``emit(payload)``,
    which sends a picklable ``payload`` to the parent's ``on_event`` while the rank works."""

    rank: int
    world_size: int
    device: torch.device
    emit: Callable[[Any], None] = field(default=_ignore, compare=False, repr=False)


class _PipeLogHandler(logging.Handler):
    """A rank's log records, sent to the parent as ``("log", {...})`` (formatted here: a record's
    arguments need not pickle)."""

    def __init__(self, send: Callable[[tuple], None]):
        super().__init__()
        self._send = send

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._send(("log", {"name": record.name, "levelno": record.levelno, "msg": self.format(record)}))
        except Exception:  # noqa: BLE001 - logging must not break the rank (a parent gone, a closed pipe)
            self.handleError(record)


def relay_log(rank: int, record: dict) -> None:
    """A rank's record, handed to the parent's logger of the same name (its handlers print it)."""
    logging.getLogger(record["name"]).handle(logging.makeLogRecord({
        "name": record["name"], "levelno": record["levelno"], "levelname": logging.getLevelName(record["levelno"]),
        "msg": f"rank {rank}: {record['msg']}", "args": None}))


class RankError(RuntimeError):
    """Ranks failed: ``failures`` maps a rank to its traceback (or how it ended)."""

    def __init__(self, failures: dict[int, str]):
        self.failures = failures
        super().__init__(f"{len(failures)} rank(s) failed:\n" + "\n".join(
            f"--- rank {rank} ---\n{text}" for rank, text in sorted(failures.items())))


_THIRD_PARTY_LOGGERS = ("TileLang", "tilelang", "torch._dynamo", "torch._inductor", "torch.utils._sympy")


def _quiet_third_party() -> None:
    """Without ``-v``: TileLang's compile notes and warnings (FlashQLA's kernels), torch.compile's and sympy's
    warnings, and Python warnings from libraries stay out of the rank's output; errors still show. TileLang's
    C++ warnings (straight to fd 2) are hidden by the FlashQLA backend itself, at the rank's log level (shown at
    DEBUG, i.e. with ``-v``: :mod:`gdn_cp.ops.flashqla.native_warnings`)."""
    import warnings

    for name in _THIRD_PARTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


def _rank_main(rank: int, world: int, backend: str, device_type: str, init_file: str, conn, fn, args,
               log_level: Optional[int] = None) -> None:
    lock = threading.Lock()

    def send(message: tuple) -> None:
        with lock:
            conn.send(message)

    if log_level is not None:
        root = logging.getLogger()
        root.addHandler(_PipeLogHandler(send))
        root.setLevel(log_level)
        if log_level > logging.INFO:
            _quiet_third_party()
    try:
        import torch.distributed as dist

        torch.set_num_threads(1)
        if device_type == "cuda":
            device = torch.device("cuda", rank if backend == "nccl" else 0)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=600))
        try:
            answer = fn(RankContext(rank, world, device, emit=lambda payload: send(("event", payload))), *args)
            send(("ok", answer))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        send(("error", traceback.format_exc()))


def run_ranks(world: int, fn: Callable[..., Any], *args, device: str = "cpu", backend: str = "gloo",
              timeout_s: float = 900.0, on_event: Optional[Callable[[int, Any], None]] = None,
              log_level: Optional[int] = None) -> list:
    """``[fn(ctx, *args) for each rank]``, run in ``world`` spawned ranks; :class:`RankError` when
    any rank raised, died or ran past ``timeout_s`` (every rank is stopped then). ``fn`` and
    ``args`` must pickle (a module-level function). ``on_event(rank, payload)``: called in this
    process, as they arrive, with what ranks ``ctx.emit``; ``log_level``: the ranks' log records at
    this level and above reach this process's loggers (None: a rank logs as a bare process does)."""
    ctx = get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="gdn_cp_run_") as folder:
        init_file = os.path.join(folder, "init")
        pipes, procs = [], []
        try:
            for rank in range(world):
                parent, child = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_rank_main, daemon=True,
                                   args=(rank, world, backend, device, init_file, child, fn, args, log_level))
                proc.start()
                child.close()
                pipes.append(parent)
                procs.append(proc)
            results, failures = _collect(pipes, procs, timeout_s, on_event or (lambda rank, payload: None))
        finally:  # also when the parent is interrupted, or a handler of its own raised
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join()
    if failures:
        raise RankError(failures)
    return [results[rank] for rank in range(world)]


def _collect(pipes, procs, timeout_s: float, on_event: Callable[[int, Any], None]) -> tuple[dict, dict]:
    """Every rank's answer, waiting on pipes and process sentinels together until each has answered
    or ended, a failure's grace is over, or the time limit passed; events and log records are handed
    on as they come."""
    results, failures = {}, {}
    deadline = time.monotonic() + timeout_s
    waiting = set(range(len(procs)))
    while waiting:
        now = time.monotonic()
        if now >= deadline:
            why = "another rank failed" if failures else f"past the time limit of {timeout_s:.0f} s"
            failures.update({r: f"stopped without an answer ({why})" for r in waiting})
            break
        ready = connection.wait([pipes[r] for r in waiting] + [procs[r].sentinel for r in waiting],
                                timeout=deadline - now)
        for rank in sorted(waiting):
            answered = False
            while not answered and pipes[rank].poll():
                try:
                    status, value = pipes[rank].recv()
                except EOFError:
                    status, value = "error", f"ended without an answer (exit code {procs[rank].exitcode})"
                if status == "event":
                    on_event(rank, value)
                elif status == "log":
                    relay_log(rank, value)
                else:
                    (results if status == "ok" else failures)[rank] = value
                    answered = True
            if answered:
                waiting.discard(rank)
            elif procs[rank].sentinel in ready and not pipes[rank].poll():
                procs[rank].join(1.0)
                failures[rank] = f"died (exit code {procs[rank].exitcode}) without an answer"
                waiting.discard(rank)
        if failures and waiting:  # the others may wait in a collective for a dead rank: give them a moment
            deadline = min(deadline, time.monotonic() + _GRACE_S)
    return results, failures
