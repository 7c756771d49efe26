"""Real all-to-alls on gloo ranks: routes round-trip bit-exactly, gradients flow back."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gdn_cp.comm import all_gather_rows, head_to_seq, route_all_to_all, seq_to_head
from gdn_cp.layout import CONTIGUOUS, ZIGZAG, RouteCache
from tests.layout.test_routes import naive_rows
from gdn_cp.testing.packings import named_packings


def _round_trip_case(ctx):
    rank, world = ctx.rank, ctx.world_size
    group = dist.group.WORLD
    cache = RouteCache()
    report = {}
    for name, cu_list in named_packings(world).items():
        cu = torch.tensor(cu_list, dtype=torch.int32)
        plan = cache.plan(cu, world, rank)
        z2c, c2z = plan.route(ZIGZAG, CONTIGUOUS), plan.route(CONTIGUOUS, ZIGZAG)
        zig_rows = torch.tensor(naive_rows(ZIGZAG, cu_list, world)[rank], dtype=torch.float64)
        x = torch.stack([zig_rows, -zig_rows], 1).unsqueeze(-1).repeat(1, 1, 3)  # [T_local, 2, 3]
        x.requires_grad_(True)
        contiguous = route_all_to_all(x, z2c, c2z, group)
        expect = torch.tensor(naive_rows(CONTIGUOUS, cu_list, world)[rank], dtype=torch.float64)
        back = route_all_to_all(contiguous, c2z, z2c, group)
        grad_in = torch.randn_like(back)
        back.backward(grad_in)
        report[name] = (
            torch.equal(contiguous[:, 0, 0].detach(), expect),
            torch.equal(back.detach(), x.detach()),
            torch.equal(x.grad, grad_in),
        )
    return report


@pytest.mark.parametrize("world", [2, 4])
def test_zigzag_contiguous_round_trip_exact(rank_pool, world):
    for rank_report in rank_pool(world).run(_round_trip_case):
        for name, (moved_right, round_trip, grads) in rank_report.items():
            assert moved_right, f"{name}: rows landed in the wrong place"
            assert round_trip, f"{name}: zigzag->contiguous->zigzag is not exact"
            assert grads, f"{name}: gradient of the round trip != incoming gradient"


def _head_and_gather_case(ctx):
    rank, world = ctx.rank, ctx.world_size
    group = dist.group.WORLD
    torch.manual_seed(0)
    t_local, heads, dim = 6, 2 * world, 3
    full = torch.randn(world * t_local, heads, dim, dtype=torch.float64)  # rank-major rows
    x = full[rank * t_local : (rank + 1) * t_local].clone().requires_grad_(True)
    y = seq_to_head(x.view(t_local, world, heads // world, dim), group)
    mine = full.view(world * t_local, world, heads // world, dim)[:, rank]
    ok_fwd = torch.equal(y, mine)
    z = head_to_seq(y, group).reshape(t_local, heads, dim)
    g = torch.randn_like(z)
    z.backward(g)
    ok_inv = torch.equal(z.detach(), x.detach()) and torch.equal(x.grad, g)

    a = torch.full((3, 2), float(rank + 1), dtype=torch.float64, requires_grad=True)
    gathered = all_gather_rows(a, group)
    ok_gather = torch.equal(gathered[:, 0], torch.arange(1, world + 1, dtype=torch.float64).repeat_interleave(3))
    (gathered * (rank + 1)).sum().backward()
    ok_rs = torch.allclose(a.grad, torch.full_like(a, sum(range(1, world + 1))))
    return ok_fwd, ok_inv, ok_gather, ok_rs


@pytest.mark.parametrize("world", [2, 4])
def test_seq_head_all_to_all_and_all_gather(rank_pool, world):
    for ok in rank_pool(world).run(_head_and_gather_case):
        assert ok == (True, True, True, True)


def test_route_rejects_wrong_rows_before_communicating():
    plan = RouteCache().plan([0, 8, 24], 2, 0)
    route = plan.route(ZIGZAG, CONTIGUOUS)
    with pytest.raises(ValueError, match="expects 12 local rows"):
        route_all_to_all(torch.zeros(5, 2), route, plan.route(CONTIGUOUS, ZIGZAG), group=None)
    with pytest.raises(ValueError, match="inverse route"):
        route_all_to_all(torch.zeros(12, 2), route, route, group=None)


def _stats_case(ctx):
    from gdn_cp.comm import comm_stats, reset_comm_stats

    rank, world = ctx.rank, ctx.world_size
    plan = RouteCache().plan(torch.tensor(named_packings(world)["straddling"]), world, rank)
    z2c, c2z = plan.route(ZIGZAG, CONTIGUOUS), plan.route(CONTIGUOUS, ZIGZAG)
    reset_comm_stats()
    x = torch.zeros(plan.t_local, 5, dtype=torch.float32)
    route_all_to_all(x, z2c, c2z, dist.group.WORLD)
    return comm_stats(), plan.t_local


def test_comm_stats_count_bytes_sent(rank_pool):
    for stats, t_local in rank_pool(2).run(_stats_case):
        assert stats["route_all_to_all"] == t_local * 5 * 4 and stats["route_all_to_all:calls"] == 1
