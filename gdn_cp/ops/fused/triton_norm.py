"""The GDN output's gated RMSNorm, ``RMSNorm(o) * weight * silu(z)`` per head, in one Triton kernel each way that
reads the gate ``z`` where in_proj wrote it (CUDA; the Triton interpreter runs it on the CPU in tests).

``z [T, Hv, Dv]`` is a column view of in_proj's output rows. Megatron's ``_apply_gated_norm`` and FLA's
``rms_norm_gated`` take it as ``[T*Hv, Dv]``: a strided copy forward (kept for backward: ``[T, Hv*Dv]`` more
memory) and, backward, a contiguous ``dz`` that in_proj's gradient then copies in. Here z is read through its
strides, and ``dz`` is written into z's columns of in_proj's output gradient
(:func:`~gdn_cp.ops.fused.split.row_gradient_columns`), or, with ``dz_in_place=False``, into a tensor of its own
that the split's backward copies in: the buffer of in_proj's gradient is then made at the conv's backward, after
the core's, instead of at the norm's (run 2026-12-06a, one H100: in place costs 1.0 GiB more peak at 64K rows per
rank, 0.25 at 16K). The math is FLA's ``rms_norm_gated`` (fp32 inside,
rounded once): ``rstd = 1 / sqrt(mean(o^2) + eps)``, ``y = o * rstd * weight * z * sigmoid(z)``; the weight's
gradient summed per program in fp32, then over programs.

Shapes: ``o [T, Hv, Dv]`` contiguous, ``z [T, Hv, Dv]`` (``z.stride(-1) == 1``), ``weight [Dv]``; the result is
``[T*Hv, Dv]`` contiguous, in o's dtype. Everything is trusted: the boundary that made the call checked it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .split import row_gradient_columns
from .triton_launch import TILE_CONFIGS, launcher

__all__ = ["gated_rms_norm_triton"]


@triton.jit
def gdn_cp_gated_norm_fwd(o_ptr, z_ptr, z_row, z_head, w_ptr, y_ptr, rstd_ptr, R, HEADS, EPS, D: tl.constexpr,
                          BD: tl.constexpr, BT: tl.constexpr):
    """Rows ``[program * BT, +BT)`` of ``y [R = T*HEADS, D]`` and their ``rstd [R]`` (fp32)."""
    r = tl.program_id(0) * BT + tl.arange(0, BT)
    d = tl.arange(0, BD)
    ok = (r < R)[:, None] & (d < D)[None, :]
    x = tl.load(o_ptr + r[:, None].to(tl.int64) * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
    z_at = (r // HEADS).to(tl.int64) * z_row + (r % HEADS) * z_head
    z = tl.load(z_ptr + z_at[:, None] + d[None, :], mask=ok, other=0.0).to(tl.float32)
    rstd = 1 / tl.sqrt(tl.sum(x * x, axis=1) / D + EPS)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * w[None, :]
    y = y * z * tl.sigmoid(z)
    tl.store(rstd_ptr + r, rstd, mask=r < R)
    tl.store(y_ptr + r[:, None].to(tl.int64) * D + d[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def gdn_cp_gated_norm_bwd(o_ptr, z_ptr, z_row, z_head, w_ptr, rstd_ptr, dy_ptr, do_ptr, dz_ptr, dz_row, dz_head,
                          dw_ptr, R, HEADS, SPAN, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr):
    """``do [R, D]``, ``dz`` (through its strides) for rows ``[program * SPAN, +SPAN)``, and those rows' sum of the
    weight's gradient into ``dw [programs, D]`` (fp32)."""
    i_p = tl.program_id(0)
    d = tl.arange(0, BD)
    d_ok = d < D
    w = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    dw = tl.zeros((BT, BD), dtype=tl.float32)
    for i in range(0, SPAN, BT):
        r = i_p * SPAN + i + tl.arange(0, BT)
        r_ok = r < R
        ok = r_ok[:, None] & d_ok[None, :]
        row = r[:, None].to(tl.int64) * D + d[None, :]
        x = tl.load(o_ptr + row, mask=ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + ((r // HEADS).to(tl.int64) * z_row + (r % HEADS) * z_head)[:, None] + d[None, :], mask=ok,
                    other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row, mask=ok, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + r, mask=r_ok, other=0.0)
        xhat = x * rstd[:, None]
        s = tl.sigmoid(z)
        dz = dy * (xhat * w[None, :]) * (s + z * s * (1 - s))
        dy = dy * z * s
        dw += tl.where(ok, dy * xhat, 0.0)
        wdy = dy * w[None, :]
        dx = (wdy - xhat * (tl.sum(xhat * wdy, axis=1) / D)[:, None]) * rstd[:, None]
        tl.store(do_ptr + row, dx.to(do_ptr.dtype.element_ty), mask=ok)
        dz_at = (r // HEADS).to(tl.int64) * dz_row + (r % HEADS) * dz_head
        tl.store(dz_ptr + dz_at[:, None] + d[None, :], dz.to(dz_ptr.dtype.element_ty), mask=ok)
    tl.store(dw_ptr + i_p * D + d, tl.sum(dw, axis=0), mask=d_ok)


_fwd = launcher(gdn_cp_gated_norm_fwd, ["D"], TILE_CONFIGS, {"BT": 16, "num_warps": 4})
_bwd = launcher(gdn_cp_gated_norm_bwd, ["D"], TILE_CONFIGS, {"BT": 16, "num_warps": 4})
_SPAN = 256  # rows per backward program (a multiple of every BT): its weight-gradient sum


class _GatedRmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, z, weight, eps, dz_in_place):
        t, heads, dim = o.shape
        o = o.contiguous()
        rows = t * heads
        y = torch.empty(rows, dim, dtype=o.dtype, device=o.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=o.device)
        if rows:
            _fwd(lambda meta: (triton.cdiv(rows, meta["BT"]),), o, z, z.stride(0), z.stride(1), weight, y, rstd, rows,
                 heads, eps, D=dim, BD=triton.next_power_of_2(dim))
        ctx.save_for_backward(o, z, weight, rstd)
        ctx.dz_in_place = dz_in_place
        return y

    @staticmethod
    def backward(ctx, dy):
        o, z, weight, rstd = ctx.saved_tensors
        t, heads, dim = o.shape
        rows = t * heads
        dy = dy.contiguous()
        do = torch.empty_like(o)
        # z's columns of in_proj's output gradient where z is split_columns' group, or a tensor of its own
        dz = row_gradient_columns(z) if ctx.dz_in_place else torch.empty(z.shape, dtype=z.dtype, device=z.device)
        programs = triton.cdiv(rows, _SPAN)
        dw = torch.zeros(max(programs, 1), dim, dtype=torch.float32, device=o.device)
        if rows:
            _bwd(lambda meta: (programs,), o, z, z.stride(0), z.stride(1), weight, rstd, dy, do, dz, dz.stride(0),
                 dz.stride(1), dw, rows, heads, _SPAN, D=dim, BD=triton.next_power_of_2(dim))
        return do, dz, dw.sum(0).to(weight.dtype), None, None


def gated_rms_norm_triton(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                          dz_in_place: bool = True) -> torch.Tensor:
    """``o, z [T, Hv, Dv]`` (z any head and row stride), ``weight [Dv]`` -> ``[T*Hv, Dv]``: ``o / sqrt(mean(o^2) +
    eps) * weight * silu(z)`` per head, in fp32, rounded once to o's dtype; ``dz_in_place``: z's gradient written
    into in_proj's (module docstring)."""
    if z.stride(-1) != 1:
        z = z.contiguous()
    return _GatedRmsNorm.apply(o, z, weight, eps, dz_in_place)
