"""The conv + SiLU + q/k/v split + l2 norm glue as two hand-written Triton kernels (CUDA; the Triton
interpreter runs them on the CPU in tests).

Forward, one program per (block of rows, head): the causal conv's W taps over the head's channels
(masked at each sequence's first rows, reading the CP halo for the sequence that continues into row 0),
SiLU, rounded to the activations' dtype (where FLA's conv rounds), then, for q and k heads, the l2 norm
over the head dim in fp32, rounded once (where FLA's l2norm rounds); written straight into contiguous
``q, k [T, Hk, Dk]`` and ``v [T, Hv, Dv]``. x is read once; nothing but the inputs is kept for backward.

Backward, one program per (run of rows, head): the forward is recomputed for the rows each tap reaches
(cheap: the kernel is bound by memory, and recomputing avoids a [T, C] fp32 buffer), the l2 norm's and
SiLU's gradients applied (the norm's rounded to the activations' dtype, as FLA's l2norm backward
returns it), then the input gradient ``dx [T, C]`` written once, the tap and bias gradients reduced
per program (fp32, summed over programs after), and the halo's gradient ``[W-1, C]`` by the first
program alone: no zero-filled full-size gradient anywhere.

Shapes: ``x [T, C]`` (any row stride: a view of in_proj's output), ``weight [C, W]``, ``bias [C]`` or
None, ``positions [T]`` int32 (row offsets within each sequence), ``halo [W-1, C]`` or None.
Everything is trusted: the boundary that made the call checked it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["conv_silu_split_triton"]

_RUN = 8  # tiles per backward program (its tap / bias sums cover rows-per-tile * _RUN rows)


@triton.jit
def _conv_tile(x_ptr, x_stride, w_ptr, b_ptr, halo_ptr, halo_stride, rows, pos, row_ok, ch, d_ok,
               W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_HALO: tl.constexpr):
    """The conv's pre-activation ``[BT, BD]`` fp32 at ``rows`` (int32 [BT]) for channels ``ch`` ([BD])."""
    acc = tl.zeros((rows.shape[0], ch.shape[0]), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + ch, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    first = pos == rows  # rows of the sequence that starts at row 0 (continues into the halo)
    for j in tl.static_range(W):
        shift = W - 1 - j
        src = rows - shift
        tap = tl.load(w_ptr + ch * W + j, mask=d_ok, other=0.0).to(tl.float32)
        inside = row_ok & (pos >= shift)
        xv = tl.load(x_ptr + src[:, None].to(tl.int64) * x_stride + ch[None, :],
                     mask=inside[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        if HAS_HALO:
            from_halo = row_ok & first & (src < 0)
            hv = tl.load(halo_ptr + (src + W - 1)[:, None] * halo_stride + ch[None, :],
                         mask=from_halo[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            xv += hv
        acc += tap[None, :] * xv
    return acc


@triton.jit
def gdn_cp_glue_conv_fwd(x_ptr, x_stride, w_ptr, b_ptr, halo_ptr, halo_stride, pos_ptr, out_ptr, T, C0, HEADS, EPS,
                D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, W: tl.constexpr, HAS_BIAS: tl.constexpr,
                HAS_HALO: tl.constexpr, NORM: tl.constexpr):
    """``out [T, HEADS, D]`` <- head ``program_id(1)`` of the channels starting at ``C0``."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    rows = i_t * BT + tl.arange(0, BT)
    d = tl.arange(0, BD)
    row_ok, d_ok = rows < T, d < D
    ch = C0 + i_h * D + d
    pos = tl.load(pos_ptr + rows, mask=row_ok, other=0)
    y = _conv_tile(x_ptr, x_stride, w_ptr, b_ptr, halo_ptr, halo_stride, rows, pos, row_ok, ch, d_ok,
                   W, HAS_BIAS, HAS_HALO)
    a = (y * tl.sigmoid(y)).to(out_ptr.dtype.element_ty).to(tl.float32)  # SiLU, rounded as FLA's conv
    if NORM:
        a = a * tl.rsqrt(tl.sum(a * a, axis=1) + EPS)[:, None]
    dst = out_ptr + (rows[:, None].to(tl.int64) * HEADS + i_h) * D + d[None, :]
    tl.store(dst, a.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _dpre_tile(x_ptr, x_stride, w_ptr, b_ptr, halo_ptr, halo_stride, pos_ptr, dout_ptr, rows, T, i_h, HEADS, ch,
               d, d_ok, EPS, D: tl.constexpr, W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_HALO: tl.constexpr,
               NORM: tl.constexpr):
    """The gradient at the conv's pre-activation ``[BT, BD]`` fp32 for ``rows`` (zeros outside [0, T))."""
    row_ok = (rows >= 0) & (rows < T)
    pos = tl.load(pos_ptr + rows, mask=row_ok, other=0)
    y = _conv_tile(x_ptr, x_stride, w_ptr, b_ptr, halo_ptr, halo_stride, rows, pos, row_ok, ch, d_ok,
                   W, HAS_BIAS, HAS_HALO)
    s = tl.sigmoid(y)
    ok = row_ok[:, None] & d_ok[None, :]
    da = tl.load(dout_ptr + (rows[:, None].to(tl.int64) * HEADS + i_h) * D + d[None, :], mask=ok,
                 other=0.0).to(tl.float32)
    if NORM:
        a = (y * s).to(dout_ptr.dtype.element_ty).to(tl.float32)
        r = tl.rsqrt(tl.sum(a * a, axis=1) + EPS)
        n = a * r[:, None]
        da = r[:, None] * (da - n * tl.sum(da * n, axis=1)[:, None])
        da = da.to(dout_ptr.dtype.element_ty).to(tl.float32)  # FLA's l2norm backward returns x's dtype
    return tl.where(ok, da * (s * (1.0 + y * (1.0 - s))), 0.0)


@triton.jit
def gdn_cp_glue_conv_bwd(x_ptr, x_stride, w_ptr, b_ptr, halo_ptr, halo_stride, pos_ptr, dout_ptr, dx_ptr, dx_stride,
                dw_ptr, db_ptr, dhalo_ptr, T, C, C0, HEADS, EPS, D: tl.constexpr, BD: tl.constexpr,
                BT: tl.constexpr, RUN: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, HAS_BIAS: tl.constexpr,
                HAS_HALO: tl.constexpr, NORM: tl.constexpr):
    """dx of ``RUN`` tiles of rows for head ``program_id(1)``, and their sums of the tap and bias
    gradients into ``dw [programs, C, W]``, ``db [programs, C]`` (fp32); the halo's gradient from program 0."""
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, BD)
    d_ok = d < D
    ch = C0 + i_h * D + d
    taps = tl.zeros((BD, WP), dtype=tl.float32)  # WP: W rounded up to a power of two (tl.arange's rule)
    wj = tl.arange(0, WP)
    dbias = tl.zeros((BD,), dtype=tl.float32)
    for it in range(RUN):
        rows = (i_p * RUN + it) * BT + tl.arange(0, BT)
        row_ok = rows < T
        pos = tl.load(pos_ptr + rows, mask=row_ok, other=0)
        dx = tl.zeros((BT, BD), dtype=tl.float32)
        for s in tl.static_range(W):  # dx[t] = sum_j w[j] * dpre[t + W-1-j], t + W-1-j in t's sequence
            later = rows + s
            dpre = _dpre_tile(x_ptr, x_stride, w_ptr, b_ptr, halo_ptr, halo_stride, pos_ptr, dout_ptr, later, T,
                              i_h, HEADS, ch, d, d_ok, EPS, D, W, HAS_BIAS, HAS_HALO, NORM)
            if s == 0:
                dbias += tl.sum(dpre, axis=0)
                first = pos == rows
                for j in tl.static_range(W):  # the taps: sum_t dpre[t] * x[t - (W-1-j)], as the forward masks it
                    shift = W - 1 - j
                    src = rows - shift
                    xv = tl.load(x_ptr + src[:, None].to(tl.int64) * x_stride + ch[None, :],
                                 mask=(row_ok & (pos >= shift))[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
                    if HAS_HALO:
                        xv += tl.load(halo_ptr + (src + W - 1)[:, None] * halo_stride + ch[None, :],
                                      mask=(row_ok & first & (src < 0))[:, None] & d_ok[None, :],
                                      other=0.0).to(tl.float32)
                    taps += tl.where(wj[None, :] == j, tl.sum(dpre * xv, axis=0)[:, None], 0.0)
                if HAS_HALO:
                    if i_p * RUN + it == 0:  # halo row i (token i-(W-1)) feeds row i-j through tap j
                        for i in tl.static_range(W - 1):
                            acc = tl.zeros((BD,), dtype=tl.float32)
                            for j in tl.static_range(i + 1):
                                tap = tl.load(w_ptr + ch * W + j, mask=d_ok, other=0.0).to(tl.float32)
                                pick = (rows == i - j) & (pos == rows)
                                acc += tap * tl.sum(tl.where(pick[:, None], dpre, 0.0), axis=0)
                            tl.store(dhalo_ptr + i * C + ch, acc.to(dhalo_ptr.dtype.element_ty), mask=d_ok)
            tap = tl.load(w_ptr + ch * W + (W - 1 - s), mask=d_ok, other=0.0).to(tl.float32)
            later_pos = tl.load(pos_ptr + later, mask=later < T, other=0)
            keep = (later < T) & (later_pos >= s)
            dx += tl.where(keep[:, None], tap[None, :] * dpre, 0.0)
        tl.store(dx_ptr + rows[:, None].to(tl.int64) * dx_stride + ch[None, :], dx.to(dx_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
    tl.store(dw_ptr + (i_p * C + ch)[:, None].to(tl.int64) * W + wj[None, :], taps,
             mask=d_ok[:, None] & (wj < W)[None, :])
    if HAS_BIAS:
        tl.store(db_ptr + i_p * C + ch, dbias, mask=d_ok)


def _groups(k_heads, v_heads, dk, dv, qk_l2norm):
    """(first channel, heads, head dim, l2-normalized) of q, k, v in the pre-conv channels."""
    kd = k_heads * dk
    return ((0, k_heads, dk, qk_l2norm), (kd, k_heads, dk, qk_l2norm), (2 * kd, v_heads, dv, False))


def _block(dim: int) -> int:
    return max(16, triton.next_power_of_2(dim))


def _rows(bd: int) -> int:
    """Rows per tile: a [rows, head dim] fp32 tile of 4K elements (several are live at once)."""
    return 32 if bd <= 128 else 16


def _warps(bd: int) -> int:
    return 4 if bd <= 64 else 8


class _ConvSiluSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, positions, halo, k_heads, v_heads, dk, dv, qk_l2norm, eps):
        t, c = x.shape
        w = weight.shape[1]
        weight_c = weight.contiguous()
        outs = []
        for c0, heads, dim, norm in _groups(k_heads, v_heads, dk, dv, qk_l2norm):
            out = torch.empty(t, heads, dim, dtype=x.dtype, device=x.device)
            if t and heads:
                bd = _block(dim)
                gdn_cp_glue_conv_fwd[(triton.cdiv(t, _rows(bd)), heads)](
                    x, x.stride(0), weight_c, bias if bias is not None else weight_c, halo if halo is not None else x,
                    c if halo is None else halo.stride(0), positions, out, t, c0, heads, eps,
                    D=dim, BD=bd, BT=_rows(bd), W=w, HAS_BIAS=bias is not None, HAS_HALO=halo is not None, NORM=norm,
                    num_warps=_warps(bd))
            outs.append(out)
        ctx.save_for_backward(x, weight_c, bias, positions, halo)
        ctx.meta = (k_heads, v_heads, dk, dv, qk_l2norm, eps, weight.dtype)
        return tuple(outs)

    @staticmethod
    def backward(ctx, dq, dk_, dv_):
        x, weight, bias, positions, halo = ctx.saved_tensors
        k_heads, v_heads, dk, dv, qk_l2norm, eps, w_dtype = ctx.meta
        t, c = x.shape
        w = weight.shape[1]
        dx = torch.empty(t, c, dtype=x.dtype, device=x.device)
        run_rows = _rows(_block(max(dk, dv))) * _RUN  # one run length for every group: one dw / db row per run
        programs = max(1, triton.cdiv(t, run_rows))
        dw = torch.zeros(programs, c, w, dtype=torch.float32, device=x.device)
        db = torch.zeros(programs, c, dtype=torch.float32, device=x.device) if bias is not None else None
        dhalo = torch.zeros(w - 1, c, dtype=halo.dtype, device=x.device) if halo is not None else None
        grads = (dq, dk_, dv_)
        for (c0, heads, dim, norm), g in zip(_groups(k_heads, v_heads, dk, dv, qk_l2norm), grads):
            if not (t and heads):
                continue
            g = torch.zeros(t, heads, dim, dtype=x.dtype, device=x.device) if g is None else g.contiguous()
            bd = _block(dim)
            gdn_cp_glue_conv_bwd[(programs, heads)](
                x, x.stride(0), weight, bias if bias is not None else weight, halo if halo is not None else x,
                c if halo is None else halo.stride(0), positions, g, dx, dx.stride(0), dw,
                db if db is not None else dw, dhalo if dhalo is not None else dx, t, c, c0, heads, eps,
                D=dim, BD=bd, BT=_rows(bd), RUN=_RUN, W=w, WP=triton.next_power_of_2(w), HAS_BIAS=bias is not None, HAS_HALO=halo is not None,
                NORM=norm, num_warps=_warps(bd))
        dweight = dw.sum(0).to(w_dtype)
        dbias = db.sum(0).to(bias.dtype) if bias is not None else None
        return dx, dweight, dbias, None, dhalo, None, None, None, None, None, None


def conv_silu_split_triton(x, weight, bias, positions, halo, k_heads: int, v_heads: int, head_k_dim: int,
                           head_v_dim: int, qk_l2norm: bool, eps: float):
    """:func:`gdn_cp.ops.fused.conv_silu_split`'s contract, by the kernels above: ``(q, k, v)``."""
    halo = halo.contiguous() if halo is not None else None
    return _ConvSiluSplit.apply(x, weight, bias, positions, halo, k_heads, v_heads, head_k_dim, head_v_dim,
                                qk_l2norm, eps)
