"""The chunkwise path setting: ``auto`` / ``native`` / ``generic``, from set_chunkwise_path or
GDN_CP_CHUNKWISE_PATH; an impossible ``native`` fails before any collective, naming the fix."""

from __future__ import annotations

import pytest
import torch

import gdn_cp.modes.chunkwise as chunkwise
from gdn_cp.layout import RouteCache
from gdn_cp.modes import GDNShape
from gdn_cp.ops import get_backend
from gdn_cp.testing.inputs import core_inputs

SHAPE = GDNShape(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8)


@pytest.fixture(autouse=True)
def _restore_setting(monkeypatch):
    monkeypatch.delenv(chunkwise.CHUNKWISE_PATH_ENV, raising=False)
    yield
    chunkwise.set_chunkwise_path(None)


class _FakeBackend:
    """The reference kernels plus a native CP core that only records that it ran."""

    __name__ = "fake"

    def __init__(self):
        self.ref = get_backend("reference")
        self.native_calls = 0

    def causal_conv1d(self, *a, **k):
        return self.ref.causal_conv1d(*a, **k)

    def chunk_gated_delta_rule(self, *a, **k):
        return self.ref.chunk_gated_delta_rule(*a, **k)

    def native_cp_core(self, group):
        def core(qkv, g, beta, *rest, **kw):
            self.native_calls += 1
            return qkv.new_zeros(qkv.shape[0], SHAPE.num_v_heads, SHAPE.head_v_dim)

        return core


def test_setting_comes_from_the_call_then_the_environment(monkeypatch):
    assert chunkwise.chunkwise_path() == "auto"
    monkeypatch.setenv(chunkwise.CHUNKWISE_PATH_ENV, "generic")
    assert chunkwise.chunkwise_path() == "generic"
    chunkwise.set_chunkwise_path("native")
    assert chunkwise.chunkwise_path() == "native"
    chunkwise.set_chunkwise_path(None)
    assert chunkwise.chunkwise_path() == "generic"


def test_bad_settings_name_the_choices(monkeypatch):
    with pytest.raises(ValueError, match="auto, native, generic"):
        chunkwise.set_chunkwise_path("fla")
    monkeypatch.setenv(chunkwise.CHUNKWISE_PATH_ENV, "nccl")
    with pytest.raises(ValueError, match="GDN_CP_CHUNKWISE_PATH='nccl'"):
        chunkwise.chunkwise_path()


def test_resolve_picks_native_only_where_it_exists():
    fake, ref, group = _FakeBackend(), get_backend("reference"), object()
    assert chunkwise.resolve_chunkwise_path(fake, group)[0] == "native"
    assert chunkwise.resolve_chunkwise_path(ref, group) == ("generic", None)
    chunkwise.set_chunkwise_path("generic")
    assert chunkwise.resolve_chunkwise_path(fake, group) == ("generic", None)
    chunkwise.set_chunkwise_path("native")
    assert chunkwise.resolve_chunkwise_path(fake, group)[0] == "native"
    with pytest.raises(ValueError, match="no native CP core.*set 'auto' or 'generic'"):
        chunkwise.resolve_chunkwise_path(ref, group)


def test_contiguous_core_follows_the_setting():
    """A slice with no sequence crossing a rank edge needs no collective on the generic path, so
    a stand-in group shows which path ran: generic computes, native is the fake's zeros."""
    cu = [0, 16, 32]  # cp=2: rank 0 holds exactly the first sequence
    plan = RouteCache().plan(torch.tensor(cu), 2, 0)
    x = core_inputs(cu[-1], SHAPE, 4, torch.float64, seed=3)
    args = (x["qkv"][:16], x["g"][:16], x["beta"][:16], x["conv_weight"], None)
    fake = _FakeBackend()
    o_auto = chunkwise.contiguous_core(*args, shape=SHAPE, plan=plan, group=object(), backend=fake)
    assert fake.native_calls == 1 and o_auto.abs().max() == 0
    chunkwise.set_chunkwise_path("generic")
    o_generic = chunkwise.contiguous_core(*args, shape=SHAPE, plan=plan, group=object(), backend=fake)
    assert fake.native_calls == 1 and o_generic.abs().max() > 0


def test_native_without_a_native_core_fails_before_the_route():
    """chunkwise_core checks the setting before its first all-to-all: a stand-in group that
    cannot communicate is never reached."""
    cu = [0, 24, 32]
    plan = RouteCache().plan(torch.tensor(cu), 2, 0)
    x = core_inputs(16, SHAPE, 4, torch.float64, seed=3)
    chunkwise.set_chunkwise_path("native")
    with pytest.raises(ValueError, match="no native CP core"):
        chunkwise.chunkwise_core(x["qkv"], x["g"], x["beta"], x["conv_weight"], None, shape=SHAPE, plan=plan,
                                 group=object(), backend=get_backend("reference"))


class _FakeZigzagBackend(_FakeBackend):
    """Also a native zigzag core that records the rows it was given (FLA >= 0.6's zigzag cp context)."""

    def __init__(self):
        super().__init__()
        self.zigzag_calls = []

    def native_zigzag_cp_core(self, group):
        def core(qkv, g, beta, *rest, cu_seqlens_global, **kw):
            self.zigzag_calls.append((qkv, tuple(cu_seqlens_global)))
            return qkv.new_ones(qkv.shape[0], SHAPE.num_v_heads, SHAPE.head_v_dim)

        return core


@pytest.mark.parametrize("cu, split, one_stream", [
    ([0, 32], "per_document", True),  # one sequence: SBHD at batch 1
    ([0, 0, 32, 32], "per_document", True),  # one non-empty sequence among padding slots
    ([0, 8, 32], "per_document", False),  # two documents each cut on its own
    ([0, 3, 20, 32], "whole_row", True),  # the whole row cut as one sequence
])
def test_one_zigzag_stream(cu, split, one_stream):
    plan = RouteCache().plan(cu, 2, 1, split=split)
    assert chunkwise.is_one_zigzag_stream(plan) is one_stream


def test_zigzag_core_takes_one_stream_as_it_is():
    """Rows that are one zigzag-cut stream go to the backend's zigzag core unmoved (the stand-in group
    would fail any collective), with the documents' boundaries; other rows take the routes."""
    fake, group = _FakeZigzagBackend(), object()
    plan = RouteCache().plan([0, 3, 20, 32], 2, 0, split="whole_row")
    inp = core_inputs(plan.t_local, SHAPE, 4, torch.float64, seed=0)
    o = chunkwise.chunkwise_core(inp["qkv"], inp["g"], inp["beta"], inp["conv_weight"], None, shape=SHAPE, plan=plan,
                                 group=group, backend=fake)
    assert torch.equal(o, torch.ones_like(o)) and fake.zigzag_calls[0][0] is inp["qkv"]
    assert fake.zigzag_calls[0][1] == (0, 3, 20, 32)
    assert not chunkwise.chunkwise_swaps_layout(fake, group, plan)
    per_doc = RouteCache().plan([0, 8, 32], 2, 0)
    assert chunkwise.chunkwise_swaps_layout(fake, group, per_doc)
    chunkwise.set_chunkwise_path("generic")  # generic never takes a native core
    assert chunkwise.chunkwise_swaps_layout(fake, group, plan)
    chunkwise.set_chunkwise_path(None)
    # a backend without a zigzag core routes even one stream
    assert chunkwise.chunkwise_swaps_layout(_FakeBackend(), group, plan)
