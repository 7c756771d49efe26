"""Session fixtures: one spawned rank pool per (world size, device), and the megatron-core policy."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from gdn_cp.testing.ranks import RankPool

SKIP_MEGATRON_ENV = "GDN_CP_ALLOW_SKIP_MEGATRON"
BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

_POOLS: dict[tuple[int, str], RankPool] = {}


@pytest.fixture(scope="session")
def rank_pool():
    """``rank_pool(world, device="cpu")`` -> a running :class:`RankPool` of that many ranks, shared by
    the whole session (spawning costs seconds). A pool broken by a failed case is replaced."""

    def get(world: int, device: str = "cpu") -> RankPool:
        key = (world, device)
        pool = _POOLS.get(key)
        if pool is None or pool.broken:
            if pool is not None:
                pool.kill()
            pool = _POOLS[key] = RankPool(world, device=device, timeout_s=300.0)
        return pool

    yield get
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def megatron_unavailable(reason: str):
    """Fail (the default: CI installs megatron-core) or skip (``GDN_CP_ALLOW_SKIP_MEGATRON=1``)."""
    from gdn_cp.megatron.patching import PINNED_VERSION

    if os.environ.get(SKIP_MEGATRON_ENV) == "1":
        pytest.skip(reason)
    pytest.fail(
        f"{reason}\nThe GatedDeltaNet tests need megatron-core=={PINNED_VERSION} installed (patched by "
        f"`python3 -m gdn_cp.cli patch apply`, or pristine: the tests patch it for the session). "
        f"Set {SKIP_MEGATRON_ENV}=1 to skip them instead.",
        pytrace=False,
    )


@pytest.fixture(scope="session")
def megatron_installed():
    """megatron-core is importable (else fail or skip, see :func:`megatron_unavailable`)."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        megatron_unavailable("megatron-core is not importable")


@pytest.fixture(scope="session")
def benchmark_module():
    """``benchmark_module("route_build")`` -> that benchmark script imported in this process (its
    ``main(["--help"])`` costs milliseconds here, a torch import in a subprocess)."""
    loaded = {}

    def load(name: str):
        if name not in loaded:
            spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            loaded[name] = module
        return loaded[name]

    return load
