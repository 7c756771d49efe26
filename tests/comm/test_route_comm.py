"""Real all-to-alls on gloo ranks: routes round-trip bit-exactly, gradients flow back."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gdn_cp.comm import all_gather_rows, head_to_seq, route_all_to_all, seq_to_head
from gdn_cp.layout import CONTIGUOUS, ZIGZAG, RouteCache
from tests.layout.test_routes import naive_rows
from gdn_cp_testing.packings import named_packings


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


def _bytes_case(ctx):
    from gdn_cp_testing.probes import all_to_all_bytes

    rank, world = ctx.rank, ctx.world_size
    plan = RouteCache().plan(torch.tensor(named_packings(world)["straddling"]), world, rank)
    z2c, c2z = plan.route(ZIGZAG, CONTIGUOUS), plan.route(CONTIGUOUS, ZIGZAG)
    x = torch.zeros(plan.t_local, 5, dtype=torch.float32)
    with all_to_all_bytes() as sent:
        route_all_to_all(x, z2c, c2z, dist.group.WORLD)
    return sent, plan.t_local


def test_the_byte_probe_counts_what_a_route_sends(rank_pool):
    """The tests' all-to-all byte count (gdn_cp_testing.probes) sees a route's whole send buffer."""
    for sent, t_local in rank_pool(2).run(_bytes_case):
        assert (sent.bytes, sent.calls) == (t_local * 5 * 4, 1)


class _Log(torch.autograd.Function):
    """Identity that writes ``name`` into ``log`` when its backward runs."""

    @staticmethod
    def forward(ctx, x, log, name):
        ctx.log, ctx.name = log, name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(ctx.name)
        return grad, None, None


def _gather_in_flight_case(ctx):
    """start / wait equals all_gather_rows (values and gradients), the gloo CPU collectives run
    asynchronously, and backward mirrors forward: the reduce-scatter is launched before the
    backward of the work done between start and wait, and waited for after it."""
    import gdn_cp.comm.collectives as coll

    rank, world = ctx.rank, ctx.world_size
    group = dist.group.WORLD
    log: list[str] = []
    a = torch.full((2, 3), float(rank + 1), dtype=torch.float64, requires_grad=True)
    b = torch.arange(4.0, dtype=torch.float64, requires_grad=True)  # the overlapped work's input
    launched = coll._reduce_scatter_flat

    def logged_reduce_scatter(*args, **kwargs):
        log.append("reduce_scatter launched" + (" async" if kwargs.get("async_op") else ""))
        return launched(*args, **kwargs)

    coll._reduce_scatter_flat = logged_reduce_scatter
    try:
        flight = coll.start_all_gather_rows(_Log.apply(a, log, "before start"), group)
        mid = _Log.apply(b * 2, log, "between start and wait")
        gathered = coll.wait_all_gather_rows(flight)
        ok_gather = torch.equal(gathered[:, 0], torch.arange(1, world + 1, dtype=torch.float64).repeat_interleave(2))
        ((gathered * (rank + 1)).sum() + mid.sum()).backward()
    finally:
        coll._reduce_scatter_flat = launched
    ok_grad = torch.equal(a.grad, torch.full_like(a, sum(range(1, world + 1)))) and torch.equal(b.grad, 2 * torch.ones(4, dtype=torch.float64))
    try:
        coll.wait_all_gather_rows(flight)
        twice = "no error"
    except ValueError as err:
        twice = str(err)
    return ok_gather, ok_grad, log, flight.async_op, twice


@pytest.mark.parametrize("world", [2, 4])
def test_gather_in_flight_mirrors_its_overlap_in_backward(rank_pool, world):
    for ok_gather, ok_grad, log, async_op, twice in rank_pool(world).run(_gather_in_flight_case):
        assert ok_gather and ok_grad
        assert async_op  # gloo with CPU tensors: asynchronous
        assert log == ["reduce_scatter launched async", "between start and wait", "before start"], log
        assert "already waited" in twice


def _many_case(ctx):
    """route_all_to_all_many moves tensors of mixed dtypes and shapes bit for bit where separate
    routes put them, in one all-to-all per direction, and its gradients are theirs."""
    from gdn_cp.comm import route_all_to_all_many
    from gdn_cp_testing.probes import all_to_all_bytes

    rank, world = ctx.rank, ctx.world_size
    group = dist.group.WORLD
    cache = RouteCache()
    report = {}
    for name, cu_list in named_packings(world).items():
        plan = cache.plan(torch.tensor(cu_list, dtype=torch.int32), world, rank)
        z2c, c2z = plan.route(ZIGZAG, CONTIGUOUS), plan.route(CONTIGUOUS, ZIGZAG)
        n = z2c.rows_in
        gen = torch.Generator().manual_seed(rank)
        wide = torch.randn(n, 7, generator=gen, dtype=torch.float64)[:, 1:5].reshape(n, 2, 2)  # strided input
        xs = [wide, torch.randn(n, generator=gen), torch.randn(n, 5, generator=gen).to(torch.bfloat16)]
        leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in xs]
        with all_to_all_bytes() as sent:
            moved = route_all_to_all_many(leaves, z2c, c2z, group)
        calls = sent.calls
        back = route_all_to_all_many(moved, c2z, z2c, group)
        grads = [torch.randn_like(b) for b in back]
        torch.autograd.backward(back, grads)
        singles = [route_all_to_all(x, z2c, c2z, group) for x in xs]
        report[name] = (
            all(torch.equal(m, s) and m.dtype == s.dtype for m, s in zip(moved, singles)),
            all(torch.equal(b, x) for b, x in zip(back, xs)),
            all(torch.equal(leaf.grad, g) for leaf, g in zip(leaves, grads)),
            calls == (0 if z2c.is_identity else 1),
        )
    return report


@pytest.mark.parametrize("world", [2, 4])
def test_route_many_packs_mixed_dtypes_exactly(rank_pool, world):
    for rank_report in rank_pool(world).run(_many_case):
        for name, (same_as_single, round_trip, grads, one_call) in rank_report.items():
            assert same_as_single, f"{name}: packed rows differ from separate routes"
            assert round_trip and grads, f"{name}: round trip or gradients not exact"
            assert one_call, f"{name}: more than one all-to-all for the packed tensors"


def test_route_many_checks_before_communicating():
    from gdn_cp.comm import route_all_to_all_many

    plan = RouteCache().plan([0, 8, 24], 2, 0)
    route, inverse = plan.route(ZIGZAG, CONTIGUOUS), plan.route(CONTIGUOUS, ZIGZAG)
    with pytest.raises(ValueError, match="expects 12 local rows, item 1"):
        route_all_to_all_many([torch.zeros(12, 2), torch.zeros(5)], route, inverse, group=None)
    with pytest.raises(ValueError, match="inverse route"):
        route_all_to_all_many([torch.zeros(12)], route, route, group=None)
