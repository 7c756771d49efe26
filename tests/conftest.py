"""Shared fixtures: one spawned gloo pool per world size per test session."""

from __future__ import annotations

import pytest

from tests.distributed import GlooPool

_POOLS: dict[int, GlooPool] = {}


@pytest.fixture(scope="session")
def gloo_pool():
    """``gloo_pool(world)`` -> a running :class:`GlooPool` of that many gloo ranks."""

    def get(world: int) -> GlooPool:
        if world not in _POOLS:
            _POOLS[world] = GlooPool(world)
        return _POOLS[world]

    yield get
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
