"""gdn_core runs the mode the registry names, hands backends the plan's Boundaries, and takes
packings of nothing but padding slots."""

from __future__ import annotations

import inspect
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gdn_cp.layout import Boundaries, RouteCache
from gdn_cp.modes import CallContext, GDNShape, Mode, Settings, gdn_core, prepare_mode
from gdn_cp.modes.spec import MODE_NAMES, MODES
from gdn_cp.ops import get_backend
from gdn_cp.modes.inputs import core_inputs
from gdn_cp_testing.packings import zigzag_rows

reference = get_backend("reference")

SHAPE = GDNShape(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8)


@pytest.mark.parametrize("name", MODE_NAMES)
def test_every_registered_mode_prepares_a_core(name):
    """Every registry entry has its class, from the mode's own file, naming the entry; its prepare()
    gives a Mode whose core is callable the way gdn_core calls it."""
    from gdn_cp.modes.entry import MODE_CLASSES

    spec = MODES[name]
    runner = MODE_CLASSES[spec]
    assert set(MODE_CLASSES) == set(MODES.values()) and runner.spec is spec
    assert issubclass(runner, Mode) and runner.__module__ == f"gdn_cp.modes.{name}"
    args, plan = _args([0, 8], cp=2)
    ctx = CallContext(settings=Settings(mode=name), shape=SHAPE, plan=plan, group=object(), backend=reference)
    mode = prepare_mode(ctx)
    assert type(mode) is runner and mode.path
    inspect.signature(mode.core).bind(ctx, *args)


def test_mode_registry_import_is_torch_free():
    code = ("import sys, gdn_cp.modes.spec as s; s.get_mode('chunkwise').cost; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy'}))")
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo,
                         env={"PYTHONPATH": str(repo), "PATH": ""}, check=True).stdout
    assert out.strip() == "[]"


def _args(cu, cp=1, rank=0):
    plan = RouteCache().plan(Boundaries(cu), cp, rank)
    inputs = core_inputs(cu[-1], SHAPE, 4, torch.float64, seed=1)
    rows = zigzag_rows(cu, cp, rank)
    return [inputs[k][rows] for k in ("qkv", "g", "beta")] + [inputs["conv_weight"], inputs["conv_bias"]], plan


def test_bad_mode_and_setting_fail_before_anything_runs():
    args, plan = _args([0, 8])
    with pytest.raises(ValueError, match="linear_cp_mode='ring' is not a concrete mode"):
        gdn_core(*args, shape=SHAPE, mode="ring", plan=plan, group=None, backend=reference)
    with pytest.raises(ValueError, match="chunkwise_path='fast'"):
        gdn_core(*args, shape=SHAPE, mode="chunkwise", plan=plan, group=None, backend=reference, chunkwise_path="fast")


def recording_backend():
    """``(the reference backend recording every cu_seqlens it is handed, that list)``."""
    seen = []

    def causal_conv1d(*args, cu_seqlens, **kwargs):
        seen.append(cu_seqlens)
        return reference.causal_conv1d(*args, cu_seqlens=cu_seqlens, **kwargs)

    def chunk_gated_delta_rule(*args, cu_seqlens, **kwargs):
        seen.append(cu_seqlens)
        return reference.chunk_gated_delta_rule(*args, cu_seqlens=cu_seqlens, **kwargs)

    return replace(reference, causal_conv1d=causal_conv1d, chunk_gated_delta_rule=chunk_gated_delta_rule), seen


def _boundaries_handed_to_backends(ctx):
    rank, world = ctx.rank, ctx.world_size
    """Two calls per mode on one plan: which boundaries objects did the backend get?"""
    cu = [0, 6 * world, 20 * world, 20 * world, 32 * world]  # straddling sequences and a padding slot
    args, plan = _args(cu, world, rank)
    out = {}
    for mode in MODE_NAMES:
        calls = []
        for _ in range(2):
            backend, seen = recording_backend()
            gdn_core(*args, shape=SHAPE, mode=mode, plan=plan, group=dist.group.WORLD, backend=backend)
            calls.append(seen)
        out[mode] = {
            "all_boundaries": all(isinstance(c, Boundaries) for c in calls[0] + calls[1]),
            "same_objects": [id(c) for c in calls[0]] == [id(c) for c in calls[1]],
            "calls": len(calls[0]),
        }
    return out


def test_backends_get_the_plans_boundaries_every_call(rank_pool):
    """No per-call lists: a backend sees the plan's Boundaries objects, so their device copies are
    made once per micro-batch (FLA reads them from the cache on the object). The conv is gdn-cp's fused
    step (it reads the row positions cached on the same objects); the backend gets the scans."""
    for rank, per_mode in enumerate(rank_pool(2).run(_boundaries_handed_to_backends)):
        for mode, rec in per_mode.items():
            assert rec["calls"] >= 1 and rec["all_boundaries"] and rec["same_objects"], (rank, mode, rec)


def _empty_packing(ctx):
    rank, world = ctx.rank, ctx.world_size
    cu = [0, 0, 0]  # nothing but padding slots
    args, plan = _args(cu, world, rank)
    out = {}
    for mode in MODE_NAMES:
        leaves = [t.detach().clone().requires_grad_(True) for t in args]
        o = gdn_core(*leaves, shape=SHAPE, mode=mode, plan=plan, group=dist.group.WORLD, backend=reference)
        if o.requires_grad:  # the same on every rank, so backward collectives stay matched
            o.sum().backward()
        out[mode] = tuple(o.shape)
    return out


def test_every_mode_takes_an_empty_packing(rank_pool):
    for per_mode in rank_pool(2).run(_empty_packing):
        assert per_mode == {mode: (0, SHAPE.num_v_heads, SHAPE.head_v_dim) for mode in MODE_NAMES}


def _bad_log_decay_on_one_rank(ctx, mode):
    """Rank 1 alone holds a g > 0: every rank must refuse, before any data moves."""
    cu = [0, 8 * ctx.world_size, 16 * ctx.world_size]
    args, plan = _args(cu, ctx.world_size, ctx.rank)
    if ctx.rank == 1:
        args[1] = args[1].clone()
        args[1][3, 0] = 5.0
    before = ctx.collective_count()
    try:
        gdn_core(*args, shape=SHAPE, mode=mode, plan=plan, group=dist.group.WORLD, backend=reference)
    except ValueError as err:
        # the agreement itself is one all-reduce; no data collective ran
        return str(err), ctx.collective_count() - before
    return None, ctx.collective_count() - before


@pytest.mark.parametrize("mode", MODE_NAMES)
def test_a_bad_log_decay_on_one_rank_stops_every_rank(rank_pool, mode):
    results = rank_pool(2).run(_bad_log_decay_on_one_rank, mode)
    (msg0, n0), (msg1, n1) = results
    assert msg1 is not None and "g[3, 0]=5.0" in msg1, msg1
    assert msg0 is not None and "another rank" in msg0, msg0
    assert n0 == n1 == 1, (n0, n1)
