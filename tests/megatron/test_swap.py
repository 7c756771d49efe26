"""chunkwise's layout swap point: the byte rule, and both swap points equal CP=1."""

from __future__ import annotations

import pytest
import torch

from gdn_cp.modes import GDNShape, Settings
from gdn_cp.modes.swap import choose_swap_point
from gdn_cp_testing.megatron.parity import HIDDEN, parity_case
from gdn_cp_testing.packings import thd_case

QWEN35_9B = dict(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128)


def _tp_shape(tp):
    return GDNShape(**{**QWEN35_9B, "num_k_heads": 16 // tp, "num_v_heads": 32 // tp})


def test_qwen_shape_tp1_swaps_hidden_states_at_half_of_stock_headwise():
    """The example in gdn_cp/modes/swap.py's docstring and the README."""
    c = choose_swap_point(shape=_tp_shape(1), hidden_size=4096, tp=1, sequence_parallel=False, act_bytes=2)
    assert (c.point, c.hidden_bytes, c.core_bytes, c.stock_headwise_bytes) == ("hidden", 16384, 24768, 32896)
    assert c.hidden_bytes <= 0.5 * c.stock_headwise_bytes


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("act_bytes", [2, 4])
def test_never_more_than_stock_headwise(tp, sp, act_bytes):
    c = choose_swap_point(shape=_tp_shape(tp), hidden_size=4096, tp=tp, sequence_parallel=sp, act_bytes=act_bytes)
    moved = c.hidden_bytes if c.point == "hidden" else c.core_bytes
    assert moved <= c.stock_headwise_bytes and moved == min(b for b in (c.hidden_bytes, c.core_bytes) if b)
    if sp and tp > 1:
        assert c.point == "core" and c.hidden_bytes is None


def test_wide_tensors_win_once_tp_splits_them():
    c = choose_swap_point(shape=_tp_shape(2), hidden_size=4096, tp=2, sequence_parallel=False, act_bytes=2)
    assert c.point == "core" and c.core_bytes < c.hidden_bytes


def test_forcing_hidden_under_sequence_parallel_is_refused():
    with pytest.raises(ValueError, match="sequence_parallel"):
        choose_swap_point(shape=_tp_shape(2), hidden_size=4096, tp=2, sequence_parallel=True, act_bytes=2,
                          requested="hidden")
    with pytest.raises(ValueError, match="chunkwise_swap='middle' .GDN_CP_CHUNKWISE_SWAP. must be one of auto, hidden, core"):
        Settings(mode="chunkwise", chunkwise_swap="middle")


def _both_points(ctx):
    from gdn_cp_testing.probes import all_to_all_bytes, env_setting

    rank, world = ctx.rank, ctx.world_size
    out, moved = {}, {}
    for point in ("hidden", "core"):
        with env_setting("GDN_CP_CHUNKWISE_SWAP", point):
            for layout in ("thd", "sbhd"):
                with all_to_all_bytes() as sent:
                    out[(point, layout)] = parity_case(rank, world, layout, torch.float64, ("chunkwise",))["chunkwise"]
                moved[(point, layout)] = sent.bytes
    t_local = thd_case(world)[0][-1] // world
    # hidden swap: hidden_states in and the output back, forward and backward, fp64.
    return out, moved, 4 * t_local * HIDDEN * 8


@pytest.mark.megatron
def test_both_swap_points_equal_cp1(patched_megatron, rank_pool):
    for rank, (res, moved, hidden_thd) in enumerate(rank_pool(2).run(_both_points)):
        for key, errs in res.items():
            assert max(errs.values()) <= 1e-10, (rank, key, errs)
        assert moved[("hidden", "thd")] == hidden_thd, moved
        assert moved[("core", "thd")] != hidden_thd, moved
