"""gdn_cp.ops.reference.chunk_gated_delta_rule against the token-by-token recurrence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from gdn_cp.ops.reference.gated_delta_rule import chunk_gated_delta_rule, l2norm
from gdn_cp.ops.reference.naive import naive_gated_delta_rule
from gdn_cp.ops.accuracy import max_rel


# With chunk_size=16: empty sequences (front, middle, back), shorter than a chunk, exactly one chunk,
# longer and not a multiple of the chunk.
CU = [0, 0, 5, 21, 21, 58, 90, 91, 91]
CHUNK = 16


def make(cu=CU, Hk=2, Hv=4, Dk=8, Dv=6, dtype=torch.float64, seed=0, with_state=True, normalized_k=False):
    """Random inputs in the ranges a GDN layer produces: g = logsigmoid(.) <= 0, beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    T, N = cu[-1], len(cu) - 1

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = randn(T, Hk, Dk), randn(T, Hk, Dk), randn(T, Hv, Dv)
    if normalized_k:  # without the in-op l2norm, keep I - beta k k^T a contraction
        k = F.normalize(k, dim=-1)
    g = F.logsigmoid(randn(T, Hv) + 2.0)
    beta = torch.rand(T, Hv, generator=gen, dtype=torch.float64)
    s0 = randn(N, Hv, Dk, Dv) if with_state else None
    g_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # g comes in fp32 (fp64 in fp64 tests)
    return dict(
        q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g.to(g_dtype), beta=beta.to(dtype),
        initial_state=s0.to(dtype) if s0 is not None else None,
    )


def call(fn, inputs, **kw):
    kw.setdefault("cu_seqlens", CU)
    kw.setdefault("chunk_size", CHUNK)
    kw.setdefault("output_final_state", True)
    return fn(
        inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], initial_state=inputs["initial_state"], **kw
    )


@pytest.mark.parametrize("use_qk_l2norm", [True, False])
@pytest.mark.parametrize("with_state", [True, False])
@pytest.mark.parametrize("heads", [(2, 4), (3, 3)], ids=["grouped", "mha"])
def test_matches_naive_fp64(use_qk_l2norm, with_state, heads):
    Hk, Hv = heads
    x = make(Hk=Hk, Hv=Hv, with_state=with_state, normalized_k=not use_qk_l2norm)
    o, s = call(chunk_gated_delta_rule, x, use_qk_l2norm=use_qk_l2norm)
    o_ref, s_ref = call(naive_gated_delta_rule, x, use_qk_l2norm=use_qk_l2norm)
    assert o.dtype == torch.float64 and o.shape == (CU[-1], Hv, 6)
    assert s.dtype == torch.float64 and s.shape == (len(CU) - 1, Hv, 8, 6)
    assert max_rel(o, o_ref) <= 1e-10
    assert max_rel(s, s_ref) <= 1e-10


def test_fp32_close_to_fp64_oracle():
    x = make(dtype=torch.float32)
    o, s = call(chunk_gated_delta_rule, x)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    o_ref, s_ref = call(naive_gated_delta_rule, {n: t.double() for n, t in x.items()})
    assert max_rel(o, o_ref) <= 1e-5
    assert max_rel(s, s_ref) <= 1e-5


def test_bf16_runs_and_stays_near_fp32():
    x = make(dtype=torch.bfloat16)
    o, s = call(chunk_gated_delta_rule, x)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    o32, s32 = call(chunk_gated_delta_rule, {n: t.float() for n, t in x.items()})
    assert max_rel(o, o32) <= 2e-2
    assert max_rel(s, s32) <= 1e-5  # same bf16-rounded inputs, state math in fp32 both times


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=4),
    chunk_size=st.sampled_from([1, 3, 8, 16, 64]),
)
def test_any_packing_and_chunk_size(lengths, chunk_size):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    x = make(cu=cu, Hk=1, Hv=2, Dk=4, Dv=3, seed=sum(lengths))
    o, s = call(chunk_gated_delta_rule, x, cu_seqlens=cu, chunk_size=chunk_size)
    o_ref, s_ref = call(naive_gated_delta_rule, x, cu_seqlens=cu)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s, s_ref, rtol=1e-10, atol=1e-10)


def test_empty_sequence_final_state_is_initial_state():
    x = make()
    _, s = call(chunk_gated_delta_rule, x)
    for n, (a, b) in enumerate(zip(CU[:-1], CU[1:])):
        if a == b:
            assert torch.equal(s[n], x["initial_state"][n])


def test_no_final_state_unless_asked_and_scale_is_used():
    x = make(with_state=False)
    o, s = call(chunk_gated_delta_rule, x, output_final_state=False)
    assert s is None
    o2, _ = call(chunk_gated_delta_rule, x, scale=2 * 8**-0.5)
    torch.testing.assert_close(o2, 2 * o, rtol=1e-12, atol=1e-12)


def test_all_empty():
    x = make(cu=[0, 0, 0])
    o, s = call(chunk_gated_delta_rule, x, cu_seqlens=[0, 0, 0])
    assert o.shape == (0, 4, 6)
    assert torch.equal(s, x["initial_state"])


