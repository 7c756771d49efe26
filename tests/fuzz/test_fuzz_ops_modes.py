"""Fuzz ``gdn_cp.ops`` (its public names and the reference backend's kernels) and ``gdn_cp.modes``
(its public entry ``gdn_core`` without a group, the SBHD <-> THD packing, ``GDNShape``; what lies
between ``gdn_core`` and the kernels trusts the checked call context and is not fuzzed).

Each case starts from valid small inputs and changes one argument: another float dtype, an
integer or bool dtype, a missing or extra dim, a dropped row, a meta tensor, a list, None, a
non-contiguous view, a hostile scalar, a log decay that overflows. A change that the contract
forbids must be refused with a message naming the argument; any call that succeeds is compared
with the per-token fp64 oracles of ``gdn_cp/ops/reference/naive.py``. A distributed case (two gloo
ranks of the session's pool, under its timeout) checks that every mode refuses bad input on every
rank before its first collective.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from gdn_cp.layout import Boundaries, RouteCache
from gdn_cp.modes import GDNShape, gdn_core, sbhd_to_thd, thd_to_sbhd
from gdn_cp.modes.spec import MODE_NAMES
from gdn_cp.ops import BACKENDS, get_backend, value_heads_per_key_head
from gdn_cp.ops.gates import check_log_decay
from gdn_cp.ops.reference.naive import naive_causal_conv1d, naive_gated_delta_rule
from gdn_cp.layout.packings import cumsum0

from .common import (
    Refused,
    assert_accepted,
    assert_refused_naming,
    fuzz_settings,
    hostile_scalars,
    is_int,
    outcome,
)

reference = get_backend("reference")

REFUSE, EITHER = "refuse", "either"


# ------------------------------------------------------------------------------------------
# small valid cases and one-argument changes
# ------------------------------------------------------------------------------------------
@st.composite
def shapes(draw):
    hk = draw(st.sampled_from([1, 2]))
    return GDNShape(num_k_heads=hk, num_v_heads=hk * draw(st.sampled_from([1, 2])),
                    head_k_dim=draw(st.sampled_from([2, 4])), head_v_dim=draw(st.sampled_from([2, 3])),
                    qk_l2norm=draw(st.booleans()))


@st.composite
def core_cases(draw):
    """Valid CP=1 core inputs: ``qkv [T, C]``, ``g, beta [T, Hv]``, ``conv_weight [C, W]``, bias."""
    shape = draw(shapes())
    cu = cumsum0(2 * n for n in draw(st.lists(st.integers(0, 3), min_size=1, max_size=3)))  # zigzag at cp=1: even
    t, c, width = cu[-1], shape.conv_dim, draw(st.integers(1, 4))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))

    def randn(*size):
        return torch.randn(*size, generator=gen)

    return dict(
        shape=shape, cu=cu,
        qkv=randn(t, c), g=-F.softplus(randn(t, shape.num_v_heads)) * 0.5,
        beta=torch.sigmoid(randn(t, shape.num_v_heads)), conv_weight=randn(c, width) * 0.5,
        conv_bias=draw(st.sampled_from([None, randn(c) * 0.1])),
    )


STRICT_KINDS = ("int", "bool", "meta", "list", "none", "scalar", "positive", "neg_inf", "nan")


@st.composite
def changed(draw, value, *, optional: bool = False, log_decay: bool = False, free_last_dim: bool = False):
    """``(new value, REFUSE | EITHER, strict)``: one change to a tensor argument (or to None, for an
    optional one), whether the contract forbids it (EITHER: it may be accepted, then the result is
    checked), and whether a refusal must name this very argument (strict) or may name the argument
    it now disagrees with (a shape change: "k must have q's shape"). ``free_last_dim``: any size of
    the last dim is allowed (a conv's W, the value dim Dv)."""
    if value is None:
        kind = draw(st.sampled_from(["same", "scalar", "tensor"]))
        if kind == "same":
            return None, EITHER, True
        if kind == "tensor":
            return torch.zeros(1, 1, 1), REFUSE, False
        scalar = draw(hostile_scalars())
        return scalar, (EITHER if scalar is None else REFUSE), True
    kinds = ["same", "same", "float64", "bfloat16", "int", "bool", "extra_dim", "drop_row", "wider", "meta",
             "list", "none", "scalar", "noncontig"]
    if log_decay:
        kinds += ["positive", "neg_inf", "nan"]
    kind = draw(st.sampled_from(kinds))
    new, expect = _apply(draw, kind, value, free_last_dim, optional)
    return new, expect, kind in STRICT_KINDS


def _apply(draw, kind, value, free_last_dim, optional):
    if kind == "same":
        return value, EITHER
    if kind in ("float64", "bfloat16"):
        return value.to(getattr(torch, kind)), EITHER
    if kind in ("int", "bool"):
        return value.to(torch.int64 if kind == "int" else torch.bool), REFUSE
    if kind == "extra_dim":
        return value.unsqueeze(0), REFUSE
    if kind == "drop_row":
        return value[:-1], (REFUSE if value.shape[0] else EITHER)
    if kind == "wider":
        if not value.shape[-1]:
            return value, EITHER
        grown = torch.cat([value, value[..., :1]], dim=-1)
        return grown, (EITHER if free_last_dim else REFUSE)
    if kind == "meta":
        return value.to("meta"), REFUSE
    if kind == "list":
        return value.tolist(), REFUSE
    if kind == "none":
        return None, (EITHER if optional else REFUSE)
    if kind == "scalar":
        scalar = draw(hostile_scalars())
        return scalar, (EITHER if (optional and scalar is None) else REFUSE)
    if kind == "noncontig":
        return (value.t().contiguous().t() if value.dim() == 2 else value), EITHER
    flat = value.clone().reshape(-1)
    if flat.numel() == 0:
        return value, EITHER
    flat[draw(st.integers(0, flat.numel() - 1))] = {"positive": 1e3, "neg_inf": -float("inf"), "nan": float("nan")}[kind]
    return flat.reshape(value.shape), REFUSE


def check_refusal(result, expect, strict, target, related) -> bool:
    """True when ``result`` was a refusal (then checked to name ``target``, or when not ``strict``
    any of ``related``); False when it was accepted (allowed only when ``expect`` is EITHER)."""
    if expect == REFUSE or isinstance(result, Refused):
        assert_refused_naming(result, *((target,) if strict else (target, *related)))
        return True
    return False


def check_against_oracle(o, args: dict, shape: GDNShape, cu) -> None:
    """``o`` equals conv (SiLU) + gated delta rule computed token by token in fp64."""
    qkv, w, b = args["qkv"], args["conv_weight"], args["conv_bias"]
    x = naive_causal_conv1d(qkv.double(), w.double(), None if b is None else b.double(), cu_seqlens=cu)
    kd = shape.key_dim
    t = qkv.shape[0]
    q = x[:, :kd].reshape(t, shape.num_k_heads, shape.head_k_dim)
    k = x[:, kd:2 * kd].reshape(t, shape.num_k_heads, shape.head_k_dim)
    v = x[:, 2 * kd:].reshape(t, shape.num_v_heads, shape.head_v_dim)
    want, _ = naive_gated_delta_rule(q, k, v, args["g"].double(), args["beta"].double(), cu_seqlens=cu,
                                     use_qk_l2norm=shape.qk_l2norm)
    assert o.shape == (t, shape.num_v_heads, shape.head_v_dim)
    low = any(a is not None and a.dtype in (torch.bfloat16, torch.float16) for a in args.values()
              if isinstance(a, torch.Tensor))
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    err = (o.double() - want).abs().max().item() if want.numel() else 0.0
    assert err <= (5e-2 if low else 1e-4) * scale, err


CORE_TENSORS = ("qkv", "g", "beta", "conv_weight", "conv_bias")


# ------------------------------------------------------------------------------------------
# modes: gdn_core (no group)
# ------------------------------------------------------------------------------------------
HOSTILE_KWARGS = {  # (value, REFUSE | EITHER)
    "shape": lambda case: [(None, REFUSE), ((1, 1, 2, 2), REFUSE), ("shape", REFUSE),
                           (GDNShape(3, 3, 2, 2), REFUSE), (case["shape"], EITHER)],
    "mode": lambda case: [("ring", REFUSE), (None, REFUSE), ("auto", REFUSE), (3, REFUSE), (["chunkwise"], REFUSE),
                          ("headwise", EITHER), ("all_gather", EITHER)],
    "plan": lambda case: [(None, REFUSE), (case["cu"], REFUSE), (Boundaries(case["cu"]), REFUSE),
                          (RouteCache().plan([0, 0], 1, 0), REFUSE if case["cu"][-1] else EITHER), ("plan", REFUSE)],
    "backend": lambda case: [("reference", REFUSE), (None, REFUSE), (object(), REFUSE), (BACKENDS, REFUSE)],
    "chunkwise_path": lambda case: [("diagonal", REFUSE), (0, REFUSE), (np.array(["generic"]), REFUSE),
                                    (None, EITHER), ("generic", EITHER), ("native", EITHER)],  # no CP: no exchange
    "group": lambda case: [("WORLD", REFUSE), (1, REFUSE), (object(), REFUSE)],
    "cu_seqlens": lambda case: [(case["cu"][:-1] + [case["cu"][-1] + 1], REFUSE), ([1] + case["cu"][1:], REFUSE),
                                ("0,4", REFUSE), (torch.tensor(case["cu"]), REFUSE), (None, REFUSE),
                                ([0.0] + case["cu"][1:], REFUSE), (tuple(case["cu"]), EITHER)],
}
NAMES = {"mode": "linear_cp_mode"}  # the argument -> what its messages call it


@fuzz_settings(150)
@given(data=st.data())
def test_gdn_core_without_group(data):
    case = data.draw(core_cases())
    shape, cu = case["shape"], case["cu"]
    plan = RouteCache().plan(cu, 1, 0)
    args = {n: case[n] for n in CORE_TENSORS}
    kw = dict(shape=shape, mode="chunkwise", plan=plan, group=None, backend=reference, chunkwise_path="auto")
    target = data.draw(st.sampled_from(CORE_TENSORS + ("shape", "mode", "plan", "backend", "chunkwise_path", "group")))
    strict = True
    if target in CORE_TENSORS:
        args[target], expect, strict = data.draw(changed(args[target], optional=target == "conv_bias",
                                                         log_decay=target == "g", free_last_dim=target == "conv_weight"))
        if target == "g" and isinstance(args["g"], torch.Tensor) and args["g"].dtype not in (torch.float32, torch.float64):
            expect = REFUSE  # the documented gate dtypes: fp32 or fp64
    else:
        kw[target], expect = data.draw(st.sampled_from(HOSTILE_KWARGS[target](case)))
    result = outcome(lambda: gdn_core(*[args[n] for n in CORE_TENSORS], **kw))
    if not check_refusal(result, expect, strict, NAMES.get(target, target), CORE_TENSORS + ("plan",)):
        check_against_oracle(result, args, shape, cu)


# ------------------------------------------------------------------------------------------
# the reference kernels
# ------------------------------------------------------------------------------------------
@fuzz_settings(120)
@given(data=st.data())
def test_reference_causal_conv1d(data):
    case = data.draw(core_cases())
    cu = case["cu"]
    width = case["conv_weight"].shape[1]
    args = dict(x=case["qkv"], weight=case["conv_weight"], bias=case["conv_bias"],
                halo=data.draw(st.sampled_from([None, torch.randn(width - 1, case["qkv"].shape[1])])))
    kw = dict(cu_seqlens=cu, activation="silu")
    target = data.draw(st.sampled_from(["x", "weight", "bias", "halo", "activation", "cu_seqlens"]))
    strict = True
    if target in args:
        args[target], expect, strict = data.draw(changed(args[target], optional=target in ("bias", "halo"),
                                                         free_last_dim=target == "weight" and args["halo"] is None))
    elif target == "activation":
        kw["activation"] = data.draw(st.sampled_from(["silu", None, "relu", "SiLU", True, 1]))
        expect = EITHER if kw["activation"] in ("silu", None) and not isinstance(kw["activation"], (bool, int)) \
            else REFUSE
    else:
        kw["cu_seqlens"], expect = data.draw(st.sampled_from(HOSTILE_KWARGS["cu_seqlens"](case)))
    result = outcome(lambda: reference.causal_conv1d(args["x"], args["weight"], args["bias"], halo=args["halo"], **kw))
    if check_refusal(result, expect, strict, target, ("x", "weight", "bias", "halo", "cu_seqlens")):
        return
    x, w, b, halo = args["x"], args["weight"], args["bias"], args["halo"]
    want = naive_causal_conv1d(x.double(), w.double(), None if b is None else b.double(), cu_seqlens=list(kw["cu_seqlens"]),
                               halo=None if halo is None else halo.double(), activation=kw["activation"])
    low = any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args.values())
    assert result.shape == x.shape and result.dtype == x.dtype
    err = (result.double() - want).abs().max().item() if want.numel() else 0.0
    assert err <= (5e-2 if low else 1e-5) * max(1.0, want.abs().max().item() if want.numel() else 1.0)


