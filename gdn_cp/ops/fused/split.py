"""in_proj's output split into its column groups, with one gradient buffer that the groups' consumers write into.

``torch.split``'s backward concatenates the groups' gradients into a new ``[T, D]`` tensor: a pass over all of
in_proj's output gradient. Here each call of :func:`split_columns` gets a :class:`RowGradient`, a ``[T, D]``
buffer made by the first consumer that asks for its columns (:func:`row_gradient_columns`: gdn-cp's Triton conv
backward for q|k|v, its gated norm backward for z). Each consumer writes its group's gradient straight into
its columns; the split's backward copies in only the groups no consumer wrote (beta, alpha: a few columns) and
hands the buffer back: no concatenation, no copy of a big group. Where no consumer asked (another glue path, an
all-to-all between), it concatenates as ``torch.split`` would. Same values either way.

A consumer finds its call's buffer by the data pointer of the group it was given (a group, or a view of one
with the same first element: ``z [T, Hv, Dv]``), looked up while that call's graph lives; after the split's
backward the buffer belongs to in_proj's backward and is never handed out again.
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Optional, Sequence

import torch

__all__ = ["RowGradient", "as_words", "copy_columns", "row_gradient_columns", "split_columns"]

GRAD_INTO_CONSUMER_BUFFER = True
"""On: consumers write into one in_proj-shaped gradient (above); off: :func:`split_columns` is ``torch.split``
(benchmarks/layer_full.py's lever ``split_cat`` times the two in the same run)."""

WIDE_COLUMN_COPY = True
"""On: :func:`copy_columns` copies a group's gradient into its columns as 8-byte words (the same bits). A bf16 group's
columns are a strided ``[T, n]`` view, which torch copies element by element (``elementwise_kernel``, not the
vectorized one): z's gradient (16K rows of 4096) took 0.174 ms that way on an H100 and 0.101 ms as words (65K rows:
0.670 / 0.379 ms; run 2026-12-07c, ``benchmarks/glue_kernels.py``'s ``column_copy_ms``). In the layer (lever
``narrow_copy`` turns it off for a row) it was faster in 5 of the 6 rank rows that ran both and level in the sixth,
at the same peak (runs 2026-12-07d/e; ``tests/ops/test_glue_default.py``)."""

_GROUPS: dict[int, weakref.ref] = {}
"""data pointer of a group that :func:`split_columns` returned -> that call's :class:`RowGradient` (while it lives)."""


class RowGradient:
    """The ``[T, D]`` gradient of one :func:`split_columns` call's rows, made on the first consumer's request.
    ``starts``/``sizes``: the column groups; ``claimed``: the groups a consumer writes itself."""

    def __init__(self, rows: torch.Tensor, sizes: Sequence[int]):
        self.shape, self.dtype, self.device = tuple(rows.shape), rows.dtype, rows.device
        self.sizes = tuple(sizes)
        self.starts = tuple(sum(self.sizes[:i]) for i in range(len(self.sizes)))
        self.base = rows.data_ptr()
        self.buffer: Optional[torch.Tensor] = None
        self.claimed: set[int] = set()
        self.keys: list[int] = []

    def register(self, groups: Sequence[torch.Tensor]) -> None:
        for group, size in zip(groups, self.sizes):
            if size and self.shape[0]:
                key = group.data_ptr()
                _GROUPS[key] = weakref.ref(self, partial(_forget, key))
                self.keys.append(key)

    def unregister(self) -> None:
        """After the split's backward: the buffer is in_proj's now; a second backward (retain_graph) starts anew."""
        for key in self.keys:
            ref = _GROUPS.get(key)
            if ref is not None and ref() is self:
                del _GROUPS[key]
        self.keys, self.buffer, self.claimed = [], None, set()

    def claim(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """Group ``t``'s columns of the buffer, shaped like ``t``; None where ``t`` is not exactly one group laid out
        in the rows (``[T, n]`` or ``[T, ..., d]`` with row stride D, contiguous within a row) or its group was
        claimed already (two consumers of one group: autograd sums their gradients, each needs its own)."""
        rows, width = self.shape
        offset, misaligned = divmod(t.data_ptr() - self.base, t.element_size())
        if misaligned or offset not in self.starts or t.dtype != self.dtype or t.device != self.device:
            return None
        i = self.starts.index(offset)
        inner = t.shape[1:]
        if (t.dim() < 2 or t.shape[0] != rows or t.stride(0) != width or i in self.claimed
                or torch.Size(inner).numel() != self.sizes[i] or t[0].stride() != _contiguous_strides(inner)):
            return None
        if self.buffer is None:
            self.buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self.claimed.add(i)
        return self.buffer[:, offset:offset + self.sizes[i]].view(t.shape)


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _forget(key: int, ref: weakref.ref) -> None:
    if _GROUPS.get(key) is ref:
        del _GROUPS[key]


def row_gradient_columns(t: torch.Tensor) -> torch.Tensor:
    """An uninitialized gradient for ``t``: where ``t`` is a group :func:`split_columns` returned (or a view of one
    starting at its first element, e.g. ``z [T, Hv, Dv]``) and no other consumer claimed it, that group's columns of
    the call's in_proj-shaped gradient, shaped like ``t`` (row stride D); else a fresh contiguous tensor."""
    ref = _GROUPS.get(t.data_ptr()) if t.numel() else None
    holder = ref() if ref is not None else None
    columns = holder.claim(t) if holder is not None else None
    return columns if columns is not None else torch.empty(t.shape, dtype=t.dtype, device=t.device)


def as_words(t: torch.Tensor) -> Optional[torch.Tensor]:
    """``t [T, n]`` (row stride any, contiguous within a row) as 8-byte words ``[T, n * itemsize / 8]``; None where its
    rows, row stride or first element do not fall on 8-byte boundaries."""
    size = t.element_size()
    if (t.dim() != 2 or t.stride(1) != 1 or size >= 8 or (t.shape[1] * size) % 8 or (t.stride(0) * size) % 8
            or t.data_ptr() % 8):
        return None
    return t.view(torch.int64)


def copy_columns(columns: torch.Tensor, grad: torch.Tensor) -> None:
    """``columns.copy_(grad)``, as 8-byte words where both allow it and :data:`WIDE_COLUMN_COPY` is on: the same bits."""
    if WIDE_COLUMN_COPY and columns.dtype == grad.dtype and columns.shape == grad.shape:
        wide, src = as_words(columns), as_words(grad)
        if wide is not None and src is not None:
            wide.copy_(src)
            return
    columns.copy_(grad)


class _SplitColumns(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, sizes):
        groups = tuple(torch.split(rows, list(sizes), dim=-1))
        ctx.holder = RowGradient(rows, sizes)
        ctx.holder.register(groups)
        return groups

    @staticmethod
    def backward(ctx, *grads):
        holder = ctx.holder
        out = holder.buffer
        if out is None:  # no consumer asked for columns: torch.split's concatenation
            dtype, device = next((g.dtype, g.device) for g in grads if g is not None)
            out = torch.cat([g if g is not None else torch.zeros(holder.shape[0], n, dtype=dtype, device=device)
                             for g, n in zip(grads, holder.sizes)], dim=-1)
        else:
            for g, a, n in zip(grads, holder.starts, holder.sizes):
                columns = out[:, a:a + n]
                if g is None:
                    columns.zero_()
                elif g.data_ptr() != columns.data_ptr() or g.stride() != columns.stride():
                    copy_columns(columns, g)  # a group no consumer wrote, or two consumers' gradients summed
        holder.unregister()
        return out, None


def split_columns(rows: torch.Tensor, sizes: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """``torch.split(rows [T, D], sizes, dim=-1)`` (views), whose backward returns the gradient its consumers wrote
    into (module docstring) instead of concatenating."""
    if not GRAD_INTO_CONSUMER_BUFFER or not rows.requires_grad or rows.dim() != 2 or not rows.is_contiguous():
        return tuple(torch.split(rows, list(sizes), dim=-1))
    return _SplitColumns.apply(rows, tuple(sizes))