def test_augmented_summary_gives_transition_and_zero_state_part():
    """CP's slice summary in one call: v' = [0 | v] from S' = [I | 0] ends at [M | S_ext], and any
    incoming state S_in then ends at M S_in + S_ext."""
    x = make(Dk=8, Dv=6)
    T, Hv, N = CU[-1], 4, len(CU) - 1
    v_aug = torch.cat([torch.zeros(T, Hv, 8, dtype=torch.float64), x["v"]], dim=-1)
    s_aug = torch.cat(
        [torch.eye(8, dtype=torch.float64).expand(N, Hv, 8, 8), torch.zeros(N, Hv, 8, 6, dtype=torch.float64)], dim=-1
    )
    _, summary = call(chunk_gated_delta_rule, x | {"v": v_aug, "initial_state": s_aug})
    M, S_ext = summary[..., :8], summary[..., 8:]
    _, s_ref = call(naive_gated_delta_rule, x)  # x["initial_state"] is a random S_in
    torch.testing.assert_close(M @ x["initial_state"] + S_ext, s_ref, rtol=1e-10, atol=1e-10)


def test_split_sequence_with_carried_state_equals_whole():
    """The chunkwise-CP property: a sequence cut in two, the second part started from the first
    part's final state, gives the whole sequence's outputs and final state."""
    x = make(cu=[0, 70], Hk=2, Hv=2, with_state=False)
    o, s = call(chunk_gated_delta_rule, x, cu_seqlens=[0, 70])
    left = {n: (t[:29] if t is not None else None) for n, t in x.items()}
    right = {n: (t[29:] if t is not None else None) for n, t in x.items()}
    o1, s1 = call(chunk_gated_delta_rule, left, cu_seqlens=[0, 29])
    o2, s2 = call(chunk_gated_delta_rule, right | {"initial_state": s1}, cu_seqlens=[0, 41])
    torch.testing.assert_close(torch.cat([o1, o2]), o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s2, s, rtol=1e-10, atol=1e-10)


def test_gradcheck_all_inputs():
    cu = [0, 3, 3, 9]
    x = make(cu=cu, Hk=1, Hv=2, Dk=3, Dv=2, seed=3)
    names = ["q", "k", "v", "g", "beta", "initial_state"]
    inputs = tuple(x[n].clone().requires_grad_() for n in names)

    def fn(q, k, v, g, beta, s0):
        o, s = chunk_gated_delta_rule(
            q, k, v, g, beta, cu_seqlens=cu, initial_state=s0, output_final_state=True, chunk_size=4
        )
        return o, s

    assert torch.autograd.gradcheck(fn, inputs)


def test_grads_match_naive():
    cu = [0, 50, 50, 123]
    x = make(cu=cu, Hk=2, Hv=4, Dk=8, Dv=6, seed=4)
    names = ["q", "k", "v", "g", "beta", "initial_state"]
    grads = []
    for fn in (chunk_gated_delta_rule, naive_gated_delta_rule):
        inputs = {n: x[n].clone().requires_grad_() for n in names}
        o, s = call(fn, inputs, cu_seqlens=cu)
        gen = torch.Generator().manual_seed(5)
        loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() + (
            s * torch.randn(s.shape, generator=gen, dtype=s.dtype)
        ).sum()
        loss.backward()
        grads.append({n: inputs[n].grad for n in names})
    for n in names:
        assert max_rel(grads[0][n], grads[1][n]) <= 1e-10, n


def test_l2norm():
    x = torch.randn(5, 3, 8, dtype=torch.bfloat16)
    y = l2norm(x)
    assert y.dtype == torch.bfloat16
    xf = x.float()
    ref = xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2)
    assert torch.equal(l2norm(torch.zeros(2, 4)), torch.zeros(2, 4))


def _bad_args(**over):
    T, N = 6, 2
    args = dict(
        q=torch.zeros(T, 2, 4), k=torch.zeros(T, 2, 4), v=torch.zeros(T, 4, 3), g=torch.zeros(T, 4),
        beta=torch.zeros(T, 4), cu_seqlens=[0, 2, T], initial_state=torch.zeros(N, 4, 4, 3), chunk_size=4,
    )
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(q=torch.zeros(1, 6, 2, 4)), "q must be"),
        (dict(v=torch.zeros(6, 12)), "v must be"),
        (dict(g=torch.zeros(6, 4, 1)), "g must be"),
        (dict(k=torch.zeros(6, 2, 5)), "k must have"),
        (dict(v=torch.zeros(5, 4, 3)), "v must have"),
        (dict(v=torch.zeros(6, 3, 3), g=torch.zeros(6, 3), beta=torch.zeros(6, 3)), "multiple"),
        (dict(beta=torch.zeros(6, 2)), "beta must be"),
        (dict(initial_state=torch.zeros(3, 4, 4, 3)), "initial_state must be"),
        (dict(cu_seqlens=[1, 6]), "start at 0"),
        (dict(cu_seqlens=[0, 4, 2, 6]), "non-decreasing"),
        (dict(cu_seqlens=[0, 7]), "end at"),
        (dict(chunk_size=0), "chunk_size"),
    ],
)
def test_bad_input_raises_value_error(over, match):
    args = _bad_args(**over)
    if len(args["cu_seqlens"]) != 3:
        args["initial_state"] = None
    with pytest.raises(ValueError, match=match):
        chunk_gated_delta_rule(
            args.pop("q"), args.pop("k"), args.pop("v"), args.pop("g"), args.pop("beta"), **args
        )


def test_device_cu_seqlens_refused():
    args = _bad_args(cu_seqlens=torch.tensor([0, 2, 6]))
    with pytest.raises(TypeError, match="tolist"):
        chunk_gated_delta_rule(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("g"), args.pop("beta"), **args)
