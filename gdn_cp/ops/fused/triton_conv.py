"""The conv + SiLU + q/k/v split + l2 norm glue as two hand-written Triton kernels (CUDA; the Triton
interpreter runs them on the CPU in tests).

Forward, one program per (block of rows, head): the causal conv's W taps over the head's channels
(masked at each sequence's first rows, reading the CP halo for the sequence that continues into row 0),
SiLU, rounded to the activations' dtype (where FLA's conv rounds), then, for q and k heads, the l2 norm
over the head dim in fp32, rounded once (where FLA's l2norm rounds); written straight into contiguous
``q, k [T, Hk, Dk]`` and ``v [T, Hv, Dv]``. x is read once; nothing but the inputs is kept for backward. With a
halo, every row is computed as if there were none, then rows 0..W-2 again with it (no other row reads it): its
loads kept out of every other tile (run 2026-12-07n, H100: 0.88x / 0.85x the forward's kernel time at 16K / 64K rows).

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

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .split import row_gradient_columns
from .triton_launch import TILE_CONFIGS, launcher

__all__ = ["MAX_WIDTH", "ConvForm", "conv_silu_split_triton"]

MAX_WIDTH = 4
"""The widest conv the kernels take (they keep four tap sums; Megatron's and FLA's conv widths are at most 4)."""

HALO_ROWS_APART = False
"""On: with a halo, the forward computes every row without it, then rows 0..W-2 again with it (3 more launches of one
tile each) instead of reading it in every tile. Its kernel time is 0.88x / 0.85x at 16K / 64K rows (run 2026-12-07n,
one H100; 0.87x / 0.85x in run 2026-12-07p), but in the layer it was not faster on the rank with a halo (run
2026-12-07q, FlashQLA + TE, rank 1 of CP=2: 12.84 against 12.85 ms at 32K tokens, 49.21 against 48.52 at 128K): off,
by the rule that the layer decides. ``benchmarks/layer_full.py``'s lever ``halo_apart`` turns it on for a row."""

SCAN_HALO_TAIL = False
"""On: with a halo, the backward's scan reads it only in its last rows (the steps whose rows reach below row 0: rows
0..7 of the first span): every other step runs a loop without the halo's loads, masks and stores, so its registers
are those of a rank without a halo. On sm_90 (q: 4 heads of 128 a program, 2 warps, unrolled by 4, as autotuned
in run 2026-12-07r) the loop with the halo in every step spilled 40 bytes a thread and took 530 instructions a step
against 494 without; ncu timed q's scan 21% slower with a halo (165 against 136 us at 16K rows). The same arithmetic,
the same bits. Off until a GPU run times it (``benchmarks/layer_full.py``'s lever ``halo_apart`` switches it on with
:data:`HALO_ROWS_APART`). (Before it, the first span in a launch of its own ran alone after the others: 1.07x the
backward's kernel time at 16K rows, run 2026-12-07p; removed.)"""

SCAN_BRANCH_MASKS = False
"""On: the backward's scan applies each sequence's masks by uniform branches (a row's lags of x masked only where
it is among its sequence's first three; the later rows' gradients zeroed once, at a sequence's start, for every row
below it) and runs the W-1 rows after its span in a loop of its own, instead of selects on every element of every
step (9 of the 62 instructions an element of q's loop on sm_90). The same arithmetic, the same bits. Off until a GPU
run times it (``benchmarks/layer_full.py``'s lever ``scan_branch`` switches it on)."""

FTZ_SIGMOID = False
"""On: the forward and the backward's scan take SiLU's sigmoid with PTX's flush-to-zero approximations
(``ex2.approx.ftz``, ``rcp.approx.ftz``: 4 SASS instructions on sm_90) instead of ``tl.sigmoid``'s full-range forms
(``ex2.approx.f32``, ``div.full.f32``: 12, their range fix-ups around the same MUFU.EX2 and MUFU.RCP), in the same
order of operations. Read from the SASS Triton 3.7.1 compiles: the same bits for every pre-activation above about
-87.3 (below, the sigmoid is subnormal: the full-range form keeps it, this one flushes it to 0); the GPU test checks
them. CUDA only (inline PTX, which the interpreter cannot run). Off until a GPU run times it
(``benchmarks/glue_kernels.py``'s forms ``scan_ftz``, ``scan_branch_ftz``; ``benchmarks/layer_full.py``'s lever
``scan_branch_ftz``)."""
_FTZ_SIGMOID_PTX = tl.constexpr(
    "{ .reg .f32 t; mul.ftz.f32 t, $1, 0fBFB8AA3B; ex2.approx.ftz.f32 t, t; add.ftz.f32 t, t, 0f3F800000; "
    "rcp.approx.ftz.f32 $0, t; }")
"""``1 / (1 + 2^(-y * log2 e))`` as :data:`FTZ_SIGMOID` takes it, written where a kernel takes its sigmoid (no helper
function: Triton's interpreter pays ~0.25 ms for every nested call, and the scan's step would make one more)."""


