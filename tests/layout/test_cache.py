"""RouteCache provenance: hits only for the same tensor, version, cp size and rank."""

from __future__ import annotations

import torch

from gdn_cp.layout import CONTIGUOUS, ZIGZAG, RouteCache


def test_same_object_hits_and_returns_same_plan():
    cache = RouteCache()
    cu = torch.tensor([0, 8, 24], dtype=torch.int32)
    p1 = cache.plan(cu, 2, 0)
    p2 = cache.plan(cu, 2, 0)
    assert p1 is p2 and cache.hits == 1 and cache.misses == 1


def test_in_place_write_misses():
    cache = RouteCache()
    cu = torch.tensor([0, 8, 24], dtype=torch.int32)
    p1 = cache.plan(cu, 2, 0)
    cu[1] = 16
    p2 = cache.plan(cu, 2, 0)
    assert p2 is not p1 and p2.cu == (0, 16, 24)


def test_new_object_with_equal_values_misses():
    cache = RouteCache()
    p1 = cache.plan(torch.tensor([0, 8, 24]), 2, 0)
    p2 = cache.plan(torch.tensor([0, 8, 24]), 2, 0)
    assert p1 is not p2 and cache.misses == 2


def test_other_cp_size_or_rank_misses():
    cache = RouteCache()
    cu = torch.tensor([0, 8, 24])
    base = cache.plan(cu, 2, 0)
    assert cache.plan(cu, 2, 1) is not base
    assert cache.plan(cu, 1, 0) is not base
    assert cache.plan(cu, 2, 0) is base


def test_directions_cached_separately_and_reused():
    cache = RouteCache()
    plan = cache.plan(torch.tensor([0, 8, 24]), 2, 1)
    fwd = plan.route(ZIGZAG, CONTIGUOUS)
    back = plan.route(CONTIGUOUS, ZIGZAG)
    assert fwd is not back and (fwd.source, back.source) == (ZIGZAG, CONTIGUOUS)
    assert plan.route(ZIGZAG, CONTIGUOUS) is fwd and plan.builds == 2


def test_list_boundaries_are_never_cached_by_identity():
    # A list can be mutated without a version counter: always rebuild.
    cache = RouteCache()
    cu = [0, 8, 24]
    p1 = cache.plan(cu, 2, 0)
    cu[1] = 16
    assert cache.plan(cu, 2, 0).cu == (0, 16, 24) and p1.cu == (0, 8, 24)
