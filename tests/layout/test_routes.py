"""Routes against a naive per-token builder, simulated all-to-all over all ranks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gdn_cp.layout import (
    CONTIGUOUS,
    ZIGZAG,
    build_chunkwise_plan,
    build_natural_order,
    build_sbhd_route,
    build_thd_route,
    validate_cu_seqlens,
)
from gdn_cp_testing.packings import named_packings

CPS = [1, 2, 4, 8]
DIRECTIONS = [(ZIGZAG, CONTIGUOUS), (CONTIGUOUS, ZIGZAG)]


def naive_owner(layout, cu, cp, g):
    """(rank, local row) of global row g, by a per-token walk: obviously right."""
    t_local = cu[-1] // cp
    if layout == CONTIGUOUS:
        return g // t_local, g % t_local
    for i in range(len(cu) - 1):
        if cu[i] <= g < cu[i + 1]:
            chunk = (cu[i + 1] - cu[i]) // (2 * cp)
            part, off = divmod(g - cu[i], chunk)
            base = cu[i] // cp
            if part < cp:
                return part, base + off
            return 2 * cp - 1 - part, base + chunk + off
    raise AssertionError(g)


def naive_rows(layout, cu, cp):
    """rows[r] = global row ids of rank r in local order."""
    rows = [dict() for _ in range(cp)]
    for g in range(cu[-1]):
        r, loc = naive_owner(layout, cu, cp, g)
        rows[r][loc] = g
    return [[d[i] for i in range(len(d))] for d in rows]


def simulate(cu, cp, source, target):
    """Run every rank's route on 'global row id' data with a python all-to-all."""
    routes = [build_thd_route(cu, cp, r, source, target) for r in range(cp)]
    src_rows = naive_rows(source, cu, cp)
    sent = []
    for r, route in enumerate(routes):
        x = torch.tensor(src_rows[r], dtype=torch.int64)
        buf = x if route.send_index is None else x[route.send_index]
        sent.append(list(torch.split(buf, list(route.send_splits))))
    out = []
    for r, route in enumerate(routes):
        recv = torch.cat([sent[q][r] for q in range(cp)])
        assert recv.numel() == sum(route.recv_splits)
        y = recv if route.recv_index is None else recv[route.recv_index]
        out.append(y.tolist())
    return routes, out


@pytest.mark.parametrize("cp", CPS)
@pytest.mark.parametrize("source,target", DIRECTIONS)
@pytest.mark.parametrize("name", list(named_packings(1)))
def test_route_matches_per_token_reference(cp, source, target, name):
    cu = named_packings(cp)[name]
    routes, out = simulate(cu, cp, source, target)
    assert out == naive_rows(target, cu, cp)
    for route in routes:
        assert route.is_identity == (cp == 1)


@pytest.mark.parametrize("cp", CPS)
def test_natural_order_matches_reference(cp):
    cu = named_packings(cp)["straddling"]
    zig = naive_rows(ZIGZAG, cu, cp)
    buffer = [g for r in range(cp) for g in zig[r]]  # rank-major buffer after all-gather
    for r in range(cp):
        nat = build_natural_order(cu, cp, r)
        assert [buffer[i] for i in nat.to_natural.tolist()] == list(range(cu[-1]))
        assert nat.to_buffer.tolist() == buffer
        assert nat.own_rows.tolist() == zig[r]


@pytest.mark.parametrize("cp", [2, 4])
def test_sbhd_route_is_b_major_thd(cp):
    s, b = 8 * cp, 3
    for r in range(cp):
        got = build_sbhd_route(s, b, cp, r, ZIGZAG, CONTIGUOUS)
        want = build_thd_route([0, s, 2 * s, 3 * s], cp, r, ZIGZAG, CONTIGUOUS)
        assert got.send_splits == want.send_splits and got.recv_splits == want.recv_splits


def test_identity_route_moves_nothing():
    route = build_thd_route([0, 8, 16], 1, 0, ZIGZAG, CONTIGUOUS)
    assert route.is_identity and route.send_index is None and route.recv_index is None


@settings(max_examples=1200, deadline=None)
@given(
    cp=st.sampled_from([1, 2, 3, 4, 8]),
    units=st.lists(st.integers(0, 7), min_size=1, max_size=10),
    data=st.data(),
)
def test_route_property_random_packings(cp, units, data):
    if sum(units) == 0:
        units = units + [1]
    cu = [0]
    for u in units:
        cu.append(cu[-1] + u * 2 * cp)
    source, target = data.draw(st.sampled_from(DIRECTIONS))
    _, out = simulate(cu, cp, source, target)
    assert out == naive_rows(target, cu, cp)