@fuzz_settings(120)
@given(data=st.data())
def test_reference_chunk_gated_delta_rule(data):
    case = data.draw(core_cases())
    shape, cu = case["shape"], case["cu"]
    t, hk, hv, dk, dv = case["qkv"].shape[0], shape.num_k_heads, shape.num_v_heads, shape.head_k_dim, shape.head_v_dim
    gen = torch.Generator().manual_seed(7)
    args = dict(q=torch.randn(t, hk, dk, generator=gen), k=torch.randn(t, hk, dk, generator=gen),
                v=torch.randn(t, hv, dv, generator=gen), g=case["g"], beta=case["beta"],
                initial_state=data.draw(st.sampled_from([None, torch.randn(len(cu) - 1, hv, dk, dv, generator=gen)])))
    kw = dict(cu_seqlens=cu, scale=None, output_final_state=False, use_qk_l2norm=shape.qk_l2norm, chunk_size=4)
    target = data.draw(st.sampled_from(list(args) + list(kw)))
    strict = True
    if target in args:
        free = target == "v" and args["initial_state"] is None  # Dv is free unless a state fixes it
        args[target], expect, strict = data.draw(changed(args[target], optional=target == "initial_state",
                                                         log_decay=target == "g", free_last_dim=free))
    else:
        kw[target] = data.draw(st.one_of(hostile_scalars(), st.sampled_from(KWARG_VALUES[target])))
        expect = EITHER if _valid_kwarg(target, kw[target], cu) else REFUSE
    result = outcome(lambda: reference.chunk_gated_delta_rule(*[args[n] for n in ("q", "k", "v", "g", "beta")],
                                                               initial_state=args["initial_state"], **kw))
    if check_refusal(result, expect, strict, target, tuple(args) + ("cu_seqlens", "num_v_heads", "num_k_heads")):
        return
    o, final = result
    want, want_final = naive_gated_delta_rule(
        *[args[n] for n in ("q", "k", "v", "g", "beta")], initial_state=args["initial_state"],
        cu_seqlens=list(kw["cu_seqlens"]), scale=None if kw["scale"] is None else float(kw["scale"]),
        output_final_state=kw["output_final_state"],
        use_qk_l2norm=kw["use_qk_l2norm"])
    low = any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args.values())
    tol = 5e-2 if low else 1e-4
    for got, ref in ((o, want), (final, want_final)):
        if ref is None:
            assert got is None
            continue
        assert got.shape == ref.shape
        if ref.numel() and ref.double().abs().max().item() < 1e30:  # beyond, fp32 math may overflow (a huge scale)
            assert (got.double() - ref.double()).abs().max().item() <= tol * max(1.0, ref.double().abs().max().item())


