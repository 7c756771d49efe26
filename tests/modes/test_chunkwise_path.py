"""The chunkwise path setting: ``auto`` / ``native`` / ``generic``, from ``gdn_core(chunkwise_path=...)``
or GDN_CP_CHUNKWISE_PATH, decided once per call by ``Chunkwise.prepare``; an impossible ``native``
fails before any collective, naming the fix."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

import gdn_cp.modes.chunkwise as chunkwise
from gdn_cp.layout import RouteCache
from gdn_cp.modes import CallContext, GDNShape, Settings, gdn_core, prepare_mode
from gdn_cp.ops import get_backend
from gdn_cp.modes.inputs import core_inputs
from gdn_cp_testing.packings import zigzag_rows

SHAPE = GDNShape(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8)
PATH_ENV = "GDN_CP_CHUNKWISE_PATH"


@pytest.fixture(autouse=True)
def _no_setting(monkeypatch):
    monkeypatch.delenv(PATH_ENV, raising=False)


def _native_core(group):
    """A native CP core that only answers zeros (prepare never calls it)."""
    def core(qkv, g, beta, *rest, **kw):
        return qkv.new_zeros(qkv.shape[0], SHAPE.num_v_heads, SHAPE.head_v_dim)

    return core


def _fake_backend():
    """The reference kernels plus a native CP core."""
    return replace(get_backend("reference"), native_cp_core=_native_core)


def _context(plan, backend, path="auto", group=None):
    """A call's context as a boundary makes it (a stand-in group: prepare makes no collective)."""
    return CallContext(settings=Settings(mode="chunkwise", chunkwise_path=path), shape=SHAPE, plan=plan,
                       group=object() if group is None else group, backend=backend)


def test_setting_comes_from_the_call_then_the_environment(monkeypatch):
    assert Settings.from_environment(mode="chunkwise").chunkwise_path == "auto"
    monkeypatch.setenv(PATH_ENV, "generic")
    assert Settings.from_environment(mode="chunkwise").chunkwise_path == "generic"
    assert Settings.from_environment(mode="chunkwise", chunkwise_path="native").chunkwise_path == "native"


def test_bad_settings_name_the_choices(monkeypatch):
    with pytest.raises(ValueError, match="chunkwise_path='fla'.*auto, native, generic"):
        Settings(mode="chunkwise", chunkwise_path="fla")
    monkeypatch.setenv(PATH_ENV, "nccl")
    with pytest.raises(ValueError, match="GDN_CP_CHUNKWISE_PATH='nccl'"):
        Settings.from_environment(mode="chunkwise")


def test_prepare_picks_native_only_where_it_exists():
    plan = RouteCache().plan([0, 16, 32], 2, 0)
    fake, ref = _fake_backend(), get_backend("reference")
    assert prepare_mode(_context(plan, fake)).path == "native"
    generic = prepare_mode(_context(plan, ref))
    assert (generic.path, generic.native) == ("generic", None)
    assert prepare_mode(_context(plan, fake, "generic")).path == "generic"
    assert prepare_mode(_context(plan, fake, "native")).path == "native"
    with pytest.raises(ValueError, match="no native CP core.*set 'auto' or 'generic'"):
        prepare_mode(_context(plan, ref, "native"))


def _native_without_a_native_core(ctx):
    """gdn_core refuses 'native' on the reference backend on every rank, before any collective."""
    cu = [0, 24 * ctx.world_size]
    plan = RouteCache().plan(torch.tensor(cu), ctx.world_size, ctx.rank)
    x = core_inputs(cu[-1], SHAPE, 4, torch.float64, seed=3)
    rows = zigzag_rows(cu, ctx.world_size, ctx.rank)
    before = ctx.collective_count()
    try:
        gdn_core(x["qkv"][rows], x["g"][rows], x["beta"][rows], x["conv_weight"], None, shape=SHAPE, mode="chunkwise",
                 plan=plan, group=dist.group.WORLD, backend=get_backend("reference"), chunkwise_path="native")
    except ValueError as err:
        return str(err), ctx.collective_count() - before
    return None, ctx.collective_count() - before


