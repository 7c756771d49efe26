"""The gates as one Triton kernel each way (CUDA; the Triton interpreter runs them on the CPU in tests).

Forward: ``g = decay * softplus(alpha + dt_bias)`` in fp32 and ``beta = sigmoid(b)`` in b's dtype, from
``alpha, b [T, Hv]`` read where in_proj wrote them (any row stride), in one pass. Backward: ``dalpha``,
``db`` in one pass, and per program the sums over its rows of the gradients of ``decay`` and ``dt_bias``
(fp32, summed over programs after, then rounded to the parameters' dtype: where autograd rounds them in
stock's expression). ``decay = -exp(A_log)`` stays a torch op in A_log's dtype (stock rounds it there).
Softplus is torch's (``x`` above 20, else ``log1p(exp(x))``); sigmoid's gradient uses the rounded output,
as torch's does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["gates_triton"]

_BT = 64  # rows per tile
_RUN = 16  # tiles per backward program


@triton.jit
def _softplus(x):
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def gdn_cp_glue_gates_fwd(a_ptr, a_stride, b_ptr, b_stride, decay_ptr, dtb_ptr, g_ptr, beta_ptr, T, HV, BT: tl.constexpr,
                BH: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    h = tl.arange(0, BH)
    ok = (rows < T)[:, None] & (h < HV)[None, :]
    a = tl.load(a_ptr + rows[:, None].to(tl.int64) * a_stride + h[None, :], mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + rows[:, None].to(tl.int64) * b_stride + h[None, :], mask=ok, other=0.0).to(tl.float32)
    decay = tl.load(decay_ptr + h, mask=h < HV, other=0.0).to(tl.float32)
    dtb = tl.load(dtb_ptr + h, mask=h < HV, other=0.0).to(tl.float32)
    g = decay[None, :] * _softplus(a + dtb[None, :])
    out = rows[:, None].to(tl.int64) * HV + h[None, :]
    tl.store(g_ptr + out, g, mask=ok)
    tl.store(beta_ptr + out, tl.sigmoid(b).to(beta_ptr.dtype.element_ty), mask=ok)


@triton.jit
def gdn_cp_glue_gates_bwd(a_ptr, a_stride, beta_ptr, decay_ptr, dtb_ptr, dg_ptr, dbeta_ptr, da_ptr, da_stride, db_ptr,
                db_stride, ddecay_ptr, ddtb_ptr, T, HV, BT: tl.constexpr, BH: tl.constexpr, RUN: tl.constexpr):
    i_p = tl.program_id(0)
    h = tl.arange(0, BH)
    h_ok = h < HV
    decay = tl.load(decay_ptr + h, mask=h_ok, other=0.0).to(tl.float32)
    dtb = tl.load(dtb_ptr + h, mask=h_ok, other=0.0).to(tl.float32)
    sum_decay = tl.zeros((BH,), dtype=tl.float32)
    sum_dtb = tl.zeros((BH,), dtype=tl.float32)
    for it in range(RUN):
        rows = (i_p * RUN + it) * BT + tl.arange(0, BT)
        ok = (rows < T)[:, None] & h_ok[None, :]
        r64 = rows[:, None].to(tl.int64)
        x = tl.load(a_ptr + r64 * a_stride + h[None, :], mask=ok, other=0.0).to(tl.float32) + dtb[None, :]
        dg = tl.load(dg_ptr + r64 * HV + h[None, :], mask=ok, other=0.0).to(tl.float32)
        sum_decay += tl.sum(dg * _softplus(x), axis=0)
        dx = tl.where(ok, dg * decay[None, :] * tl.sigmoid(x), 0.0)  # softplus' = sigmoid
        sum_dtb += tl.sum(dx, axis=0)
        tl.store(da_ptr + r64 * da_stride + h[None, :], dx.to(da_ptr.dtype.element_ty), mask=ok)
        s = tl.load(beta_ptr + r64 * HV + h[None, :], mask=ok, other=0.0).to(tl.float32)
        dbeta = tl.load(dbeta_ptr + r64 * HV + h[None, :], mask=ok, other=0.0).to(tl.float32)
        tl.store(db_ptr + r64 * db_stride + h[None, :], (dbeta * s * (1.0 - s)).to(db_ptr.dtype.element_ty), mask=ok)
    tl.store(ddecay_ptr + i_p * HV + h, sum_decay, mask=h_ok)
    tl.store(ddtb_ptr + i_p * HV + h, sum_dtb, mask=h_ok)


class _Gates(torch.autograd.Function):
    @staticmethod
    def forward(ctx, alpha, b, decay, dt_bias):
        t, hv = alpha.shape
        g = torch.empty(t, hv, dtype=torch.float32, device=alpha.device)
        beta = torch.empty(t, hv, dtype=b.dtype, device=alpha.device)
        bh = triton.next_power_of_2(hv)
        if t:
            gdn_cp_glue_gates_fwd[(triton.cdiv(t, _BT),)](alpha, alpha.stride(0), b, b.stride(0), decay, dt_bias, g, beta, t, hv,
                                                BT=_BT, BH=bh)
        ctx.save_for_backward(alpha, beta, decay, dt_bias)
        ctx.b_dtype = b.dtype
        return g, beta

    @staticmethod
    def backward(ctx, dg, dbeta):
        alpha, beta, decay, dt_bias = ctx.saved_tensors
        t, hv = alpha.shape
        dg = torch.zeros_like(beta, dtype=torch.float32) if dg is None else dg.contiguous()
        dbeta = torch.zeros_like(beta) if dbeta is None else dbeta.contiguous()
        da = torch.empty(t, hv, dtype=alpha.dtype, device=alpha.device)
        db = torch.empty(t, hv, dtype=ctx.b_dtype, device=alpha.device)
        programs = max(1, triton.cdiv(t, _BT * _RUN))
        ddecay = torch.zeros(programs, hv, dtype=torch.float32, device=alpha.device)
        ddtb = torch.zeros(programs, hv, dtype=torch.float32, device=alpha.device)
        if t:
            gdn_cp_glue_gates_bwd[(programs,)](alpha, alpha.stride(0), beta, decay, dt_bias, dg, dbeta, da, da.stride(0), db,
                                     db.stride(0), ddecay, ddtb, t, hv, BT=_BT, BH=triton.next_power_of_2(hv), RUN=_RUN)
        return da, db, ddecay.sum(0).to(decay.dtype), ddtb.sum(0).to(dt_bias.dtype)


def gates_triton(alpha: torch.Tensor, b: torch.Tensor, decay: torch.Tensor, dt_bias: torch.Tensor):
    """``(g [T, Hv] fp32, sigmoid(b) [T, Hv])`` by the kernels above (module docstring)."""
    return _Gates.apply(alpha, b, decay.contiguous(), dt_bias.contiguous())