KWARG_VALUES = {
    "cu_seqlens": [[0], [1, 2], [0, 10**6]],
    "scale": [0.5, 1, -2.0, float("nan"), float("inf"), 10**400],
    "output_final_state": [True, False, 1, "yes"],
    "use_qk_l2norm": [True, False, 0, "no"],
    "chunk_size": [1, 3, 64, 1024, 1025, 0, 2**40],
}


def _valid_kwarg(name, value, cu) -> bool:
    if name == "cu_seqlens":
        return isinstance(value, list) and value == cu
    if name == "scale":
        return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)
                                 and abs(value) < 1e308 and value == value)
    if name in ("output_final_state", "use_qk_l2norm"):
        return isinstance(value, bool)
    return is_int(value) and 1 <= value <= 1024


# ------------------------------------------------------------------------------------------
# small public functions
# ------------------------------------------------------------------------------------------
@fuzz_settings(100)
@given(hk=st.one_of(st.integers(-2, 8), hostile_scalars()), hv=st.one_of(st.integers(-2, 16), hostile_scalars()),
       dk=st.one_of(st.integers(0, 8), hostile_scalars()), dv=st.one_of(st.integers(0, 8), hostile_scalars()),
       l2=st.one_of(st.booleans(), hostile_scalars()))
def test_gdn_shape_and_head_ratio(hk, hv, dk, dv, l2):
    ints = all(is_int(x) and x >= 1 for x in (hk, hv, dk, dv))
    k, v, a, b = (int(x) if is_int(x) else x for x in (hk, hv, dk, dv))  # this check's math on Python ints
    valid = ints and v % k == 0 and isinstance(l2, bool)
    result = outcome(lambda: GDNShape(hk, hv, dk, dv, qk_l2norm=l2))
    if valid:
        s = assert_accepted(result)
        assert s.conv_dim == 2 * k * a + v * b and s.qk_l2norm is l2
    else:
        assert_refused_naming(result, "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "qk_l2norm")
    result = outcome(lambda: value_heads_per_key_head(hk, hv))
    if is_int(hk) and is_int(hv) and k >= 1 and v >= 1 and v % k == 0:
        assert result == v // k
    else:
        assert_refused_naming(result, "num_k_heads", "num_v_heads")


@fuzz_settings(60)
@given(name=st.one_of(st.sampled_from(["reference", "fla"]), hostile_scalars(), st.just(["reference"])))
def test_get_backend(name):
    result = outcome(lambda: get_backend(name))
    if name == "reference":
        assert result is reference
    elif name == "fla" and isinstance(name, str):
        assert not isinstance(result, Refused)  # importing the module never imports FLA itself
    else:
        assert_refused_naming(result, "backend")


@fuzz_settings(80)
@given(data=st.data())
def test_check_log_decay(data):
    g = -torch.rand(data.draw(st.integers(0, 6)), 3, dtype=torch.float64)
    g, _, _ = data.draw(changed(g, log_decay=True))
    result = outcome(lambda: check_log_decay(g))
    ok = isinstance(g, torch.Tensor) and g.is_floating_point() and not g.is_meta and bool(
        ((g <= 0) & (g > -float("inf"))).all())
    if ok:
        assert result is None
    else:
        assert_refused_naming(result, "g")


@fuzz_settings(80)
@given(s=st.integers(0, 4), b=st.integers(1, 3), f=st.integers(0, 2), batch=st.one_of(st.integers(-1, 6), hostile_scalars()),
       kind=st.sampled_from(["tensor", "tensor", "1d", "list", "none"]))
def test_sbhd_thd_packing(s, b, f, batch, kind):
    x = torch.arange(s * b * 2 * max(f, 1), dtype=torch.float32).reshape(s, b, *([2] * f)) if f else \
        torch.arange(s * b, dtype=torch.float32).reshape(s, b)
    arg = {"tensor": x, "1d": x.reshape(-1), "list": x.tolist(), "none": None}[kind]
    result = outcome(lambda: sbhd_to_thd(arg))
    if kind != "tensor":
        assert_refused_naming(result, "x")
    else:
        y = assert_accepted(result)
        assert all(torch.equal(y[bi * s + si], x[si, bi]) for si in range(s) for bi in range(b))
        back = outcome(lambda: thd_to_sbhd(y, batch))
        if is_int(batch) and 1 <= batch <= 2**20 and (s * b) % batch == 0:
            z = assert_accepted(back)
            assert z.shape[:2] == (s * b // batch, batch) and (batch != b or torch.equal(z, x))
        else:
            assert_refused_naming(back, "batch")


# ------------------------------------------------------------------------------------------
# distributed: refused on every rank before the first collective
# ------------------------------------------------------------------------------------------
SHAPE = GDNShape(num_k_heads=2, num_v_heads=4, head_k_dim=4, head_v_dim=4)


def _bad_input_cases(ctx, cases):
    """Every case on every rank, all modes: the error, and how many collectives ran before it."""
    import torch.distributed as dist

    world = ctx.world_size
    cu = [0, 4 * world, 4 * world, 12 * world]
    plan = RouteCache().plan(cu, world, ctx.rank)
    t = plan.t_local
    good = dict(qkv=torch.randn(t, SHAPE.conv_dim), g=-torch.rand(t, 4), beta=torch.rand(t, 4),
                conv_weight=torch.randn(SHAPE.conv_dim, 4), conv_bias=None)
    out = []
    for target, change in cases:
        args = dict(good)
        kw = dict(shape=SHAPE, plan=plan, group=dist.group.WORLD, backend=reference)
        if target in args:
            args[target] = {"meta": lambda v: v.to("meta"), "int": lambda v: v.long(), "drop": lambda v: v[:-1],
                            "list": lambda v: v.tolist(), "positive": lambda v: v.abs() + 1e3,
                            "wrong_world_plan": lambda v: v}[change](args[target])
        if change == "wrong_world_plan":
            kw["plan"] = RouteCache().plan([0, 8], 1, 0)
        for mode in MODE_NAMES:
            before = ctx.collective_count()
            try:
                gdn_core(*[args[n] for n in CORE_TENSORS], mode=mode, **kw)
                out.append((target, change, mode, None, ctx.collective_count() - before))
            except (ValueError, TypeError) as err:
                out.append((target, change, mode, str(err), ctx.collective_count() - before))
    return out


@fuzz_settings(3)
@given(cases=st.lists(st.tuples(st.sampled_from(["qkv", "g", "beta", "conv_weight"]),
                                st.sampled_from(["meta", "int", "drop", "list", "positive", "wrong_world_plan"])),
                      min_size=4, max_size=8))
def test_every_rank_refuses_before_any_collective(rank_pool, cases):
    """Every mode, on both ranks of a gloo pool (a hang would end at the pool's timeout), refuses
    each bad input by name before any data collective: zero collectives, except for a log decay that
    is not <= 0, where the ranks first agree on it (README: one int all-reduce), so that a rank with
    good values stops too instead of waiting."""
    results = rank_pool(2).run(_bad_input_cases, cases, timeout_s=120)
    for rank_results in results:
        assert len(rank_results) == len(cases) * len(MODE_NAMES)
        for target, change, mode, error, collectives in rank_results:
            if change == "positive" and target != "g":
                continue  # any value of qkv / beta / conv_weight is allowed
            assert error is not None, (target, change, mode)
            agreed = 1 if (target, change) == ("g", "positive") else 0  # the ranks' one int all-reduce on g
            assert collectives == agreed, (target, change, mode, collectives)
            assert (target if change != "wrong_world_plan" else "plan") in error, (target, change, mode, error)
