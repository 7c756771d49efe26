"""The rank pool never hangs: a rank that fails to start, raises while its peer waits in a
collective, exits, or stays silent ends the pool within its grace/timeout with that rank's story;
Ctrl-C in the parent stops every rank. Each test runs under an alarm (``hang_guard``), so a
regression fails here instead of hanging CI."""

from __future__ import annotations

import ast
import os
import signal
import time
from pathlib import Path

import pytest

from gdn_cp_testing.ranks import RankError, RankPool, check_pool_request

GUARD_S = 90  # far above what any case here needs; only a hang reaches it
ROOT = Path(__file__).resolve().parents[2]


class Hung(Exception):
    pass


@pytest.fixture
def hang_guard():
    """Fail (instead of hanging) when the test body is still running after GUARD_S seconds."""

    def on_alarm(signum, frame):  # noqa: ARG001
        raise Hung(f"still running after {GUARD_S}s: the rank pool hung")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(GUARD_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _alive(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


# cases (module level: the ranks import them by name)
def _where(ctx):
    return ctx.rank, ctx.world_size, ctx.backend, str(ctx.device), sorted(ctx.groups)


def _raise_before_collective(ctx):
    raise ValueError(f"bad input on rank {ctx.rank}")


def _raise_while_peer_waits(ctx):
    import torch
    import torch.distributed as dist

    if ctx.rank == 1:
        raise ValueError("rank 1 gives up")
    dist.all_reduce(torch.ones(1))  # waits for rank 1, which never comes
    return "unreachable"


def _exit_on_rank_0(ctx):
    if ctx.rank == 0:
        os._exit(7)
    time.sleep(600)


def _sleep(ctx, seconds):
    time.sleep(seconds)


def test_results_by_rank_and_ordinary_failures_keep_the_pool(rank_pool, hang_guard):
    pool = rank_pool(2)
    assert pool.run(_where) == [(r, 2, "gloo", "cpu", [1, 2]) for r in range(2)]
    with pytest.raises(RankError) as err:
        pool.run(_raise_before_collective)
    assert sorted(err.value.failures) == [0, 1] and not err.value.pool_broken
    assert "ValueError: bad input on rank 1" in err.value.failures[1]
    outs = pool.run(_raise_before_collective, raise_on_error=False)
    assert all(isinstance(o, RankError) for o in outs)
    assert not pool.broken and pool.run(_where)[1][0] == 1  # still serving


def _groups_made_once(ctx):
    """Asked again, a rank set gives the same group and no new threads; new_group inside
    shared_process_groups goes through the same table; the pool's own groups are in it."""
    import torch
    import torch.distributed as dist

    from gdn_cp_testing.ranks import process_group, shared_process_groups, thread_census

    pair = [0, 1] if ctx.rank < 2 else [2, 3]
    assert process_group(pair) is ctx.group(2) and process_group(range(4)) is dist.group.WORLD
    first = process_group([0, 2])  # a rank set the pool does not have (rank 1 and 3: not a member)
    threads = thread_census()[0]
    torch_new_group = dist.new_group
    with shared_process_groups():
        again = [dist.new_group([2, 0]) for _ in range(20)]
    assert all(g is first for g in again) and process_group([0, 2]) is first
    assert dist.new_group is torch_new_group  # restored
    member = dist.get_rank() in (0, 2)
    if member:
        t = torch.ones(1)
        dist.all_reduce(t, group=first)
        assert t.item() == 2
    return thread_census()[0] - threads


def test_process_groups_are_made_once_per_rank_set(rank_pool, hang_guard):
    assert rank_pool(4).run(_groups_made_once) == [0, 0, 0, 0]


def _temp_dir(ctx):
    import multiprocessing.util

    return multiprocessing.util.get_temp_dir()


def test_ranks_use_the_parents_multiprocessing_folder(hang_guard):
    """A rank ends by os._exit (no finalizers): multiprocessing's pymp-* folder of its own (made when
    tensors go back to the parent) would stay in /tmp; the ranks use the parent's, removed when the
    parent exits."""
    import multiprocessing.util

    with RankPool(2, device="cpu") as pool:
        assert pool.run(_temp_dir) == [multiprocessing.util.get_temp_dir()] * 2


@pytest.mark.slow
def test_rank_failing_at_start_is_reported(hang_guard):
    with pytest.raises(RankError) as err:
        RankPool(1, device="cpu", env={"GDN_CP_TEST_PG_TIMEOUT": "soon"})  # read (and refused) in the rank
    assert sorted(err.value.failures) == [0] and err.value.pool_broken
    assert "GDN_CP_TEST_PG_TIMEOUT='soon': use a number of seconds > 0" in err.value.failures[0]


@pytest.mark.slow
def test_rank_raising_while_its_peer_waits_in_a_collective(hang_guard):
    pool = RankPool(2, device="cpu", failure_grace_s=1.0)
    pids = pool.pids
    with pytest.raises(RankError) as err:
        pool.run(_raise_while_peer_waits)
    assert "ValueError: rank 1 gives up" in err.value.failures[1]
    assert "stopped: no answer within 1s after another rank failed" in err.value.failures[0]
    assert err.value.pool_broken and pool.broken and _alive(pids) == []
    with pytest.raises(RuntimeError, match="broken"):
        pool.run(_where)


@pytest.mark.slow
def test_rank_exiting_is_noticed(hang_guard):
    pool = RankPool(2, device="cpu", failure_grace_s=1.0)
    with pytest.raises(RankError) as err:
        pool.run(_exit_on_rank_0)
    assert "exited with code 7 while running _exit_on_rank_0" in err.value.failures[0]
    assert "stopped" in err.value.failures[1] and _alive(pool.pids) == []


@pytest.mark.slow
def test_silent_ranks_time_out(hang_guard):
    pool = RankPool(1, device="cpu")
    with pytest.raises(RankError) as err:
        pool.run(_sleep, 600, timeout_s=1.0)
    assert "timed out: no answer within 1s while running _sleep" in err.value.failures[0]
    assert _alive(pool.pids) == []


@pytest.mark.slow
def test_interrupt_in_the_parent_stops_every_rank(hang_guard):
    pool = RankPool(1, device="cpu")
    pids = pool.pids

    def interrupt(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(1)
    try:
        with pytest.raises(KeyboardInterrupt):
            pool.run(_sleep, 600)
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert pool.broken and _alive(pids) == []


@pytest.mark.parametrize("kwargs,match", [
    (dict(world_size=0, device="cpu", backend="gloo"), "world_size=0"),
    (dict(world_size=2, device="tpu", backend="gloo"), "device='tpu'"),
    (dict(world_size=2, device="cpu", backend="mpi"), "backend='mpi'"),
    (dict(world_size=2, device="cpu", backend="nccl"), "nccl"),
])
def test_impossible_pools_are_refused_before_spawning(kwargs, match):
    with pytest.raises(ValueError, match=match):
        check_pool_request(**kwargs)


def test_cuda_pool_without_cuda_is_refused_before_spawning():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for machines without it")
    with pytest.raises(ValueError, match="device='cuda'.*use device='cpu'"):
        RankPool(2, device="cuda")


def test_library_never_imports_the_testing_toolkit():
    """The collective shims and Megatron stand-ins stay test-only: no library layer imports them."""
    offenders = []
    for layer in ("layout", "comm", "ops", "modes", "megatron"):
        for path in sorted((ROOT / "gdn_cp" / layer).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = [("." * node.level) + (node.module or "")]
                if any("testing" in n.split(".") for n in names):
                    offenders.append(f"{path.relative_to(ROOT)}: {names}")
    assert not offenders, offenders
