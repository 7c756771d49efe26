"""The fused glue (gdn_cp.ops.fused): the conv + SiLU + q/k/v split + l2 norm step and the gates, against
the reference backend's conv, gdn-cp's split and FLA's l2norm rule done op by op, in fp64, forward and
backward: strided inputs (views of in_proj's output), packed sequences with empty slots, a halo, no rows.
On CUDA the same functions are compiled (tests/gpu/test_fused_glue_gpu.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gdn_cp.layout import Boundaries
from gdn_cp.modes.common import conv_split, split_qkv
from gdn_cp.ops import GDNShape, get_backend
from gdn_cp.ops.fused import conv_silu_split, gates
from gdn_cp.ops.reference.gated_delta_rule import l2norm

SHAPE = GDNShape(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=6)
W = 4


def _op_by_op(x, weight, bias, cu, halo, shape, qk_l2norm):
    y = get_backend("reference").causal_conv1d(x, weight, bias, cu_seqlens=cu, halo=halo, activation="silu")
    q, k, v = split_qkv(y, shape, shape.num_k_heads, shape.num_v_heads)
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q, k, v


@pytest.mark.parametrize("halo", [False, True])
@pytest.mark.parametrize("qk_l2norm", [True, False])
@pytest.mark.parametrize("cu", [[0, 5, 5, 17, 30], [0, 30], [0, 1, 2, 30]])
def test_conv_silu_split_equals_the_ops_one_by_one(cu, halo, qk_l2norm):
    torch.manual_seed(len(cu) + 2 * halo)
    shape = GDNShape(2, 4, 8, 6, qk_l2norm=qk_l2norm)
    t, c = cu[-1], shape.conv_dim
    rows = torch.randn(t, c + 7, dtype=torch.float64)  # x is a strided view, as in the layer
    weight, bias = torch.randn(c, W, dtype=torch.float64), torch.randn(c, dtype=torch.float64)
    h = torch.randn(W - 1, c, dtype=torch.float64) if halo else None
    leaves = [a.requires_grad_(True) for a in (rows, weight, bias) + ((h,) if halo else ())]
    got = conv_split(rows[:, 3:3 + c], weight, bias, shape=shape, cu_seqlens=Boundaries(cu), halo=h)
    assert all(o.is_contiguous() for o in got)
    want = _op_by_op(rows[:, 3:3 + c], weight, bias, cu, h, shape, qk_l2norm)
    douts = [torch.randn_like(o) for o in want]
    grads_got = torch.autograd.grad(got, leaves, douts)
    grads_want = torch.autograd.grad(want, leaves, douts)
    for a, b in zip(got + grads_got, want + grads_want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_halo_changes_only_the_first_sequence():
    """The halo feeds the sequence that starts at row 0 and nothing after its end; a wrong mask fails here."""
    torch.manual_seed(1)
    c = SHAPE.conv_dim
    x, weight = torch.randn(12, c, dtype=torch.float64), torch.randn(c, W, dtype=torch.float64)
    positions = Boundaries([0, 5, 12]).positions("cpu")
    kw = dict(k_heads=2, v_heads=4, head_k_dim=8, head_v_dim=6, qk_l2norm=False)
    without = conv_silu_split(x, weight, None, positions, torch.zeros(W - 1, c, dtype=torch.float64), **kw)
    with_halo = conv_silu_split(x, weight, None, positions, torch.randn(W - 1, c, dtype=torch.float64), **kw)
    for a, b in zip(without, with_halo):
        assert not torch.allclose(a[:3], b[:3]) and torch.equal(a[3:], b[3:])  # rows 0-2 read the halo


def test_positions_of_packed_rows():
    cu = Boundaries([0, 3, 3, 7, 8])
    assert cu.positions("cpu").tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    assert cu.positions("cpu").dtype == torch.int32 and cu.positions("cpu") is cu.positions("cpu")


def test_no_rows():
    x = torch.zeros(0, SHAPE.conv_dim, dtype=torch.bfloat16)
    q, k, v = conv_split(x, torch.randn(SHAPE.conv_dim, W), None, shape=SHAPE, cu_seqlens=[0, 0])
    assert (q.shape, k.shape, v.shape) == ((0, 2, 8), (0, 2, 8), (0, 4, 6)) and q.dtype == torch.bfloat16


def test_bf16_is_computed_in_fp32_and_rounded_once():
    """bf16 in, bf16 out, the conv and the l2 norm in fp32: within bf16 rounding of the fp64 answer."""
    torch.manual_seed(2)
    c = SHAPE.conv_dim
    x, weight, bias = torch.randn(40, c), torch.randn(c, W), torch.randn(c)
    cu = [0, 17, 40]
    got = conv_split(x.bfloat16(), weight.bfloat16(), bias.bfloat16(), shape=SHAPE, cu_seqlens=cu)
    want = _op_by_op(x.bfloat16().double(), weight.bfloat16().double(), bias.bfloat16().double(), cu, None,
                     SHAPE, True)
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16
        assert (a.double() - b).norm() / b.norm() < 4e-3


def test_gates_are_stocks_expression():
    torch.manual_seed(3)
    rows = torch.randn(9, 20, dtype=torch.bfloat16, requires_grad=True)
    a_log = torch.rand(4, dtype=torch.bfloat16, requires_grad=True)
    dt_bias = torch.randn(4, dtype=torch.bfloat16, requires_grad=True)
    _, beta_raw, alpha = torch.split(rows, [12, 4, 4], dim=-1)
    g, beta = gates(alpha, beta_raw, a_log, dt_bias)
    want_g = -a_log.exp() * F.softplus(alpha.float() + dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == torch.bfloat16
    torch.testing.assert_close(g, want_g, rtol=0, atol=0)
    torch.testing.assert_close(beta, beta_raw.sigmoid(), rtol=0, atol=0)
