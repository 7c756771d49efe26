"""Fuzz ``gdn_cp.layout.__all__``: hostile boundaries, sizes, ranks and layouts.

Each test draws arguments that are valid, nearly valid (one boundary off, a sequence length not a
multiple of 2*cp, a rank out of range) or hostile (wrong types, signs, sizes, devices), decides from
the documented rules alone whether the call must succeed, and then checks the call: refused with a
ValueError / TypeError naming the argument, or accepted with a result checked independently
(routes by a simulated all-to-all of every rank on global row ids, against Megatron's zigzag split
written out per token in :func:`gdn_cp_testing.packings.zigzag_rows`).

The functions whose output is O(tokens) (index tensors) are fuzzed with bounded valid sizes: a
valid request for 2**62 rows is refused by the allocator, not by gdn-cp.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from gdn_cp.layout import (
    CONTIGUOUS,
    LAYOUTS,
    ZIGZAG,
    Boundaries,
    CPPlan,
    RouteCache,
    build_chunkwise_plan,
    build_natural_order,
    build_sbhd_route,
    build_thd_route,
    check_cp,
    expand_spans,
    host_boundaries,
    plan_for_sbhd,
    sbhd_cu_seqlens,
    validate_cu_seqlens,
)
from gdn_cp.layout.packings import cumsum0
from gdn_cp_testing.packings import zigzag_rows

from .common import (
    HUGE_INTS,
    MAX_ROWS,
    assert_accepted,
    assert_refused_naming,
    boundaries_rule,
    boundaries_values,
    cp_rule,
    fuzz_settings,
    hostile_scalars,
    is_index_int,
    is_int,
    outcome,
    rank_rule,
    zigzag_rule,
)

# ------------------------------------------------------------------------------------------
# strategies
# ------------------------------------------------------------------------------------------
small_cp = st.integers(1, 6)


@st.composite
def packings(draw, cp=None, max_units: int = 5):
    """Boundaries of a zigzag split over ``cp`` ranks (lengths multiples of 2*cp, empty slots)."""
    cp = draw(small_cp) if cp is None else cp
    units = draw(st.lists(st.integers(0, max_units), min_size=1, max_size=5))
    return cumsum0(u * 2 * cp for u in units)


@st.composite
def nearly(draw, cu):
    """``cu`` as it is, or with one defect: a boundary moved by one, a step down, a nonzero start,
    a huge end, an entry dropped, or one entry of the wrong type."""
    cu = list(cu)
    kind = draw(st.sampled_from(["same", "same", "off_by_one", "fall", "start", "huge", "short", "type"]))
    i = draw(st.integers(0, len(cu) - 1))
    if kind == "off_by_one" and i > 0:
        cu[i] += draw(st.sampled_from([-1, 1]))
    elif kind == "fall" and len(cu) > 2:
        cu[1], cu[-1] = cu[-1] + 1, cu[1]
    elif kind == "start":
        cu[0] = draw(st.sampled_from([1, -1, 2**62 + 1]))
    elif kind == "huge":
        cu.append(draw(st.sampled_from(HUGE_INTS)))
    elif kind == "short":
        cu = cu[:1]
    elif kind == "type":
        cu[i] = draw(st.sampled_from([True, 2.0, "4", None, np.float64(4.0), np.int32(cu[i])]))
    return cu


def as_container(cu, how: str):
    """The same values as a list, tuple, numpy array or CPU tensor (tensors only for int lists)."""
    if how == "tuple":
        return tuple(cu)
    if how in ("numpy", "tensor", "tensor_int32", "meta") and all(is_int(v) and abs(v) < 2**63 for v in cu):
        if how == "numpy":
            return np.array(cu, dtype=np.int64)
        dtype = torch.int32 if how == "tensor_int32" and all(abs(v) < 2**31 for v in cu) else torch.int64
        return torch.tensor(cu, dtype=dtype, device="meta" if how == "meta" else "cpu")
    return list(cu)


containers = st.sampled_from(["list", "list", "tuple", "numpy", "tensor", "tensor_int32", "meta"])


@st.composite
def boundaries_arg(draw, cp):
    """A boundaries argument for ``cp`` ranks: usually a (nearly) valid packing in some container,
    sometimes anything at all."""
    if draw(st.integers(0, 5)) == 0:
        return draw(hostile_scalars())
    base = draw(packings(cp if cp_rule(cp) and cp <= 6 else None))
    return as_container(draw(nearly(base)), draw(containers))


def size_arg(valid: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(valid, valid, valid, hostile_scalars())


def tensor_values(arg, allow_tensor: bool):
    """The ints a boundaries argument holds, per the documented rules, or None when its kind is refused."""
    if isinstance(arg, torch.Tensor):
        ok = allow_tensor and arg.dim() == 1 and not arg.is_meta and arg.dtype in (
            torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
        return arg.tolist() if ok else None
    return boundaries_values(arg)


# ------------------------------------------------------------------------------------------
# independent checks of results
# ------------------------------------------------------------------------------------------
SMALL_T = 4096  # per-token checks (and the O(T) index tensors) only up to this many rows


def _slice_rows(cu, cp, rank):
    t_local = cu[-1] // cp
    return list(range(rank * t_local, (rank + 1) * t_local))


def check_route_by_simulation(cu, cp, rank, source, target, build) -> None:
    """Every rank's route (``build(r)``) run on global row ids with a Python all-to-all: rank
    ``rank`` ends up with exactly its rows of ``target``, in order."""
    rows_of = {ZIGZAG: lambda r: zigzag_rows(cu, cp, r).tolist(), CONTIGUOUS: lambda r: _slice_rows(cu, cp, r)}
    routes = [build(r) for r in range(cp)]
    sent = []
    for r, route in enumerate(routes):
        x = torch.tensor(rows_of[source](r), dtype=torch.int64)
        assert route.rows_in == len(x)
        buf = x if route.send_index is None else x[route.send_index]
        sent.append(list(torch.split(buf, list(route.send_splits))))
    recv = torch.cat([sent[p][rank] for p in range(cp)])
    assert [len(sent[p][rank]) for p in range(cp)] == list(routes[rank].recv_splits)
    y = recv if routes[rank].recv_index is None else recv[routes[rank].recv_index]
    assert y.tolist() == rows_of[target](rank)


def check_natural_order(cu, cp, rank, order) -> None:
    buffer = torch.cat([zigzag_rows(cu, cp, r) for r in range(cp)])  # the rank-major buffer
    assert buffer[order.to_natural].tolist() == list(range(cu[-1]))
    assert order.to_buffer.tolist() == buffer.tolist()
    assert order.own_rows.tolist() == zigzag_rows(cu, cp, rank).tolist()


def check_chunkwise_plan(cu, cp, rank, width, plan) -> None:
    """The slice's local boundaries, continuations, halo rows and state sources, per token."""
    t_local = cu[-1] // cp
    lo, hi = rank * t_local, (rank + 1) * t_local
    seq_of = {}  # global row -> (start, end) of its sequence
    for a, b in zip(cu, cu[1:]):
        for g in range(a, b):
            seq_of[g] = (a, b)
    inner = sorted({c - lo for c in cu if lo < c < hi})
    assert list(plan.local_cu) == ([0] + inner + [t_local] if t_local else [0, 0])
    assert plan.first_continues == (t_local > 0 and seq_of[lo][0] < lo)
    assert plan.last_continues == (t_local > 0 and seq_of[hi - 1][1] > hi)
    assert len(plan.halo_index) == width - 1
    for i, h in enumerate(plan.halo_index):
        g = lo - (width - 1) + i
        wanted = plan.first_continues and g >= seq_of[lo][0]
        if not wanted:
            assert h == -1, (i, h)
            continue
        q, j = divmod(h, width - 1)  # rank q's tail: its last W-1 rows, zero-padded in front
        assert (q + 1) * t_local - (width - 1) + j == g and q * t_local <= g < (q + 1) * t_local
    start = seq_of[lo][0] if plan.first_continues else lo
    assert list(plan.compose_ranks) == (list(range(start // t_local, rank)) if plan.first_continues else [])


# ------------------------------------------------------------------------------------------
# boundaries
# ------------------------------------------------------------------------------------------
@fuzz_settings(120)
@given(data=st.data())
def test_boundaries_and_host_boundaries(data):
    arg = data.draw(boundaries_arg(data.draw(small_cp)))
    total = data.draw(st.one_of(st.none(), st.integers(0, 80), hostile_scalars()))
    ints = tensor_values(arg, allow_tensor=False)
    valid = ints is not None and boundaries_rule(ints)

    result = outcome(lambda: Boundaries(arg))
    if valid:
        assert tuple(assert_accepted(result)) == tuple(ints) and all(type(c) is int for c in result)
    else:
        assert_refused_naming(result, "cu_seqlens")

    result = outcome(lambda: host_boundaries(arg, total))
    if not valid:
        assert_refused_naming(result, "cu_seqlens")
    elif total is not None and not is_int(total):
        assert_refused_naming(result, "total")
    elif total is None or total == ints[-1]:
        assert tuple(assert_accepted(result)) == tuple(ints)
    else:
        assert_refused_naming(result, "cu_seqlens")


@fuzz_settings(150)
@given(data=st.data())
def test_validate_cu_seqlens_and_check_cp(data):
    cp = data.draw(size_arg(small_cp))
    rank = data.draw(size_arg(st.integers(-1, 7)))
    arg = data.draw(boundaries_arg(cp))
    ints = tensor_values(arg, allow_tensor=True)

    result = outcome(lambda: check_cp(cp, rank))
    if not cp_rule(cp):
        assert_refused_naming(result, "cp_size")
    elif not rank_rule(cp, rank):
        assert_refused_naming(result, "cp_rank")
    else:
        assert result is None
    result = outcome(lambda: check_cp(cp))  # no rank given: only the size is checked
    if cp_rule(cp):
        assert result is None
    else:
        assert_refused_naming(result, "cp_size")

    result = outcome(lambda: validate_cu_seqlens(arg, cp))
    if not cp_rule(cp):
        assert_refused_naming(result, "cp_size")
    elif ints is None or not zigzag_rule(ints, cp):
        assert_refused_naming(result, "cu_seqlens")
    else:
        assert tuple(assert_accepted(result)) == tuple(ints) and isinstance(result, Boundaries)


def test_huge_cp_sizes_are_refused_not_planned():
    """A CP size beyond any group (and beyond int64) is a named error, not an O(cp) loop."""
    for cp in (2**16 + 1, 2**40, 2**64):
        for call in (lambda: check_cp(cp), lambda: validate_cu_seqlens([0, 0], cp),
                     lambda: build_chunkwise_plan([0, 0], cp, 0, 4), lambda: build_thd_route([0, 0], cp, 0, ZIGZAG, CONTIGUOUS)):
            assert_refused_naming(outcome(call), "cp_size")
    assert len(build_thd_route([0, 0], 2**16, 5, ZIGZAG, CONTIGUOUS).send_splits) == 2**16


@fuzz_settings(80)
@given(seq_len=size_arg(st.integers(0, 40)), batch=size_arg(st.integers(1, 6)))
def test_sbhd_cu_seqlens(seq_len, batch):
    valid = is_int(seq_len) and is_int(batch) and 0 <= seq_len and 1 <= batch <= 2**20 and \
        int(seq_len) * int(batch) <= MAX_ROWS  # on Python ints: NumPy's would wrap
    result = outcome(lambda: sbhd_cu_seqlens(seq_len, batch))
    if valid:
        assert tuple(assert_accepted(result)) == tuple(b * seq_len for b in range(batch + 1))
    else:
        assert_refused_naming(result, "seq_len", "batch")


# ------------------------------------------------------------------------------------------
# spans
# ------------------------------------------------------------------------------------------
@st.composite
def span_arg(draw, n):
    kind = draw(st.sampled_from(["list", "list", "numpy", "tensor", "hostile", "bad_value", "2d", "float_tensor"]))
    values = draw(st.lists(st.integers(0, 30), min_size=n, max_size=n))
    if kind == "numpy":
        return np.array(values, dtype=draw(st.sampled_from([np.int64, np.int32, np.uint8])))
    if kind == "tensor":
        return torch.tensor(values, dtype=torch.int64)
    if kind == "hostile":
        return draw(hostile_scalars())
    if kind == "bad_value" and values:
        values[draw(st.integers(0, n - 1))] = draw(st.sampled_from([-1, 2.5, True, None, 2**62 + 1, 2**64, "3"]))
    if kind == "2d":
        return np.zeros((2, n), dtype=np.int64)
    if kind == "float_tensor":
        return torch.tensor(values, dtype=torch.float32)
    return values


def span_values(arg):
    if isinstance(arg, torch.Tensor):
        return arg.tolist() if arg.dim() == 1 and not arg.is_floating_point() and arg.dtype != torch.bool else None
    if isinstance(arg, np.ndarray):
        return [int(v) for v in arg] if arg.ndim == 1 and arg.dtype.kind in "iu" else None
    if isinstance(arg, (list, tuple)) and all(is_index_int(v) for v in arg):
        return [int(v) for v in arg]
    return None


@fuzz_settings(120)
@given(data=st.data())
def test_expand_spans(data):
    n = data.draw(st.integers(0, 5))
    start = data.draw(span_arg(n))
    length = data.draw(span_arg(data.draw(st.sampled_from([n, n, n, n + 1]))))
    s, ln = span_values(start), span_values(length)
    result = outcome(lambda: expand_spans(start, length))
    if s is None or any(not 0 <= v <= MAX_ROWS for v in s):
        assert_refused_naming(result, "start")
    elif ln is None or any(not 0 <= v <= MAX_ROWS for v in ln):
        assert_refused_naming(result, "length")
    elif len(s) != len(ln) or any(a + b > MAX_ROWS for a, b in zip(s, ln)):
        assert_refused_naming(result, "start", "length")
    else:
        want = [g for a, b in zip(s, ln) for g in range(a, a + b)]
        assert_accepted(result)
        assert result.dtype == torch.int64 and result.tolist() == want


# ------------------------------------------------------------------------------------------
# routes, natural order, chunkwise plan, plans
# ------------------------------------------------------------------------------------------
layouts = st.one_of(st.sampled_from(LAYOUTS), st.sampled_from(LAYOUTS), hostile_scalars(),
                    st.just(np.array(["zigzag"])))


def _first_error(cp, rank, ints, extra=()):
    """The argument the documented rules blame first (None: the call must succeed)."""
    for name, ok in extra:
        if not ok:
            return name
    if not cp_rule(cp):
        return "cp_size"
    if not rank_rule(cp, rank):
        return "cp_rank"
    if ints is None or not zigzag_rule(ints, cp):
        return "cu_seqlens"
    return None


@fuzz_settings(150)
@given(data=st.data())
def test_build_thd_route(data):
    cp = data.draw(size_arg(small_cp))
    rank = data.draw(size_arg(st.integers(0, 5)))
    arg = data.draw(boundaries_arg(cp))
    source, target = data.draw(layouts), data.draw(layouts)
    ints = tensor_values(arg, allow_tensor=True)
    layout_ok = [(n, isinstance(v, str) and v in LAYOUTS) for n, v in (("source", source), ("target", target))]
    blame = _first_error(cp, rank, ints, layout_ok)
    result = outcome(lambda: build_thd_route(arg, cp, rank, source, target))
    if blame is not None:
        assert_refused_naming(result, blame)
        return
    route = assert_accepted(result)
    assert sum(route.send_splits) == sum(route.recv_splits) == ints[-1] // cp  # O(1): any size
    if ints[-1] <= SMALL_T:  # the route's index tensors and the per-token check are O(T)
        check_route_by_simulation(ints, cp, rank, source, target,
                                  lambda r: build_thd_route(ints, cp, r, source, target))


def _sbhd_blame(seq_len, batch, cp, rank):
    """The argument the documented rules blame first for SBHD sizes (None: valid)."""
    if not cp_rule(cp):
        return "cp_size"
    if not rank_rule(cp, rank):
        return "cp_rank"
    if not (is_int(seq_len) and is_int(batch)):
        return "seq_len" if not is_int(seq_len) else "batch"
    seq_len, batch, cp = int(seq_len), int(batch), int(cp)  # this check's math on Python ints (no int32 overflow)
    if not (seq_len >= 0 and 1 <= batch <= 2**20 and seq_len * batch <= MAX_ROWS):
        return "seq_len" if not 0 <= seq_len <= MAX_ROWS else "batch"
    if cp > 1 and seq_len % (2 * cp):  # at cp=1 nothing is cut: any length
        return "seq_len"  # "SBHD sequence length seq_len=... is not divisible by 2*cp=..."
    return None


@fuzz_settings(80)
@given(data=st.data())
def test_build_sbhd_route_and_plan_for_sbhd(data):
    cp = data.draw(size_arg(small_cp))
    rank = data.draw(size_arg(st.integers(0, 5)))
    unit = 2 * cp if cp_rule(cp) and cp <= 6 else 2
    seq_len = data.draw(size_arg(st.integers(0, 4).map(lambda u: u * unit) | st.integers(0, 30)))
    batch = data.draw(size_arg(st.integers(1, 3)))
    source, target = data.draw(layouts), data.draw(layouts)
    blame = _sbhd_blame(seq_len, batch, cp, rank)

    result = outcome(lambda: plan_for_sbhd(seq_len, batch, cp, rank))
    if blame is not None:
        assert_refused_naming(result, blame)
    else:
        assert assert_accepted(result).cu == tuple(b * seq_len for b in range(batch + 1))

    for name, value in (("source", source), ("target", target)):
        if blame is None and not (isinstance(value, str) and value in LAYOUTS):
            blame = name
    result = outcome(lambda: build_sbhd_route(seq_len, batch, cp, rank, source, target))
    if blame is not None:
        assert_refused_naming(result, blame)
        return
    assert_accepted(result)
    cu = [b * seq_len for b in range(batch + 1)]
    if cu[-1] <= SMALL_T:
        check_route_by_simulation(cu, cp, rank, source, target,
                                  lambda r: build_sbhd_route(seq_len, batch, cp, r, source, target))


@fuzz_settings(100)
@given(data=st.data())
def test_build_natural_order(data):
    cp = data.draw(size_arg(small_cp))
    rank = data.draw(size_arg(st.integers(0, 5)))
    arg = data.draw(boundaries_arg(cp))
    ints = tensor_values(arg, allow_tensor=True)
    blame = _first_error(cp, rank, ints)
    if blame is None and ints[-1] > SMALL_T:
        return  # valid, and O(T) by design: 2**31 rows would allocate 2**31-row index tensors
    result = outcome(lambda: build_natural_order(arg, cp, rank))
    if blame is not None:
        assert_refused_naming(result, blame)
    else:
        check_natural_order(ints, cp, rank, assert_accepted(result))


@fuzz_settings(120)
@given(data=st.data())
def test_build_chunkwise_plan(data):
    cp = data.draw(size_arg(small_cp))
    rank = data.draw(size_arg(st.integers(0, 5)))
    width = data.draw(size_arg(st.integers(1, 9)))
    arg = data.draw(boundaries_arg(cp))
    ints = tensor_values(arg, allow_tensor=True)
    blame = _first_error(cp, rank, ints)
    if blame in (None, "cu_seqlens") and not (is_int(width) and 1 <= width <= 2**16):
        blame = "conv_width"
    result = outcome(lambda: build_chunkwise_plan(arg, cp, rank, width))
    if blame is not None:
        assert_refused_naming(result, blame)
    else:
        plan = assert_accepted(result)
        assert plan.t_local == ints[-1] // cp and plan.local_cu[-1] == plan.t_local
        if ints[-1] <= SMALL_T:
            check_chunkwise_plan(ints, cp, rank, width, plan)


@fuzz_settings(100)
@given(data=st.data())
def test_cp_plan_and_route_cache(data):
    cp = data.draw(size_arg(small_cp))
    rank = data.draw(size_arg(st.integers(0, 5)))
    arg = data.draw(boundaries_arg(cp))
    ints = tensor_values(arg, allow_tensor=True)
    blame = _first_error(cp, rank, ints)
    cache = RouteCache()
    for make in (lambda: CPPlan(cu=arg, cp_size=cp, cp_rank=rank), lambda: cache.plan(arg, cp, rank)):
        result = outcome(make)
        if blame is not None:
            assert_refused_naming(result, blame)
            continue
        plan = assert_accepted(result)
        assert plan.cu == tuple(ints) and plan.t_local == ints[-1] // cp
        if ints[-1] <= SMALL_T:
            check_route_by_simulation(ints, cp, rank, ZIGZAG, CONTIGUOUS,
                                      lambda r: CPPlan(cu=ints, cp_size=cp, cp_rank=r).route(ZIGZAG, CONTIGUOUS))
    if blame is None and not isinstance(arg, torch.Tensor):
        assert cache.plan(arg, cp, rank) is cache.plan(arg, cp, rank)