def test_native_without_a_native_core_fails_before_any_collective(rank_pool):
    for message, collectives in rank_pool(2).run(_native_without_a_native_core):
        assert message is not None and "no native CP core" in message and collectives == 0, (message, collectives)


def _fake_zigzag_backend():
    """``(the fake backend with a native zigzag core too, the rows and boundaries that core was given)``
    (FLA >= 0.6's zigzag cp context)."""
    calls = []

    def zigzag_core(group):
        def core(qkv, g, beta, *rest, cu_seqlens_global, **kw):
            calls.append((qkv, tuple(cu_seqlens_global)))
            return qkv.new_ones(qkv.shape[0], SHAPE.num_v_heads, SHAPE.head_v_dim)

        return core

    return replace(_fake_backend(), native_zigzag_cp_core=zigzag_core), calls


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
    fake, zigzag_calls = _fake_zigzag_backend()
    plan = RouteCache().plan([0, 3, 20, 32], 2, 0, split="whole_row")
    inp = core_inputs(plan.t_local, SHAPE, 4, torch.float64, seed=0)
    ctx = _context(plan, fake)
    mode = prepare_mode(ctx)
    assert (mode.path, mode.swap) == ("native-zigzag", None)
    o = mode.core(ctx, inp["qkv"], inp["g"], inp["beta"], inp["conv_weight"], None)
    assert torch.equal(o, torch.ones_like(o)) and zigzag_calls[0][0] is inp["qkv"]
    assert zigzag_calls[0][1] == (0, 3, 20, 32)
    per_doc = RouteCache().plan([0, 8, 32], 2, 0)
    assert prepare_mode(_context(per_doc, fake)).path == "native"
    assert prepare_mode(_context(plan, fake, "generic")).path == "generic"  # generic never takes a native core
    assert prepare_mode(_context(plan, _fake_backend())).path == "native"  # no zigzag core: routed


class _Producer(torch.autograd.Function):
    """Identity whose backward hands back the gradient it was given, so a test can see what its input gets."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _Producer.seen = grad
        return grad


@pytest.mark.parametrize("conv_grad", ["fresh", "rows_of_a_bigger_one", "expanded", "none"])
def test_the_halo_tail_gradient_is_added_into_the_conv_gradient(conv_grad):
    """gather_halo's tail: x's gradient is the conv's plus the tail's in the last W-1 rows, added in place
    into the conv's gradient (no zero-filled [T, C] gradient of a slice, no full-size sum), on a copy where
    the conv's gradient is expanded, and the tail's alone where the conv's is missing."""
    n, rows, width = 3, 10, 6
    x = torch.randn(rows, width, dtype=torch.float64, requires_grad=True)
    alias, tail = chunkwise._TailOf.apply(x, n)
    assert torch.equal(tail, x[-n:]) and tail.is_contiguous() and torch.equal(alias, x)
    g_tail = torch.randn(n, width, dtype=torch.float64)
    if conv_grad == "fresh":
        g_conv = torch.randn(rows, width, dtype=torch.float64)
    elif conv_grad == "rows_of_a_bigger_one":
        g_conv = torch.randn(rows + 2, width, dtype=torch.float64)[2:]
    elif conv_grad == "expanded":
        g_conv = torch.ones(1, 1, dtype=torch.float64).expand(rows, width)
    expected = (torch.zeros(rows, width, dtype=torch.float64) if conv_grad == "none" else g_conv.clone())
    expected[-n:] += g_tail
    through = _Producer.apply(alias)
    if conv_grad == "none":
        tail.backward(g_tail)
    else:
        torch.autograd.backward([through, tail], [g_conv, g_tail])
    assert torch.equal(x.grad, expected)
    if conv_grad in ("fresh", "rows_of_a_bigger_one"):
        assert torch.equal(_Producer.seen, expected)  # the conv's own gradient tensor took the tail's rows
