"""in_proj's output split into its column groups, with a backward that writes into the gradient a consumer
already laid out like the whole row.

``torch.split``'s backward concatenates the groups' gradients into a new ``[T, D]`` tensor: a pass over all of
in_proj's output gradient. gdn-cp's Triton conv backward writes ``dx`` as columns of a ``[T, D]`` buffer (laid out
like its input, a column view of in_proj's output), so :func:`split_columns`'s backward finds that buffer
through the gradient's base, copies the other groups' gradients (z, beta, alpha: a third of the columns) into
their columns, and hands the buffer back: no concatenation. Where no gradient is laid out so (another glue
path, an all-to-all between), it concatenates as ``torch.split`` would. Same values either way.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["split_columns", "empty_like_row_columns"]

GRAD_INTO_CONSUMER_BUFFER = True
"""On: :func:`split_columns`' backward reuses a gradient laid out like the whole row (above); off: it is
``torch.split`` (benchmarks/layer_full.py's lever ``split_cat`` times the two in the same run)."""


def empty_like_row_columns(x: torch.Tensor) -> torch.Tensor:
    """An uninitialized tensor shaped and laid out like ``x [T, C]``: where ``x`` is a column slice of rows of D
    elements (``x.stride() == (D, 1)``, D > C), the same columns of a fresh contiguous ``[T, D]`` (its column offset
    read from x's storage offset, as in a fresh in_proj output); else a contiguous ``[T, C]``."""
    t, c = x.shape
    d = x.stride(0)
    if x.dim() != 2 or x.stride(1) != 1 or d <= c or t == 0:
        return torch.empty(t, c, dtype=x.dtype, device=x.device)
    offset = x.storage_offset() % d
    if offset + c > d:
        return torch.empty(t, c, dtype=x.dtype, device=x.device)
    return torch.empty(t, d, dtype=x.dtype, device=x.device)[:, offset:offset + c]


def _buffer_of(grad: Optional[torch.Tensor], shape, offset: int, dtype) -> Optional[torch.Tensor]:
    """``grad``'s base where ``grad`` is columns ``[offset, offset + width)`` of a contiguous ``shape`` tensor."""
    if grad is None or grad._base is None or grad.dtype != dtype or grad.stride() != (shape[1], 1):
        return None
    base = grad._base
    if tuple(base.shape) != tuple(shape) or not base.is_contiguous() or base.dtype != dtype:
        return None
    return base if grad.storage_offset() - base.storage_offset() == offset else None


class _SplitColumns(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, sizes):
        ctx.shape, ctx.sizes = tuple(rows.shape), tuple(sizes)
        return tuple(torch.split(rows, list(sizes), dim=-1))

    @staticmethod
    def backward(ctx, *grads):
        starts = [sum(ctx.sizes[:i]) for i in range(len(ctx.sizes))]
        dtype = next(g.dtype for g in grads if g is not None)
        out = next((b for g, a in zip(grads, starts) if (b := _buffer_of(g, ctx.shape, a, dtype)) is not None), None)
        if out is None:
            return torch.cat([g if g is not None else torch.zeros(ctx.shape[0], n, dtype=dtype, device=_device(grads))
                              for g, n in zip(grads, ctx.sizes)], dim=-1), None
        for g, a, n in zip(grads, starts, ctx.sizes):
            columns = out[:, a:a + n]
            if g is None:
                columns.zero_()
            elif g.data_ptr() != columns.data_ptr() or g.stride() != columns.stride():
                columns.copy_(g)
        return out, None


def _device(grads) -> torch.device:
    return next(g.device for g in grads if g is not None)


def split_columns(rows: torch.Tensor, sizes: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """``torch.split(rows [T, D], sizes, dim=-1)`` (views), whose backward reuses a gradient laid out like ``rows``
    (module docstring) instead of concatenating."""
    if not GRAD_INTO_CONSUMER_BUFFER or not rows.requires_grad or rows.dim() != 2 or not rows.is_contiguous():
        return tuple(torch.split(rows, list(sizes), dim=-1))
    return _SplitColumns.apply(rows, tuple(sizes))