@triton.jit
def _taps_at(w_ptr, b_ptr, ch, ok, W: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The four taps and the bias of the channels ``ch`` (a tile of any shape; masked by ``ok``) in fp32."""
    at = w_ptr + ch * W
    t0 = tl.load(at, mask=ok, other=0.0).to(tl.float32)
    t1 = tl.load(at + 1, mask=ok & (W > 1), other=0.0).to(tl.float32)
    t2 = tl.load(at + 2, mask=ok & (W > 2), other=0.0).to(tl.float32)
    t3 = tl.load(at + 3, mask=ok & (W > 3), other=0.0).to(tl.float32)
    bias = tl.load(b_ptr + ch, mask=ok & HAS_BIAS, other=0.0).to(tl.float32)
    return t0, t1, t2, t3, bias


@triton.jit
def _pick(j, t0, t1, t2, t3):
    """Tap ``j`` (a compile-time index) of the four."""
    if j == 0:
        return t0
    elif j == 1:
        return t1
    elif j == 2:
        return t2
    else:
        return t3


@triton.jit
def _x_rows(x_ptr, x_stride, halo_ptr, halo_stride, rows, pos, row_ok, first, ch, d_ok, shift: tl.constexpr,
            W: tl.constexpr, HAS_HALO: tl.constexpr):
    """x at ``rows - shift`` ``[BT, BD]`` in x's dtype, masked as the forward reads it (each sequence's start; the
    halo for the sequence that starts at row 0)."""
    src = rows - shift
    xv = tl.load(x_ptr + src[:, None].to(tl.int64) * x_stride + ch[None, :],
                 mask=(row_ok & (pos >= shift))[:, None] & d_ok[None, :], other=0.0)
    if HAS_HALO:  # exclusive masks: one of the two is zero, so the sum in x's dtype is exact
        xv += tl.load(halo_ptr + (src + W - 1)[:, None] * halo_stride + ch[None, :],
                      mask=(row_ok & first & (src < 0))[:, None] & d_ok[None, :], other=0.0).to(xv.dtype)
    return xv


@triton.jit
def _conv_tile(x_ptr, x_stride, w_ptr, b_ptr, halo_ptr, halo_stride, rows, pos, row_ok, ch, d_ok, W: tl.constexpr,
               HAS_BIAS: tl.constexpr, HAS_HALO: tl.constexpr):
    """The conv's pre-activation ``[BT, BD]`` fp32 at ``rows`` (int32 [BT]) for channels ``ch`` ([BD])."""
    acc = tl.zeros((rows.shape[0], ch.shape[0]), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + ch, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    first = pos == rows  # rows of the sequence that starts at row 0 (continues into the halo)
    for j in tl.static_range(W):
        tap = tl.load(w_ptr + ch * W + j, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        acc += tap * _x_rows(x_ptr, x_stride, halo_ptr, halo_stride, rows, pos, row_ok, first, ch, d_ok, W - 1 - j,
                             W, HAS_HALO).to(tl.float32)
    return acc


@triton.jit
def _silu_tile(x_ptr, x_stride, w_ptr, b_ptr, halo_ptr, halo_stride, pos_ptr, out_ptr, T, C0, D: tl.constexpr,
               BD: tl.constexpr, BT: tl.constexpr, W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_HALO: tl.constexpr,
               FTZ: tl.constexpr = False):
    """This program's tile (rows ``program_id(0)``, head ``program_id(1)`` of the channels from ``C0``): its rows,
    channels, their masks, and the conv + SiLU ``[BT, BD]`` fp32, rounded to ``out``'s dtype as FLA's conv rounds."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    d = tl.arange(0, BD)
    row_ok, d_ok = rows < T, d < D
    ch = C0 + tl.program_id(1) * D + d
    pos = tl.load(pos_ptr + rows, mask=row_ok, other=0)
    y = _conv_tile(x_ptr, x_stride, w_ptr, b_ptr, halo_ptr, halo_stride, rows, pos, row_ok, ch, d_ok, W, HAS_BIAS,
                   HAS_HALO)
    if FTZ:  # FTZ_SIGMOID
        s = tl.inline_asm_elementwise(_FTZ_SIGMOID_PTX, "=r,r", [y], dtype=tl.float32, is_pure=True, pack=1)
    else:
        s = tl.sigmoid(y)
    return rows, d, row_ok, d_ok, (y * s).to(out_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def gdn_cp_glue_conv_fwd(x_ptr, x_stride, w_ptr, b_ptr, halo_ptr, halo_stride, pos_ptr, out_ptr, T, C0, HEADS, EPS,
                D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, W: tl.constexpr, HAS_BIAS: tl.constexpr,
                HAS_HALO: tl.constexpr, NORM: tl.constexpr, REPEAT: tl.constexpr, FTZ: tl.constexpr = False):
    """``out [T, HEADS * REPEAT, D]`` <- head ``program_id(1)`` of the channels starting at ``C0``, written
    ``REPEAT`` times (heads ``h * REPEAT + j``: :func:`_store_copies`); ``FTZ``: :data:`FTZ_SIGMOID`."""
    i_h = tl.program_id(1)
    rows, d, row_ok, d_ok, a = _silu_tile(x_ptr, x_stride, w_ptr, b_ptr, halo_ptr, halo_stride, pos_ptr, out_ptr, T,
                                          C0, D, BD, BT, W, HAS_BIAS, HAS_HALO, FTZ)
    if NORM:
        a = a * tl.rsqrt(tl.sum(a * a, axis=1) + EPS)[:, None]
    _store_copies(out_ptr, rows[:, None].to(tl.int64) * HEADS + i_h, d[None, :], a.to(out_ptr.dtype.element_ty),
                  row_ok[:, None] & d_ok[None, :], D, REPEAT)


@triton.jit
def _store_copies(out_ptr, row_head, d, value, ok, D: tl.constexpr, REPEAT: tl.constexpr):
    """``value`` at (row, head) ``row_head`` (``row * HEADS + head``, int64) of ``out [T, HEADS * REPEAT, D]``, once per
    copy: heads ``head * REPEAT + j``, as ``repeat_interleave(REPEAT, dim=1)`` lays q and k out for a kernel that
    reads them at the value heads (``kv_repeat``: :func:`conv_silu_split_triton`)."""
    for j in tl.static_range(REPEAT):
        tl.store(out_ptr + (row_head * REPEAT + j) * D + d, value, mask=ok)


@triton.jit
def _load_gradient(dout_ptr, row_head, d, ok, D: tl.constexpr, REPEAT: tl.constexpr):
    """The output gradient at (row, head) ``row_head`` in dout's dtype: with copies (``REPEAT`` > 1) the sum of theirs,
    in fp32 in head order, rounded once (what autograd hands back through ``repeat_interleave``); zeros outside
    ``ok``."""
    base = row_head * REPEAT
    g = tl.load(dout_ptr + base * D + d, mask=ok, other=0.0)
    if REPEAT > 1:
        total = g.to(tl.float32)
        for j in tl.static_range(1, REPEAT):
            total += tl.load(dout_ptr + (base + j) * D + d, mask=ok, other=0.0).to(tl.float32)
        g = total.to(dout_ptr.dtype.element_ty)
    return g


@triton.jit
def _l2norm_gradient(a, da, EPS):
    """The gradient at the SiLU output ``a [BT, BD]`` (fp32, rounded where the forward rounds) from the gradient
    ``da`` at its l2 norm over each row, in fp32 (rounded by the caller to the activations' dtype, as FLA's l2norm
    backward returns it)."""
    r = tl.rsqrt(tl.sum(a * a, axis=1) + EPS)
    n = a * r[:, None]
    return r[:, None] * (da - n * tl.sum(da * n, axis=1)[:, None])


@triton.jit
def _silu_gradient(y, da, ok, dout_ptr, EPS, NORM: tl.constexpr, FTZ: tl.constexpr = False):
    """The gradient at the conv's pre-activation ``y`` (fp32, any 2-D tile whose rows are heads' vectors) from the
    output gradient ``da`` (fp32): through the l2 norm over each row where ``NORM`` (rounded to the output dtype
    as FLA's l2norm backward returns it), then SiLU; zeros outside ``ok``. ``FTZ``: :data:`FTZ_SIGMOID`."""
    if FTZ:
        s = tl.inline_asm_elementwise(_FTZ_SIGMOID_PTX, "=r,r", [y], dtype=tl.float32, is_pure=True, pack=1)
    else:
        s = tl.sigmoid(y)
    if NORM:
        a = (y * s).to(dout_ptr.dtype.element_ty).to(tl.float32)
        da = _l2norm_gradient(a, da, EPS)
        da = da.to(dout_ptr.dtype.element_ty).to(tl.float32)  # FLA's l2norm backward returns x's dtype
    return tl.where(ok, da * (s * (1.0 + y * (1.0 - s))), 0.0)


@triton.jit
def _pre_gradient(y, dout_ptr, rows, row_ok, i_h, HEADS, d, d_ok, EPS, D: tl.constexpr, NORM: tl.constexpr,
                  REPEAT: tl.constexpr):
    """From the conv's pre-activation ``y [BT, BD]`` (fp32) and the output gradient at ``rows``: the gradient at
    ``y`` through SiLU, its rounding to the output dtype as FLA's conv rounds, and the l2 norm where ``NORM``."""
    ok = row_ok[:, None] & d_ok[None, :]
    da = _load_gradient(dout_ptr, rows[:, None].to(tl.int64) * HEADS + i_h, d[None, :], ok, D, REPEAT).to(tl.float32)
    return _silu_gradient(y, da, ok, dout_ptr, EPS, NORM)


@triton.jit
def _dpre_tile(x_ptr, x_stride, w_ptr, b_ptr, halo_ptr, halo_stride, pos_ptr, dout_ptr, rows, T, i_h, HEADS, ch,
               d, d_ok, EPS, D: tl.constexpr, W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_HALO: tl.constexpr,
               NORM: tl.constexpr, REPEAT: tl.constexpr):
    """The gradient at the conv's pre-activation ``[BT, BD]`` fp32 for ``rows`` (zeros outside [0, T))."""
    row_ok = (rows >= 0) & (rows < T)
    pos = tl.load(pos_ptr + rows, mask=row_ok, other=0)
    y = _conv_tile(x_ptr, x_stride, w_ptr, b_ptr, halo_ptr, halo_stride, rows, pos, row_ok, ch, d_ok, W, HAS_BIAS,
                   HAS_HALO)
    return _pre_gradient(y, dout_ptr, rows, row_ok, i_h, HEADS, d, d_ok, EPS, D, NORM, REPEAT)


@triton.jit
def _tap_sums(x_ptr, x_stride, halo_ptr, halo_stride, pos_ptr, rows, T, ch, d_ok, pre, acc0, acc1, acc2, acc3,
              W: tl.constexpr, HAS_HALO: tl.constexpr):
    """The tap gradients' per-row sums with one more tile: ``acc_k += pre * x[t - k]`` (tap W-1-k) at ``rows``, x
    masked as the forward reads it (each sequence's start; the halo for the sequence that starts at row 0)."""
    row_ok = rows < T
    pos = tl.load(pos_ptr + rows, mask=row_ok, other=0)
    first = pos == rows
    for j in tl.static_range(W):
        xv = _x_rows(x_ptr, x_stride, halo_ptr, halo_stride, rows, pos, row_ok, first, ch, d_ok, W - 1 - j, W,
                     HAS_HALO).to(tl.float32)
        if j == W - 1:
            acc0 += pre * xv
        elif j == W - 2:
            acc1 += pre * xv
        elif j == W - 3:
            acc2 += pre * xv
        else:
            acc3 += pre * xv
    return acc0, acc1, acc2, acc3


@triton.jit
def _store_sums(dw_ptr, db_ptr, i_p, width, local, d_ok, acc0, acc1, acc2, acc3, accb, W: tl.constexpr,
                HAS_BIAS: tl.constexpr):
    """Program ``i_p``'s tap and bias sums, reduced over rows, into ``dw [programs, width, W]``, ``db [programs,
    width]`` at channels ``local``."""
    base = dw_ptr + (i_p * width + local).to(tl.int64) * W
    tl.store(base + (W - 1), tl.sum(acc0, axis=0), mask=d_ok)
    if W >= 2:
        tl.store(base + (W - 2), tl.sum(acc1, axis=0), mask=d_ok)
    if W >= 3:
        tl.store(base + (W - 3), tl.sum(acc2, axis=0), mask=d_ok)
    if W >= 4:
        tl.store(base + (W - 4), tl.sum(acc3, axis=0), mask=d_ok)
    if HAS_BIAS:
        tl.store(db_ptr + i_p * width + local, tl.sum(accb, axis=0), mask=d_ok)


@triton.jit
def gdn_cp_glue_conv_bwd_pre(x_ptr, x_stride, w_ptr, b_ptr, halo_ptr, halo_stride, pos_ptr, dout_ptr, pre_ptr, dw_ptr,
                             db_ptr, T, ROW0, ROWS, SUM_END, C0, HEADS, EPS, D: tl.constexpr, BD: tl.constexpr,
                             BT: tl.constexpr, SPAN: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
                             HAS_BIAS: tl.constexpr, HAS_HALO: tl.constexpr, NORM: tl.constexpr, REPEAT: tl.constexpr):
    """The gradient at the conv's pre-activation of rows ``[ROW0, ROW0 + ROWS)``, head ``program_id(1)``, into
    ``pre [ROWS, HEADS*D]`` (fp32), and the sums over this program's ``SPAN`` rows (those below ``SUM_END``) of
    the tap and bias gradients into ``dw [programs, HEADS*D, W]``, ``db [programs, HEADS*D]`` (fp32). The sums
    stay per row in registers across the program's tiles and are reduced over rows once, at the end. (Two other
    forms, the tap tiles loaded once and the sums reduced per tile, were measured slower in the layer on an H200
    and removed: docs/performance.md, run 2026-12-05a.)"""
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, BD)
    d_ok = d < D
    ch = C0 + i_h * D + d
    local = i_h * D + d  # the channel in the group (pre, dw, db)
    acc0 = tl.zeros((BT, BD), dtype=tl.float32)  # sums of pre * x[t - k], k = 0..3 (tap W-1-k)
    acc1 = tl.zeros((BT, BD), dtype=tl.float32)
    acc2 = tl.zeros((BT, BD), dtype=tl.float32)
    acc3 = tl.zeros((BT, BD), dtype=tl.float32)
    accb = tl.zeros((BT, BD), dtype=tl.float32)
    for it in range(SPAN // BT):
        rel = i_p * SPAN + it * BT + tl.arange(0, BT)
        rows = ROW0 + rel
        pre = _dpre_tile(x_ptr, x_stride, w_ptr, b_ptr, halo_ptr, halo_stride, pos_ptr, dout_ptr, rows, T, i_h,
                         HEADS, ch, d, d_ok, EPS, D, W, HAS_BIAS, HAS_HALO, NORM, REPEAT)
        row_ok = rel < ROWS
        tl.store(pre_ptr + rel[:, None].to(tl.int64) * (HEADS * D) + local[None, :], pre,
                 mask=row_ok[:, None] & d_ok[None, :])
        pre = tl.where((row_ok & (rows < SUM_END))[:, None], pre, 0.0)
        accb += pre
        acc0, acc1, acc2, acc3 = _tap_sums(x_ptr, x_stride, halo_ptr, halo_stride, pos_ptr, rows, T, ch, d_ok, pre,
                                           acc0, acc1, acc2, acc3, W, HAS_HALO)
    _store_sums(dw_ptr, db_ptr, i_p, HEADS * D, local, d_ok, acc0, acc1, acc2, acc3, accb, W, HAS_BIAS)


@triton.jit
def gdn_cp_glue_conv_bwd_dx(pre_ptr, w_ptr, pos_ptr, dx_ptr, dx_stride, T, ROW0, ROWS, END, C0, WIDTH,
                            BT: tl.constexpr, BC: tl.constexpr, W: tl.constexpr):
    """``dx[t] = sum_s w[:, W-1-s] * pre[t + s]`` (t + s in t's sequence) for rows ``[ROW0, ROW0 + ROWS)`` and
    channels ``C0 + [0, WIDTH)``; ``pre`` holds rows ``[ROW0, END)``."""
    rows = ROW0 + tl.program_id(0) * BT + tl.arange(0, BT)
    cc = tl.program_id(1) * BC + tl.arange(0, BC)
    c_ok = cc < WIDTH
    dx = tl.zeros((BT, BC), dtype=tl.float32)
    for s in tl.static_range(W):
        later = rows + s
        keep = (later < END) & (tl.load(pos_ptr + later, mask=later < END, other=0) >= s)
        pre = tl.load(pre_ptr + (later - ROW0)[:, None].to(tl.int64) * WIDTH + cc[None, :],
                      mask=keep[:, None] & c_ok[None, :], other=0.0)
        tap = tl.load(w_ptr + (C0 + cc) * W + (W - 1 - s), mask=c_ok, other=0.0).to(tl.float32)
        dx += tap[None, :] * pre
    tl.store(dx_ptr + rows[:, None].to(tl.int64) * dx_stride + (C0 + cc)[None, :], dx.to(dx_ptr.dtype.element_ty),
             mask=(rows < ROW0 + ROWS)[:, None] & c_ok[None, :])


@triton.jit
def gdn_cp_glue_conv_bwd(x_ptr, x_stride, w_ptr, b_ptr, halo_ptr, halo_stride, pos_ptr, dout_ptr, dx_ptr, dx_stride,
                         scratch_ptr, head_ptr, dw_ptr, db_ptr, T, SPAN, C0, HEADS, EPS, D: tl.constexpr,
                         BD: tl.constexpr, BT: tl.constexpr, W: tl.constexpr, HAS_BIAS: tl.constexpr,
                         HAS_HALO: tl.constexpr, NORM: tl.constexpr, REPEAT: tl.constexpr):
    """The whole backward of head ``program_id(1)`` over rows ``[p * SPAN, (p + 1) * SPAN)`` in one pass: ``dx``
    of those rows (bf16 / fp16 / fp32, written once), the tap and bias sums into ``dw [programs, HEADS*D, W]``,
    ``db [programs, HEADS*D]`` and, with a halo, the pre-activation gradient of rows ``[0, W-1)`` into
    ``head [W-1, HEADS*D]`` (fp32). dx at row t reads the pre-activation gradient of rows t..t+W-1, which no
    register tile can shift to: each tile's is kept in this program's ``scratch [BT + 4, BD]`` (fp32, L1/L2
    resident), rows ``[BT, BT + 4)`` holding the W-1 rows after the tile. The tiles run last to first, so those
    rows are the previous tile's first; the span's last tile reads four rows computed up front (rows past T are
    zeros). Nothing ``[T, C]``-sized in fp32 is written (the two-pass form writes and reads one)."""
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, BD)
    d_ok = d < D
    ch = C0 + i_h * D + d
    local = i_h * D + d  # the channel in the group (head, dw, db)
    width = HEADS * D
    scratch = scratch_ptr + (i_p * HEADS + i_h).to(tl.int64) * ((BT + 4) * BD)
    tile = tl.arange(0, BT)
    after = tl.arange(0, 4)
    span0 = i_p * SPAN
    tail = _dpre_tile(x_ptr, x_stride, w_ptr, b_ptr, halo_ptr, halo_stride, pos_ptr, dout_ptr, span0 + SPAN + after,
                      T, i_h, HEADS, ch, d, d_ok, EPS, D, W, HAS_BIAS, HAS_HALO, NORM, REPEAT)
    tl.store(scratch + (BT + after)[:, None] * BD + d[None, :], tail)
    acc0 = tl.zeros((BT, BD), dtype=tl.float32)  # sums of pre * x[t - k], k = 0..3 (tap W-1-k)
    acc1 = tl.zeros((BT, BD), dtype=tl.float32)
    acc2 = tl.zeros((BT, BD), dtype=tl.float32)
    acc3 = tl.zeros((BT, BD), dtype=tl.float32)
    accb = tl.zeros((BT, BD), dtype=tl.float32)
    tiles = SPAN // BT
    for i in range(tiles):
        rows = span0 + (tiles - 1 - i) * BT + tile
        row_ok = rows < T
        pre = _dpre_tile(x_ptr, x_stride, w_ptr, b_ptr, halo_ptr, halo_stride, pos_ptr, dout_ptr, rows, T, i_h, HEADS,
                         ch, d, d_ok, EPS, D, W, HAS_BIAS, HAS_HALO, NORM, REPEAT)  # 0 at rows >= T
        accb += pre
        acc0, acc1, acc2, acc3 = _tap_sums(x_ptr, x_stride, halo_ptr, halo_stride, pos_ptr, rows, T, ch, d_ok, pre,
                                           acc0, acc1, acc2, acc3, W, HAS_HALO)
        if HAS_HALO:
            tl.store(head_ptr + rows[:, None] * width + local[None, :], pre, mask=(rows < W - 1)[:, None] & d_ok[None, :])
        tl.store(scratch + tile[:, None] * BD + d[None, :], pre)
        tl.debug_barrier()  # the tile's rows, written by every thread, read shifted by others
        dx = tl.zeros((BT, BD), dtype=tl.float32)
        for s in tl.static_range(W):  # dx[t] = sum_s w[:, W-1-s] * pre[t + s], t + s in t's sequence
            later = rows + s
            keep = (later < T) & (tl.load(pos_ptr + later, mask=later < T, other=0) >= s)
            shifted = tl.load(scratch + (tile + s)[:, None] * BD + d[None, :], mask=keep[:, None], other=0.0)
            tap = tl.load(w_ptr + ch * W + (W - 1 - s), mask=d_ok, other=0.0).to(tl.float32)[None, :]
            dx += tap * shifted
        carried = tl.load(scratch + after[:, None] * BD + d[None, :])  # the W-1 rows after the next tile down
        tl.debug_barrier()
        tl.store(scratch + (BT + after)[:, None] * BD + d[None, :], carried)
        tl.store(dx_ptr + rows[:, None].to(tl.int64) * dx_stride + ch[None, :], dx.to(dx_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
    _store_sums(dw_ptr, db_ptr, i_p, width, local, d_ok, acc0, acc1, acc2, acc3, accb, W, HAS_BIAS)


@triton.jit
def _x_row(x_ptr, x_stride, halo_ptr, halo_stride, r, T, ch, ok, W: tl.constexpr, HAS_HALO: tl.constexpr):
    """x at row ``r`` (a scalar; the halo's row ``r + W - 1`` where ``r < 0``; zeros past T) at channels ``ch``,
    unmasked by sequence: the caller masks each lag by the row it feeds."""
    xv = tl.load(x_ptr + r.to(tl.int64) * x_stride + ch, mask=ok & (r >= 0) & (r < T), other=0.0)
    if HAS_HALO:
        xv += tl.load(halo_ptr + (r + W - 1) * halo_stride + ch, mask=ok & (r < 0) & (r > -W), other=0.0).to(xv.dtype)
    return xv


@triton.jit
def _dout_row(dout_ptr, r, HEADS, h, d, ok, D: tl.constexpr, REPEAT: tl.constexpr):
    """The output gradient ``dout [T, HEADS * REPEAT, D]`` at row ``r`` (clamped to 0: a row below the first is never
    used) for heads ``h`` ``[HB, BD]`` (:func:`_load_gradient`)."""
    return _load_gradient(dout_ptr, (tl.maximum(r, 0) * HEADS + h[:, None]).to(tl.int64), d[None, :], ok, D, REPEAT)


@triton.jit
def _lag_tap(k: tl.constexpr, taps, W: tl.constexpr):
    """The tap that reads ``x[t - k]`` (``w[:, W-1-k]``; zeros for k >= W)."""
    if k < W:
        return _pick(W - 1 - k, taps[0], taps[1], taps[2], taps[3])
    else:
        return taps[0] * 0.0


@triton.jit
def _lag_taps(taps, W: tl.constexpr):
    """The taps that read ``x[t - k]`` for k = 0..3 (:func:`_lag_tap`), picked once before a scan's loop."""
    return _lag_tap(0, taps, W), _lag_tap(1, taps, W), _lag_tap(2, taps, W), _lag_tap(3, taps, W)


@triton.jit
def _lagged(x0, x1, x2, x3, pos, t):
    """x[t - k] (k = 0..3, raw rows of x or the halo) as the forward reads them at row ``t`` (position ``pos``):
    zeros before the sequence's start, but for the sequence that starts at row 0, which reads the halo; fp32."""
    first = pos == t
    e1 = tl.where((pos >= 1) | (first & (t < 1)), x1, 0.0).to(tl.float32)
    e2 = tl.where((pos >= 2) | (first & (t < 2)), x2, 0.0).to(tl.float32)
    e3 = tl.where((pos >= 3) | (first & (t < 3)), x3, 0.0).to(tl.float32)
    return x0.to(tl.float32), e1, e2, e3


@triton.jit
def _masked_by_branch(x0, x1, x2, x3, p1, p2, p3, pos, pos1, t):
    """:func:`_lagged`'s values of x, and the later rows' pre-activation gradients ``p1..p3`` (rows t+1..t+3)
    zeroed where a sequence starts at row t+1 (``pos1 == 0``; kept so: no row below t reaches past that start),
    both in one uniform branch taken only at a sequence's first three rows and its last (:data:`SCAN_BRANCH_MASKS`)
    instead of selects on every element of every row. Returns ``(e0, e1, e2, e3, p1, p2, p3)``, fp32."""
    e0, e1, e2, e3 = x0.to(tl.float32), x1.to(tl.float32), x2.to(tl.float32), x3.to(tl.float32)
    if (pos < 3) | (pos1 == 0):
        e0, e1, e2, e3 = _lagged(x0, x1, x2, x3, pos, t)
        p1, p2, p3 = tl.where(pos1 == 0, 0.0, p1), tl.where(pos1 == 0, 0.0, p2), tl.where(pos1 == 0, 0.0, p3)
    return e0, e1, e2, e3, p1, p2, p3


@triton.jit
def _conv_row(bias, lag0, lag1, lag2, lag3, e0, e1, e2, e3, W: tl.constexpr):
    """The conv's pre-activation at one row (fp32) in :func:`_conv_tile`'s order: the bias, then tap 0 (the
    oldest row) first."""
    y = bias
    if W > 3:
        y += lag3 * e3
    if W > 2:
        y += lag2 * e2
    if W > 1:
        y += lag1 * e1
    y += lag0 * e0
    return y


@triton.jit
def _scan_step(t, x_ptr, x_stride, halo_ptr, halo_stride, pos_ptr, dout_ptr, dx_ptr, dx_stride, head_ptr, T, end, HEADS,
               EPS, h, d, ok, ch, local, bias, lag0, lag1, lag2, lag3, x0, x1, x2, x3, x4, x5, x6, x7, da, da1, da2, da3,
               da4, pos, pos_1, pos_2, pos_3, pos_4, p1, p2, p3, pos1, pos2, pos3, acc0, acc1, acc2, acc3, accb,
               D: tl.constexpr, W: tl.constexpr, NORM: tl.constexpr, REPEAT: tl.constexpr, READ_HALO: tl.constexpr,
               BRANCH: tl.constexpr = False, MINE: tl.constexpr = None, FTZ: tl.constexpr = False):
    """One step of :func:`gdn_cp_glue_conv_bwd_scan` at row ``t``: loads row t-8's x and row t-5's gradient and
    position (four steps ahead), writes dx at t where t is a row of the span (``t < end``) and, where ``READ_HALO``,
    reads x below row 0 from the halo and writes the pre-activation gradient of rows 0..W-2 (``head``). Returns the
    state rolled one row down: x at t-1..t-8, the gradient and position at t-1..t-5, the pre-activation gradient and
    position at t..t-2 (the next step's t+1..t+3), the sums. ``BRANCH`` (:data:`SCAN_BRANCH_MASKS`): the
    sequence masks by uniform branches (x's lags at a sequence's first rows; the later rows' gradients zeroed once,
    where a sequence starts above t: no row below reaches past a start), and ``MINE`` (True / False: every step of
    the loop is / is not a row of the span; None: each step asks) instead of a select an element: the same bits.
    ``FTZ`` (:data:`FTZ_SIGMOID`): the sigmoid in flush-to-zero approximations."""
    x_next = _x_row(x_ptr, x_stride, halo_ptr, halo_stride, t - 8, T, ch, ok, W, READ_HALO)
    da_next = _dout_row(dout_ptr, t - 5, HEADS, h, d, ok, D, REPEAT)
    pos_next = tl.load(pos_ptr + tl.maximum(t - 5, 0))  # (rows below the span: loaded, never stepped to)
    if BRANCH:
        e0, e1, e2, e3, p1, p2, p3 = _masked_by_branch(x0, x1, x2, x3, p1, p2, p3, pos, pos1, t)
    else:
        e0, e1, e2, e3 = _lagged(x0, x1, x2, x3, pos, t)
    y = _conv_row(bias, lag0, lag1, lag2, lag3, e0, e1, e2, e3, W)
    # (with BRANCH, lanes outside ok need no select: their x, taps and gradient load as 0, so their pre is 0)
    pre = _silu_gradient(y, da.to(tl.float32), True if BRANCH else ok, dout_ptr, EPS, NORM, FTZ)
    if MINE is None or MINE:  # a row of this span (not one of the W-1 after it)
        if BRANCH:
            u1, u2, u3 = p1, p2, p3
        else:
            u1, u2, u3 = tl.where(pos1 >= 1, p1, 0.0), tl.where(pos2 >= 2, p2, 0.0), tl.where(pos3 >= 3, p3, 0.0)
        dx = tl.zeros(pre.shape, dtype=tl.float32)
        dx += lag0 * pre  # dx[t] = sum_s w[:, W-1-s] * pre[t + s], t + s in t's sequence
        dx += lag1 * u1
        dx += lag2 * u2
        if W > 3:
            dx += lag3 * u3
        mine = t < end if MINE is None else True
        tl.store(dx_ptr + t.to(tl.int64) * dx_stride + ch, dx.to(dx_ptr.dtype.element_ty), mask=ok & mine)
    if READ_HALO:
        tl.store(head_ptr + t * (HEADS * D) + local, pre, mask=ok & (t < W - 1))
    if MINE is None or MINE:
        summed = tl.where(t < end, pre, 0.0) if MINE is None else pre
        accb += summed
        acc0 += summed * e0
        acc1 += summed * e1
        acc2 += summed * e2
        acc3 += summed * e3
    return (x1, x2, x3, x4, x5, x6, x7, x_next, da1, da2, da3, da4, da_next, pos_1, pos_2, pos_3, pos_4, pos_next,
            pre, p1, p2, pos, pos1, pos2, acc0, acc1, acc2, acc3, accb)


@triton.jit
def gdn_cp_glue_conv_bwd_scan(x_ptr, x_stride, w_ptr, b_ptr, halo_ptr, halo_stride, pos_ptr, dout_ptr, dx_ptr,
                              dx_stride, head_ptr, dw_ptr, db_ptr, T, SPAN, C0, HEADS, EPS, D: tl.constexpr,
                              BD: tl.constexpr, HB: tl.constexpr, W: tl.constexpr, HAS_BIAS: tl.constexpr,
                              HAS_HALO: tl.constexpr, NORM: tl.constexpr, REPEAT: tl.constexpr, UNROLL: tl.constexpr,
                              HALO_TAIL: tl.constexpr, BRANCH: tl.constexpr = False, FTZ: tl.constexpr = False):
    """The whole backward of heads ``[program_id(1) * HB, +HB)`` over rows ``[p * SPAN, (p + 1) * SPAN)`` as a scan
    down the rows, one row a step (``ConvForm.scan``): each step's tile is ``[HB, BD]``, the program's heads at one
    row, so a thread keeps the same channels at every row and the conv's shifts in time are registers: the last
    four rows' x and the next three rows' pre-activation gradient roll from step to step (no scratch tile, no
    barrier, sums ``[HB, BD]`` instead of ``[BT, BD]``). Each step loads the rows four steps ahead before its
    arithmetic, so a program keeps four rows' loads in flight. The span's first W-1 steps are the W-1 rows after
    it (their gradient feeds dx of its last rows; nothing of theirs is written). Writes ``dx`` (the same arithmetic
    in the same order for each element as :func:`gdn_cp_glue_conv_bwd`, so the same bits), the per-span tap and bias
    sums ``dw [programs, HEADS*D, W]``, ``db [programs, HEADS*D]`` (fp32) and, with a halo, the pre-activation
    gradient of rows 0..W-2, ``head [W-1, HEADS*D]`` fp32, from which :func:`_halo_gradient` sums the halo's. (On
    sm_90 at 4 warps, computing the halo's gradient here after the scan took 146 registers against 128.) ``UNROLL``
    steps a loop pass (Triton's ``loop_unroll_factor``): unrolled, the rolling windows are renamed, not moved (sm_90,
    4 heads, 4 warps: 280 instructions a step at 4 against 339, 168 registers against 126). ``HALO_TAIL`` (with a
    halo): the steps of rows 8 and up in a loop that never reads the halo, the rows below in a second loop that does
    (:data:`SCAN_HALO_TAIL`); one step is :func:`_scan_step` either way. ``BRANCH`` (:data:`SCAN_BRANCH_MASKS`):
    the sequence masks by uniform branches, and the W-1 rows after the span in a loop of their own (no dx, no sums)
    before the span's rows, which then need no mask of their own. ``FTZ`` (:data:`FTZ_SIGMOID`): the sigmoid in
    flush-to-zero approximations."""
    i_p, i_b = tl.program_id(0), tl.program_id(1)
    h = i_b * HB + tl.arange(0, HB)
    d = tl.arange(0, BD)
    ok = (h < HEADS)[:, None] & (d < D)[None, :]
    local = h[:, None] * D + d[None, :]  # the channel in the group (dw, db, head)
    ch = C0 + local
    taps = _taps_at(w_ptr, b_ptr, ch, ok, W, HAS_BIAS)
    lag0, lag1, lag2, lag3 = _lag_taps(taps, W)
    span0 = i_p * SPAN
    end = tl.minimum(span0 + SPAN, T)
    top = tl.minimum(end + W - 2, T - 1)
    # raw x[t - k] for k = 0..7 (the window, then four rows loaded ahead), dout and the position at t - k for
    # k = 0..4: each step loads the rows four steps below it, so four rows' loads are in flight at every step
    x0 = _x_row(x_ptr, x_stride, halo_ptr, halo_stride, top, T, ch, ok, W, HAS_HALO)
    x1 = _x_row(x_ptr, x_stride, halo_ptr, halo_stride, top - 1, T, ch, ok, W, HAS_HALO)
    x2 = _x_row(x_ptr, x_stride, halo_ptr, halo_stride, top - 2, T, ch, ok, W, HAS_HALO)
    x3 = _x_row(x_ptr, x_stride, halo_ptr, halo_stride, top - 3, T, ch, ok, W, HAS_HALO)
    x4 = _x_row(x_ptr, x_stride, halo_ptr, halo_stride, top - 4, T, ch, ok, W, HAS_HALO)
    x5 = _x_row(x_ptr, x_stride, halo_ptr, halo_stride, top - 5, T, ch, ok, W, HAS_HALO)
    x6 = _x_row(x_ptr, x_stride, halo_ptr, halo_stride, top - 6, T, ch, ok, W, HAS_HALO)
    x7 = _x_row(x_ptr, x_stride, halo_ptr, halo_stride, top - 7, T, ch, ok, W, HAS_HALO)
    da = _dout_row(dout_ptr, top, HEADS, h, d, ok, D, REPEAT)
    da1 = _dout_row(dout_ptr, top - 1, HEADS, h, d, ok, D, REPEAT)
    da2 = _dout_row(dout_ptr, top - 2, HEADS, h, d, ok, D, REPEAT)
    da3 = _dout_row(dout_ptr, top - 3, HEADS, h, d, ok, D, REPEAT)
    da4 = _dout_row(dout_ptr, top - 4, HEADS, h, d, ok, D, REPEAT)
    pos = tl.load(pos_ptr + top)
    pos_1 = tl.load(pos_ptr + tl.maximum(top - 1, 0))
    pos_2 = tl.load(pos_ptr + tl.maximum(top - 2, 0))
    pos_3 = tl.load(pos_ptr + tl.maximum(top - 3, 0))
    pos_4 = tl.load(pos_ptr + tl.maximum(top - 4, 0))
    p1 = tl.zeros((HB, BD), dtype=tl.float32)  # pre-activation gradient at t + 1, t + 2, t + 3 (0 past T)
    p2 = tl.zeros((HB, BD), dtype=tl.float32)
    p3 = tl.zeros((HB, BD), dtype=tl.float32)
    pos1 = pos * 0  # their positions (0 past T: no later row reaches back past it)
    pos2 = pos * 0
    pos3 = pos * 0
    acc0 = tl.zeros((HB, BD), dtype=tl.float32)  # sums of pre * x[t - k] (tap W-1-k)
    acc1 = tl.zeros((HB, BD), dtype=tl.float32)
    acc2 = tl.zeros((HB, BD), dtype=tl.float32)
    acc3 = tl.zeros((HB, BD), dtype=tl.float32)
    accb = tl.zeros((HB, BD), dtype=tl.float32)
    state = (x0, x1, x2, x3, x4, x5, x6, x7, da, da1, da2, da3, da4, pos, pos_1, pos_2, pos_3, pos_4, p1, p2, p3,
             pos1, pos2, pos3, acc0, acc1, acc2, acc3, accb)
    fixed = (x_ptr, x_stride, halo_ptr, halo_stride, pos_ptr, dout_ptr, dx_ptr, dx_stride, head_ptr, T, end, HEADS, EPS,
             h, d, ok, ch, local, taps[4], lag0, lag1, lag2, lag3)
    # with HALO_TAIL, rows 8 and up never reach below row 0: their loop reads no halo; the rows below them (in the
    # first span only) in a second loop that does
    low = span0
    if HAS_HALO and HALO_TAIL:
        low = tl.maximum(span0, 8)
    # with BRANCH, the rows end..top (the W-1 after the span; none at the last span) first, their pre-activation
    # gradient only: every later step is then a row of the span (MINE True); without it each step asks (None)
    mine = True if BRANCH else None
    main_top = top
    if BRANCH:
        for i in tl.range(top - end + 1):
            state = _scan_step(top - i, *fixed, *state, D, W, NORM, REPEAT, HAS_HALO and not HALO_TAIL, True, False,
                               FTZ)
        main_top = tl.minimum(end - 1, top)
    for i in tl.range(main_top - low + 1, loop_unroll_factor=UNROLL):
        state = _scan_step(main_top - i, *fixed, *state, D, W, NORM, REPEAT, HAS_HALO and not HALO_TAIL, BRANCH, mine,
                           FTZ)
    if HAS_HALO and HALO_TAIL:
        tail_top = tl.minimum(low - 1, main_top)
        for i in tl.range(tail_top - span0 + 1):
            state = _scan_step(tail_top - i, *fixed, *state, D, W, NORM, REPEAT, True, BRANCH, mine, FTZ)
    acc0, acc1, acc2, acc3, accb = state[24], state[25], state[26], state[27], state[28]
    base = dw_ptr + (i_p * (HEADS * D) + local).to(tl.int64) * W
    tl.store(base + (W - 1), acc0, mask=ok)
    if W >= 2:
        tl.store(base + (W - 2), acc1, mask=ok)
    if W >= 3:
        tl.store(base + (W - 3), acc2, mask=ok)
    if W >= 4:
        tl.store(base + (W - 4), acc3, mask=ok)
    if HAS_BIAS:
        tl.store(db_ptr + i_p * (HEADS * D) + local, accb, mask=ok)


_TILE_KEY = ["D", "W", "HAS_HALO", "NORM", "REPEAT"]
_fwd = launcher(gdn_cp_glue_conv_fwd, [*_TILE_KEY, "FTZ"], TILE_CONFIGS, {"BT": 16, "num_warps": 4})
_pre = launcher(gdn_cp_glue_conv_bwd_pre, _TILE_KEY, TILE_CONFIGS, {"BT": 16, "num_warps": 4})
_dx = launcher(gdn_cp_glue_conv_bwd_dx, ["W"], [({"BT": 32, "BC": 128}, 4), ({"BT": 64, "BC": 128}, 4),
                                                 ({"BT": 64, "BC": 256}, 8), ({"BT": 32, "BC": 256}, 4),
                                                 ({"BT": 128, "BC": 128}, 8)], {"BT": 16, "BC": 32, "num_warps": 4})
_bwd = launcher(gdn_cp_glue_conv_bwd, _TILE_KEY, TILE_CONFIGS, {"BT": 16, "num_warps": 4})
_SCAN_BWD_CONFIGS = [({"HB": hb, "UNROLL": 1}, w) for hb, w in ((2, 1), (4, 2), (8, 4), (4, 4), (8, 8), (16, 8))] + [
    ({"HB": hb, "UNROLL": 4}, w) for hb, w in ((2, 1), (4, 2), (4, 4), (8, 8))]
"""The backward scan's autotuning configs, ``(heads a program and steps a loop pass, num_warps)``: 8 or 4 channels a
thread at head dim 128, one step a loop pass, and the likeliest four unrolled by 4 (fewer instructions a step, more
registers: which wins is the GPU's to say)."""
# HALO_TAIL in the key: the tail form tunes on its own (it may take the config that spilled with the halo in every step)
_scan = launcher(gdn_cp_glue_conv_bwd_scan, [*_TILE_KEY, "HALO_TAIL", "BRANCH", "FTZ"], _SCAN_BWD_CONFIGS,
                 {"HB": 2, "UNROLL": 1, "num_warps": 1})
_SCAN_SPAN = 64  # rows per scan program at least: the backward recomputes W-1 more (5% at W 4)
_SCAN_PROGRAMS = 512  # spans per head block at most: longer rows take longer spans, so the backward's per-span tap
# sums (programs x width x W fp32: 33 MB for v at 128K rows) stay small


def _scan_span(t: int) -> int:
    """Rows per scan program for ``t`` rows: :data:`_SCAN_SPAN`, or more (a multiple of it) past
    :data:`_SCAN_PROGRAMS` spans."""
    return triton.cdiv(triton.cdiv(t, _SCAN_PROGRAMS), _SCAN_SPAN) * _SCAN_SPAN if t > _SCAN_SPAN * _SCAN_PROGRAMS \
        else _SCAN_SPAN


_SPAN = 64  # rows per backward program (its tap / bias sums): a multiple of every BT above
_MAX_BT = max(meta["BT"] for meta, _ in TILE_CONFIGS)
_ONE_PASS_PROGRAMS = 2048  # the one-pass backward's programs per channel group, about: each keeps a scratch tile


def _groups(k_heads, v_heads, dk, dv, qk_l2norm, kv_repeat=1):
    """(first channel, heads, head dim, l2-normalized, copies of each head written) of q, k, v in the pre-conv
    channels."""
    kd = k_heads * dk
    return ((0, k_heads, dk, qk_l2norm, kv_repeat), (kd, k_heads, dk, qk_l2norm, kv_repeat),
            (2 * kd, v_heads, dv, False, 1))


@dataclass(frozen=True)
class ConvForm:
    """How the kernels run the conv (every field off: the backward in two passes, tiles of 16-64 rows).
    ``one_pass``: the backward in one kernel (:func:`gdn_cp_glue_conv_bwd`) instead of two with an fp32 buffer
    between them; ``scan``: the backward as a scan down each span of rows, one row a step
    (:func:`gdn_cp_glue_conv_bwd_scan`), ``one_pass`` unused. The forward is the tile kernel in every form (a scan
    of it, timed on an H100, took 0.390 ms at 16K rows against the tile kernel's 0.321: run 2026-12-06l)."""

    one_pass: bool = False
    scan: bool = False


def _block(dim: int) -> int:
    return max(16, triton.next_power_of_2(dim))


def _conv_inputs(x, weight, bias, halo) -> tuple:
    """The arguments every conv kernel starts with: ``x_ptr, x_stride, w_ptr, b_ptr, halo_ptr, halo_stride`` (an
    absent bias or halo passed as a tensor the kernel never reads: ``HAS_BIAS`` / ``HAS_HALO`` off)."""
    return (x, x.stride(0), weight, bias if bias is not None else weight, halo if halo is not None else x,
            x.shape[1] if halo is None else halo.stride(0))


class _ConvSiluSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, positions, halo, k_heads, v_heads, dk, dv, qk_l2norm, eps, kv_repeat, form):
        t = x.shape[0]
        w = weight.shape[1]
        weight_c = weight.contiguous()
        outs = []
        for c0, heads, dim, norm, repeat in _groups(k_heads, v_heads, dk, dv, qk_l2norm, kv_repeat):
            out = torch.empty(t, heads * repeat, dim, dtype=x.dtype, device=x.device)
            if t and heads:
                # every row as if no halo, then rows 0..W-2 again with it (HALO_ROWS_APART): no other row reads the
                # halo, and its loads and masks in every tile took registers (sm_90, 16 rows: 84 against 50)
                apart = halo is not None and HALO_ROWS_APART
                for rows, with_halo in ((t, None), (min(t, w - 1), halo)) if apart else ((t, halo),):
                    _fwd(lambda meta, rows=rows, heads=heads: (triton.cdiv(rows, meta["BT"]), heads),
                         *_conv_inputs(x, weight_c, bias, with_halo), positions, out, rows, c0, heads, eps,
                         D=dim, BD=_block(dim), W=w, HAS_BIAS=bias is not None, HAS_HALO=with_halo is not None,
                         NORM=norm, REPEAT=repeat, FTZ=FTZ_SIGMOID)
            outs.append(out)
        ctx.save_for_backward(x, weight_c, bias, positions, halo)
        ctx.meta = (k_heads, v_heads, dk, dv, qk_l2norm, eps, kv_repeat, weight.dtype, form)
        return tuple(outs)

    @staticmethod
    def backward(ctx, dq, dk_, dv_):
        x, weight, bias, positions, halo = ctx.saved_tensors
        k_heads, v_heads, dk, dv, qk_l2norm, eps, kv_repeat, w_dtype, form = ctx.meta
        t, c = x.shape
        w = weight.shape[1]
        dx = row_gradient_columns(x)  # q|k|v's columns of in_proj's output gradient where x is split_columns' group
        dw = torch.zeros(c, w, dtype=torch.float32, device=x.device)
        db = torch.zeros(c, dtype=torch.float32, device=x.device) if bias is not None else None
        dhalo = torch.zeros(w - 1, c, dtype=torch.float32, device=x.device) if halo is not None else None
        group_backward = (_conv_group_backward_scan if form.scan else
                          _conv_group_backward_one_pass if form.one_pass else _conv_group_backward)
        for (c0, heads, dim, norm, repeat), g in zip(_groups(k_heads, v_heads, dk, dv, qk_l2norm, kv_repeat),
                                                     (dq, dk_, dv_)):
            if not (t and heads):
                continue
            g = torch.zeros(t, heads * repeat, dim, dtype=x.dtype, device=x.device) if g is None else g.contiguous()
            group_backward(x, weight, bias, halo, positions, g, c0, heads, dim, norm, eps, dx, dw, db, dhalo, repeat)
        dweight = dw.to(w_dtype)
        dbias = db.to(bias.dtype) if bias is not None else None
        return (dx, dweight, dbias, None, dhalo.to(halo.dtype) if halo is not None else None,
                None, None, None, None, None, None, None, None)


_CHUNK = 16384  # rows per backward pass: bounds the fp32 pre-activation gradient kept between its two kernels


def _conv_group_backward(x, weight, bias, halo, positions, dout, c0, heads, dim, norm, eps, dx, dw, db, dhalo,
                         repeat):
    """One channel group's backward (q, k or v), ``_CHUNK`` rows at a time: the pre-activation gradient of the
    rows and the W-1 after them (:func:`gdn_cp_glue_conv_bwd_pre`), then dx from it
    (:func:`gdn_cp_glue_conv_bwd_dx`); dw, db and the halo's gradient accumulated into the fp32 ``dw``, ``db``,
    ``dhalo``."""
    t = x.shape[0]
    w = weight.shape[1]
    width = heads * dim
    for row0 in range(0, t, _CHUNK):
        end_sum = min(row0 + _CHUNK, t)
        end = min(end_sum + w - 1, t)
        rows = end - row0
        pre = torch.empty(rows, width, dtype=torch.float32, device=x.device)
        programs = triton.cdiv(rows, _SPAN)  # whatever tile autotuning picks: the sums' rows never depend on it
        dw_part, db_part = _partial_sums(programs, width, w, bias is not None, x.device)
        _pre(lambda meta, programs=programs: (programs, heads),
             *_conv_inputs(x, weight, bias, halo), positions, dout, pre, dw_part, db_part, t, row0, rows, end_sum, c0,
             heads, eps, D=dim, BD=_block(dim), SPAN=_SPAN, W=w, WP=triton.next_power_of_2(w), HAS_BIAS=bias is not None,
             HAS_HALO=halo is not None, NORM=norm, REPEAT=repeat)
        _add_partial_sums(dw, db, c0, dw_part, db_part)
        n = end_sum - row0
        _dx(lambda meta, n=n: (triton.cdiv(n, meta["BT"]), triton.cdiv(width, meta["BC"])),
            pre, weight, positions, dx, dx.stride(0), t, row0, n, end, c0, width, W=w)
        if halo is not None and row0 == 0:
            dhalo[:, c0:c0 + width] += _halo_gradient(pre, weight[c0:c0 + width], positions)


def _conv_group_backward_one_pass(x, weight, bias, halo, positions, dout, c0, heads, dim, norm, eps, dx, dw, db,
                                  dhalo, repeat):
    """One channel group's backward in one kernel (:func:`gdn_cp_glue_conv_bwd`): dx written once, no fp32
    ``[T, width]`` buffer; about :data:`_ONE_PASS_PROGRAMS` programs for the group, each a span of rows (a multiple of
    every tile) of one head with its own scratch tile."""
    t = x.shape[0]
    w = weight.shape[1]
    width = heads * dim
    per_head = max(1, _ONE_PASS_PROGRAMS // heads)
    span = triton.cdiv(triton.cdiv(t, per_head), _SPAN) * _SPAN
    programs = triton.cdiv(t, span)
    block = _block(dim)
    scratch = torch.empty(programs * heads * (_MAX_BT + 4) * block, dtype=torch.float32, device=x.device)
    head = torch.empty(w - 1, width, dtype=torch.float32, device=x.device) if halo is not None else scratch
    dw_part, db_part = _partial_sums(programs, width, w, bias is not None, x.device)
    _bwd(lambda meta: (programs, heads),
         *_conv_inputs(x, weight, bias, halo), positions, dout, dx, dx.stride(0), scratch, head, dw_part, db_part,
         t, span, c0, heads, eps, D=dim, BD=block, W=w, HAS_BIAS=bias is not None, HAS_HALO=halo is not None,
         NORM=norm, REPEAT=repeat)
    _add_partial_sums(dw, db, c0, dw_part, db_part)
    if halo is not None:
        dhalo[:, c0:c0 + width] += _halo_gradient(head[:t], weight[c0:c0 + width], positions)


def _conv_group_backward_scan(x, weight, bias, halo, positions, dout, c0, heads, dim, norm, eps, dx, dw, db, dhalo,
                              repeat):
    """One channel group's backward as a scan down each span of rows (:func:`gdn_cp_glue_conv_bwd_scan`): dx
    written once, the tap and bias sums per span, no fp32 ``[T, width]`` buffer and no scratch."""
    t = x.shape[0]
    w = weight.shape[1]
    width = heads * dim
    span = _scan_span(t)
    programs = triton.cdiv(t, span)
    head = torch.empty(w - 1, width, dtype=torch.float32, device=x.device) if halo is not None else dx
    dw_part, db_part = _partial_sums(programs, width, w, bias is not None, x.device)
    _scan(lambda meta: (programs, triton.cdiv(heads, meta["HB"])),
          *_conv_inputs(x, weight, bias, halo), positions, dout, dx, dx.stride(0), head, dw_part, db_part, t,
          span, c0, heads, eps, D=dim, BD=_block(dim), W=w, HAS_BIAS=bias is not None,
          HAS_HALO=halo is not None, NORM=norm, REPEAT=repeat, HALO_TAIL=halo is not None and SCAN_HALO_TAIL,
          BRANCH=SCAN_BRANCH_MASKS, FTZ=FTZ_SIGMOID)
    _add_partial_sums(dw, db, c0, dw_part, db_part)
    if halo is not None:
        dhalo[:, c0:c0 + width] += _halo_gradient(head[:t], weight[c0:c0 + width], positions)


def _partial_sums(programs: int, width: int, w: int, with_bias: bool, device) -> tuple:
    """Empty ``dw_part [programs, width, W]`` and ``db_part [programs, width]`` (fp32): each backward program's tap
    and bias sums. Without a bias ``db_part`` is ``dw_part``, a stand-in the kernels never write (``HAS_BIAS`` off)."""
    dw_part = torch.empty(programs, width, w, dtype=torch.float32, device=device)
    return dw_part, (torch.empty(programs, width, dtype=torch.float32, device=device) if with_bias else dw_part)


def _add_partial_sums(dw, db, c0, dw_part, db_part) -> None:
    """The programs' sums into the group's channels ``[c0, c0 + width)`` of ``dw [C, W]`` and (with a bias) ``db``."""
    width = dw_part.shape[1]
    dw[c0:c0 + width] += dw_part.sum(0)
    if db is not None:
        db[c0:c0 + width] += db_part.sum(0)


def _halo_gradient(pre: torch.Tensor, taps: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``[W-1, width]`` fp32: halo row i (token i-(W-1)) feeds row r = i-j through tap j, for the rows r < W-1 of
    the sequence that starts at row 0 (``positions[r] == r``): ``sum_r taps[:, i-r] * pre[r]`` over r <= i. A few
    kernels for every (i, j) at once (``pre [rows, width]`` fp32, ``taps [width, W]``)."""
    w1 = taps.shape[1] - 1
    n = min(w1, pre.shape[0])
    r = torch.arange(n, device=pre.device)
    i = torch.arange(w1, device=pre.device)
    lag = i[:, None] - r[None, :]  # [W-1, n]: the tap linking halo row i to row r
    taps_t = taps.float().t()  # [W, width]
    k = taps_t[lag.clamp_min(0)] * (lag >= 0)[..., None]  # [W-1, n, width]
    rows = pre[:n] * (positions[:n] == r.to(positions.dtype))[:, None]  # [n, width]: only row 0's sequence
    return (k * rows[None]).sum(1)


def conv_silu_split_triton(x, weight, bias, positions, halo, k_heads: int, v_heads: int, head_k_dim: int,
                           head_v_dim: int, qk_l2norm: bool, eps: float, kv_repeat: int = 1, **form):
    """:func:`gdn_cp.ops.fused.conv_silu_split`'s contract, by the kernels above: ``(q, k, v)``, q and k written
    ``kv_repeat`` times per head (``[T, k_heads * kv_repeat, Dk]``; their gradients' copies summed in the backward's
    kernels); ``form``: the fields of :class:`ConvForm` (how the kernels run)."""
    halo = halo.contiguous() if halo is not None else None
    return _ConvSiluSplit.apply(x, weight, bias, positions, halo, k_heads, v_heads, head_k_dim, head_v_dim,
                                qk_l2norm, eps, kv_repeat, ConvForm(**form))