@pytest.mark.parametrize(
    "cu,cp,match",
    [
        (torch.tensor([[0, 8]]), 2, "1-D"),
        (torch.tensor([0.0, 8.0]), 2, "integer dtype"),
        ([1, 8], 2, r"cu_seqlens\[0\] must be 0"),
        ([0, 8, 4], 2, "non-decreasing"),
        ([0, 8, 14], 2, "sequence 1 .* length 6, not divisible by 2\\*cp=4"),
        ([0], 2, "at least 2"),
        (["0", 8], 2, "must be an int"),
    ],
)
def test_bad_boundaries_raise(cu, cp, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build_thd_route(cu, cp, 0, ZIGZAG, CONTIGUOUS)


def test_last_boundary_must_match_t_global():
    with pytest.raises(ValueError, match="must equal the packed length T_global=24"):
        validate_cu_seqlens([0, 8, 16], 2, t_global=24)


def test_t_global_not_divisible_by_cp_is_reported():
    # Every length divisible by 2*cp implies T % cp == 0; the per-sequence message names the sequence.
    with pytest.raises(ValueError, match="sequence 0"):
        validate_cu_seqlens([0, 9], 3)


@pytest.mark.parametrize("rank", [-1, 2, 1.0])
def test_bad_rank_raises(rank):
    with pytest.raises(ValueError, match="cp_rank"):
        build_thd_route([0, 8], 2, rank, ZIGZAG, CONTIGUOUS)


def test_bad_layout_raises():
    with pytest.raises(ValueError, match="layout"):
        build_thd_route([0, 8], 2, 0, "zig-zag", CONTIGUOUS)


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("cu", [[0, 0], [0, 0, 0, 0]], ids=["one_empty_slot", "only_padding_slots"])
def test_empty_packings_work(cu, cp):
    """A micro-batch of nothing but padding slots: every rank holds no rows, nothing moves."""
    for rank in range(cp):
        for source, target in DIRECTIONS:
            route = build_thd_route(cu, cp, rank, source, target)
            assert route.is_identity and route.rows_in == route.rows_out == 0
            assert route.send_index is None and route.recv_index is None
        nat = build_natural_order(cu, cp, rank)
        assert [t.numel() for t in (nat.to_natural, nat.to_buffer, nat.own_rows)] == [0, 0, 0]
        cw = build_chunkwise_plan(cu, cp, rank, 4)
        assert cw.t_local == 0 and cw.local_cu == (0, 0) and cw.rest_cu is None and cw.head_cu is None
        assert not (cw.first_continues or cw.last_continues or cw.any_straddle or cw.needs_halo)


def test_natural_order_checks_its_boundaries():
    with pytest.raises(ValueError, match=r"not divisible by 2\*cp=4"):
        build_natural_order([0, 6], 2, 0)


@pytest.mark.parametrize("cp", [2, 4])
def test_chunkwise_plan_scan_boundaries(cp):
    """head_cu / rest_cu cut the slice's local sequences at the first one when it continues."""
    cu = named_packings(cp)["straddling"]
    t_local = cu[-1] // cp
    for rank in range(cp):
        cw = build_chunkwise_plan(cu, cp, rank, 4)
        assert cw.local_cu[0] == 0 and cw.local_cu[-1] == t_local
        if cw.first_continues:
            assert cw.head_cu == (0, cw.split) and cw.split == cw.local_cu[1]
        else:
            assert cw.split == 0 and cw.head_cu is None
        assert (cw.rest_cu is None) == (cw.split == t_local)
        if cw.rest_cu is not None:
            assert list(cw.rest_cu) == [c - cw.split for c in cw.local_cu if c >= cw.split]


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("name", ["straddling", "one_sequence", "uneven", "padding_slots", "tiny_pieces"])
def test_chunkwise_plan_tail_first_cut(cp, name):
    """head | mid | tail tile the slice in row order, every local boundary kept: the tail is the
    last local sequence exactly when it starts on this rank and continues onto the next one."""
    cu = named_packings(cp)[name]
    t_local = cu[-1] // cp
    for rank in range(cp):
        cw = build_chunkwise_plan(cu, cp, rank, 4)
        has_tail = cw.last_continues and not cw.last_is_first
        assert (cw.tail_cu is not None) == has_tail
        assert cw.tail_split == (cw.local_cu[-2] if has_tail else t_local)
        assert cw.split <= cw.tail_split <= t_local
        pieces = [(0, cw.head_cu), (cw.split, cw.mid_cu), (cw.tail_split, cw.tail_cu)]
        joined = sorted({0, t_local} | {start + c for start, part in pieces if part is not None for c in part})
        assert joined == list(cw.local_cu)
        rows = sum(part[-1] for _, part in pieces if part is not None)
        assert rows == t_local
        assert (cw.mid_cu is None) == (cw.tail_split == cw.split)


# -- whole-row splits (Megatron's --dataloader-inter-document-masking) --------------------------

from gdn_cp.layout import PER_DOCUMENT, WHOLE_ROW, CPPlan  # noqa: E402
from gdn_cp_testing.packings import document_packings, zigzag_rows  # noqa: E402


def naive_whole_row_rows(layout, cu, cp):
    """rows[r] for the whole-row cut: the row [0, T) cut as one sequence, whatever cu says."""
    return naive_rows(layout, [0, cu[-1]], cp)


@pytest.mark.parametrize("cp", CPS)
@pytest.mark.parametrize("name", list(document_packings(1)))
def test_whole_row_plan_routes_and_natural_order(cp, name):
    """A whole-row plan moves the rows Megatron's whole-row cut put on each rank (checked against
    a per-token walk and against the testing toolkit's independent zigzag_rows), for documents of
    any length; the chunkwise plan still restarts at every document boundary."""
    cu = document_packings(cp)[name]
    plans = [CPPlan(cu=cu, cp_size=cp, cp_rank=r, split=WHOLE_ROW) for r in range(cp)]
    zig = naive_whole_row_rows(ZIGZAG, cu, cp)
    for r in range(cp):
        assert zigzag_rows(cu, cp, r, whole_row=True).tolist() == zig[r]
    for source, target in DIRECTIONS:
        src_rows = naive_whole_row_rows(source, cu, cp)
        sent = []
        for r, plan in enumerate(plans):
            route = plan.route(source, target)
            x = torch.tensor(src_rows[r], dtype=torch.int64)
            buf = x if route.send_index is None else x[route.send_index]
            sent.append(list(torch.split(buf, list(route.send_splits))))
        for r, plan in enumerate(plans):
            route = plan.route(source, target)
            recv = torch.cat([sent[q][r] for q in range(cp)])
            y = recv if route.recv_index is None else recv[route.recv_index]
            assert y.tolist() == naive_whole_row_rows(target, cu, cp)[r]
    buffer = [g for r in range(cp) for g in zig[r]]
    for r, plan in enumerate(plans):
        nat = plan.natural_order()
        assert [buffer[i] for i in nat.to_natural.tolist()] == list(range(cu[-1]))
        assert nat.own_rows.tolist() == zig[r]
        cw = plan.chunkwise(4)
        lo, hi = r * (cu[-1] // cp), (r + 1) * (cu[-1] // cp)
        inside = sorted({0, hi - lo} | {c - lo for c in cu if lo < c < hi})
        assert sorted(set(cw.local_cu)) == inside


def test_whole_row_differs_from_per_document_when_a_row_holds_documents():
    """The two splits put different rows on a rank as soon as a row holds more than one
    document: a plan of the wrong split would move the wrong rows."""
    cu = [0, 8, 16]
    doc = CPPlan(cu=cu, cp_size=2, cp_rank=0, split=PER_DOCUMENT).natural_order().own_rows.tolist()
    row = CPPlan(cu=cu, cp_size=2, cp_rank=0, split=WHOLE_ROW).natural_order().own_rows.tolist()
    assert doc == [0, 1, 6, 7, 8, 9, 14, 15] and row == [0, 1, 2, 3, 12, 13, 14, 15]


def test_whole_row_checks_only_the_row_length():
    CPPlan(cu=[0, 3, 8], cp_size=2, cp_rank=0, split=WHOLE_ROW)  # odd documents are fine
    with pytest.raises(ValueError, match=r"T_global=10 rows, not divisible by 2\*cp=4"):
        CPPlan(cu=[0, 3, 10], cp_size=2, cp_rank=0, split=WHOLE_ROW)
    with pytest.raises(ValueError, match=r"sequence 0 .* length 3"):
        CPPlan(cu=[0, 3, 8], cp_size=2, cp_rank=0, split=PER_DOCUMENT)
    with pytest.raises(ValueError, match="split must be one of"):
        CPPlan(cu=[0, 8], cp_size=2, cp_rank=0, split="row")


def test_route_cache_keys_the_split():
    from gdn_cp.layout import RouteCache

    cache, cu = RouteCache(), torch.tensor([0, 8, 16])
    a, b = cache.plan(cu, 2, 0, PER_DOCUMENT), cache.plan(cu, 2, 0, WHOLE_ROW)
    assert a is not b and (a.split, b.split) == (PER_DOCUMENT, WHOLE_ROW)
    assert cache.plan(cu, 2, 0, WHOLE_ROW) is b


def test_one_rank_takes_any_lengths():
    """At CP=1 nothing is cut: odd sequence lengths are legal (as in stock megatron-core), the
    routes and the natural order are the identity, the chunkwise plan is the boundaries."""
    cu = [0, 3, 3, 10]
    for split in (PER_DOCUMENT, WHOLE_ROW):
        plan = CPPlan(cu=cu, cp_size=1, cp_rank=0, split=split)
        assert plan.route(ZIGZAG, CONTIGUOUS).is_identity
        nat = plan.natural_order()
        assert nat.to_natural.tolist() == nat.own_rows.tolist() == list(range(10))
        assert list(plan.chunkwise(4).local_cu) == [0, 3, 10]
    with pytest.raises(ValueError, match=r"not divisible by 2\*cp=4"):
        validate_cu_seqlens(cu, 2)
