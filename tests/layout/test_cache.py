"""RouteCache provenance: hits only for the same object, cp size and rank, with unchanged boundaries."""

from __future__ import annotations

import pytest
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
    from gdn_cp_testing.probes import plan_builds

    cache = RouteCache()
    plan = cache.plan(torch.tensor([0, 8, 24]), 2, 1)
    with plan_builds() as built:
        fwd = plan.route(ZIGZAG, CONTIGUOUS)
        back = plan.route(CONTIGUOUS, ZIGZAG)
        assert fwd is not back and (fwd.source, back.source) == (ZIGZAG, CONTIGUOUS)
        assert plan.route(ZIGZAG, CONTIGUOUS) is fwd and plan.route(CONTIGUOUS, ZIGZAG) is back
    assert built.counts == {"route": 2, "natural_order": 0, "chunkwise": 0}


def test_list_boundaries_are_never_cached_by_identity():
    # A list can be mutated without a version counter: always rebuild.
    cache = RouteCache()
    cu = [0, 8, 24]
    p1 = cache.plan(cu, 2, 0)
    cu[1] = 16
    assert cache.plan(cu, 2, 0).cu == (0, 16, 24) and p1.cu == (0, 8, 24)


def test_writes_that_skip_the_version_counter_are_seen_on_host_boundaries():
    """Same tensor, same total, new values, version counter untouched: still rebuilt."""
    cache = RouteCache()
    cu = torch.tensor([0, 8, 24], dtype=torch.int32)
    p1 = cache.plan(cu, 2, 0)
    version = cu._version
    cu.numpy()[1] = 16
    assert cu._version == version  # the write the version counter does not see
    p2 = cache.plan(cu, 2, 0)
    assert p2 is not p1 and p2.cu == (0, 16, 24)
    cu.data[1] = 4
    p3 = cache.plan(cu, 2, 0)
    assert p3 is not p2 and p3.cu == (0, 4, 24)
    assert cache.plan(cu, 2, 0) is p3  # unchanged values still hit


def test_list_with_equal_values_hits_and_a_mutated_one_misses():
    cache = RouteCache()
    cu = [0, 8, 24]
    p1 = cache.plan(cu, 2, 0)
    assert cache.plan(cu, 2, 0) is p1
    cu[1] = 16
    assert cache.plan(cu, 2, 0) is not p1


def test_boundaries_hit_by_identity():
    from gdn_cp.layout import Boundaries

    cache = RouteCache()
    cu = Boundaries([0, 8, 24])
    p1 = cache.plan(cu, 2, 1)
    assert p1.cu is cu and cache.plan(cu, 2, 1) is p1


def test_device_boundaries_are_trusted_by_version(monkeypatch):
    """Off the host, a hit reads no values (that would sync): it compares the version only.

    Simulated with a CPU tensor reporting another device: a hit must not look at its values.
    """
    from gdn_cp.layout import plan as plan_module

    cache = RouteCache()
    cu = torch.tensor([0, 8, 24])
    p1 = cache.plan(cu, 2, 0)
    monkeypatch.setattr(plan_module.np, "array_equal", lambda *a: pytest.fail("read device values"))
    monkeypatch.setattr(type(cu), "device", property(lambda self: torch.device("meta")))
    assert cache.plan(cu, 2, 0) is p1
    cu.add_(0)  # an ordinary in-place write bumps the version: rebuilt
    monkeypatch.undo()
    assert cache.plan(cu, 2, 0) is not p1


def test_empty_packing_plan():
    cache = RouteCache()
    plan = cache.plan(torch.tensor([0, 0, 0]), 2, 1)
    assert plan.t_local == 0 and plan.route(ZIGZAG, CONTIGUOUS).is_identity
    assert plan.natural_order().own_rows.numel() == 0 and plan.chunkwise(4).local_cu == (0, 0)
