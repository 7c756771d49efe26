"""gdn_cp.ops.reference.causal_conv1d against the naive per-sequence conv and torch's Conv1d."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from gdn_cp.ops.reference.conv import causal_conv1d
from gdn_cp.ops.reference.naive import naive_causal_conv1d
from gdn_cp.ops.accuracy import max_rel


# Empty sequences (front, middle, back), sequences shorter than W and longer.
CU = [0, 0, 1, 3, 3, 11, 40, 41, 41]


def make(T=CU[-1], C=5, W=4, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, C, generator=gen, dtype=torch.float64).to(dtype)
    w = torch.randn(C, W, generator=gen, dtype=torch.float64).to(dtype)
    b = torch.randn(C, generator=gen, dtype=torch.float64).to(dtype)
    halo = torch.randn(W - 1, C, generator=gen, dtype=torch.float64).to(dtype)
    return x, w, b, halo


@pytest.mark.parametrize("W", [1, 2, 4])
@pytest.mark.parametrize("with_halo", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("activation", ["silu", None])
def test_matches_naive_fp64(W, with_halo, with_bias, activation):
    x, w, b, halo = make(W=W)
    kw = dict(cu_seqlens=CU, halo=halo if with_halo else None, activation=activation)
    bias = b if with_bias else None
    y = causal_conv1d(x, w, bias, **kw)
    assert y.dtype == torch.float64 and y.shape == x.shape
    assert max_rel(y, naive_causal_conv1d(x, w, bias, **kw)) <= 1e-10


def test_matches_torch_conv1d_per_sequence():
    x, w, b, _ = make()
    y = causal_conv1d(x, w, b, cu_seqlens=CU, activation=None)
    C, W = w.shape
    for a, e in zip(CU[:-1], CU[1:]):
        if a == e:
            continue
        ref = F.conv1d(x[a:e].T[None], w[:, None, :], b, padding=W - 1, groups=C)[0, :, : e - a].T
        assert max_rel(y[a:e], ref) <= 1e-12


def test_fp32_close_to_fp64_oracle():
    x, w, b, halo = make()
    y = causal_conv1d(x.float(), w.float(), b.float(), cu_seqlens=CU, halo=halo.float())
    assert y.dtype == torch.float32
    ref = naive_causal_conv1d(x.float().double(), w.float().double(), b.float().double(), cu_seqlens=CU,
                              halo=halo.float().double())
    assert max_rel(y, ref) <= 1e-5


def test_bf16_runs_and_stays_near_fp32():
    x, w, b, halo = make(dtype=torch.bfloat16)
    y = causal_conv1d(x, w, b, cu_seqlens=CU, halo=halo)
    assert y.dtype == torch.bfloat16
    ref = causal_conv1d(x.float(), w.float(), b.float(), cu_seqlens=CU, halo=halo.float())
    assert max_rel(y, ref) <= 1e-2


def test_empty_input():
    x, w, b, halo = make(T=0)
    y = causal_conv1d(x, w, b, cu_seqlens=[0, 0], halo=halo)
    assert y.shape == (0, 5)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=5),
    W=st.integers(1, 5),
    data=st.data(),
)
def test_split_with_halo_equals_whole(lengths, W, data):
    """The CP property: cut the packed stream at any row r; the right part with the W-1 rows before
    r as halo (zeroed where they belong to another sequence) gives the whole stream's rows [r:]."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    T = cu[-1]
    r = data.draw(st.integers(0, T))
    x, w, b, _ = make(T=T, W=W, seed=T + W)
    whole = causal_conv1d(x, w, b, cu_seqlens=cu)
    # Boundaries of the right part, and the halo: rows r-W+1..r-1 of r's sequence, zeros elsewhere.
    start_of_r = max(c for c in cu if c <= r) if r < T else r
    local_cu = [0] + [c - r for c in cu if c > r] if r < T else [0, 0]
    halo = torch.zeros(W - 1, x.shape[1], dtype=x.dtype)
    for i in range(W - 1):
        row = r - (W - 1) + i
        if row >= start_of_r and row >= 0:
            halo[i] = x[row]
    part = causal_conv1d(x[r:], w, b, cu_seqlens=local_cu, halo=halo)
    torch.testing.assert_close(part, whole[r:], rtol=0, atol=1e-12)


def test_gradcheck_all_inputs():
    cu = [0, 2, 2, 7]
    x, w, b, halo = make(T=7, C=3, W=3, seed=1)
    inputs = tuple(t.clone().requires_grad_() for t in (x, w, b, halo))
    assert torch.autograd.gradcheck(
        lambda x, w, b, h: causal_conv1d(x, w, b, cu_seqlens=cu, halo=h), inputs
    )


def test_grads_match_naive():
    x, w, b, halo = make()
    grads = []
    for fn in (causal_conv1d, naive_causal_conv1d):
        inputs = [t.clone().requires_grad_() for t in (x, w, b, halo)]
        y = fn(inputs[0], inputs[1], inputs[2], cu_seqlens=CU, halo=inputs[3])
        y.backward(torch.ones_like(y).cos_())
        grads.append([t.grad for t in inputs])
    for got, ref in zip(*grads):
        assert max_rel(got, ref) <= 1e-10


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(x=torch.zeros(2, 3, 5)), "x must be"),
        (dict(weight=torch.zeros(4, 1, 4)), "squeeze"),
        (dict(weight=torch.zeros(3, 4)), "weight must be"),
        (dict(bias=torch.zeros(3)), "bias must be"),
        (dict(halo=torch.zeros(4, 4)), "halo must be"),
        (dict(halo=torch.zeros(3, 5)), "halo must be"),
        (dict(cu_seqlens=[1, 6]), "start at 0"),
        (dict(cu_seqlens=[0, 4, 3, 6]), "non-decreasing"),
        (dict(cu_seqlens=[0, 5]), "end at"),
        (dict(cu_seqlens=[0]), "at least 2"),
        (dict(activation="relu"), "activation"),
    ],
)
def test_bad_input_raises_value_error(kwargs, match):
    args = dict(x=torch.zeros(6, 4), weight=torch.zeros(4, 4), bias=None, cu_seqlens=[0, 6], halo=None,
                activation="silu")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        causal_conv1d(args.pop("x"), args.pop("weight"), args.pop("bias"), **args)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(cu_seqlens=torch.tensor([0, 6])), "tolist"),
        (dict(cu_seqlens=[0, 6.0]), "Python ints"),
        (dict(x=torch.zeros(6, 4, dtype=torch.long)), "floating-point"),
    ],
)
def test_bad_input_type_raises_type_error(kwargs, match):
    args = dict(x=torch.zeros(6, 4), weight=torch.zeros(4, 4), cu_seqlens=[0, 6])
    args.update(kwargs)
    with pytest.raises(TypeError, match=match):
        causal_conv1d(args.pop("x"), args.pop("weight"), **args)
