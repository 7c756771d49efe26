"""split_columns: torch.split's values and gradients; where consumers write their gradients into the call's
in_proj-shaped buffer (row_gradient_columns: gdn-cp's Triton conv and gated norm backward do), the backward fills
only the other columns and returns that buffer instead of concatenating (the passes over in_proj's output
gradient issue 45 asked to remove)."""

from __future__ import annotations

import pytest
import torch

from gdn_cp.ops.fused import split
from gdn_cp.ops.fused.split import row_gradient_columns, split_columns

SIZES = [6, 4, 2, 2]


class _IntoBuffer(torch.autograd.Function):
    made: list = []

    """Identity on a column group (or a view of one) whose backward writes its gradient into
    row_gradient_columns (what the Triton conv and gated norm backward do), remembering where."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        out = row_gradient_columns(x)
        out.copy_(grad)
        _IntoBuffer.made.append(out)
        return out


def _rows(t=5):
    return torch.randn(t, sum(SIZES), dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize("first_into_buffer", [False, True], ids=["plain", "into_buffer"])
@pytest.mark.parametrize("unused", [None, 1, 3], ids=["all_used", "z_unused", "alpha_unused"])
def test_split_columns_gives_torch_splits_values_and_gradients(first_into_buffer, unused):
    rows = _rows()
    parts = split_columns(rows, SIZES)
    want_parts = torch.split(rows, SIZES, dim=-1)
    assert all(torch.equal(a, b) for a, b in zip(parts, want_parts))
    weights = [torch.randn(p.shape, dtype=torch.float64) for p in parts]

    def loss(ps):
        ps = list(ps)
        if first_into_buffer:
            ps[0] = _IntoBuffer.apply(ps[0])
        return sum((p * w).sum() for i, (p, w) in enumerate(zip(ps, weights)) if i != unused)

    got = torch.autograd.grad(loss(parts), rows)[0]
    want = torch.autograd.grad(loss(torch.split(rows, SIZES, dim=-1)), rows)[0]
    assert torch.equal(got, want)


def test_the_backward_returns_the_consumers_buffer():
    """No concatenation: the gradient of the rows is the very buffer the groups' consumers wrote into, one a
    view of its group ([T, 2, 2], as z [T, Hv, Dv]); the groups nobody wrote are filled in."""
    _IntoBuffer.made = []
    rows = _rows()
    captured = {}
    handle = rows.register_hook(lambda g: captured.update(ptr=g.data_ptr()))
    parts = split_columns(rows, SIZES)
    z = parts[1].reshape(5, 2, 2)
    (_IntoBuffer.apply(parts[0]).sum() + 2 * _IntoBuffer.apply(z).sum() + parts[3].sum()).backward()
    handle.remove()
    q_cols, z_cols = _IntoBuffer.made[1], _IntoBuffer.made[0]  # backward runs the later consumer first
    assert captured["ptr"] == q_cols.data_ptr() and z_cols.data_ptr() == q_cols.data_ptr() + 6 * 8
    assert z_cols.shape == (5, 2, 2) and z_cols.stride() == (14, 2, 1)
    expected = torch.cat([torch.ones(5, 6), 2 * torch.ones(5, 4), torch.zeros(5, 2), torch.ones(5, 2)], dim=-1)
    assert torch.equal(rows.grad, expected.double())
    assert not split._GROUPS, "a call's groups stay registered after its backward"


def test_row_gradient_columns_only_for_one_consumer_of_a_whole_group():
    rows = _rows()
    parts = split_columns(rows, SIZES)
    first = row_gradient_columns(parts[0])
    assert first.stride() == (14, 1) and first._base.shape == (5, 14)
    again = row_gradient_columns(parts[0])  # a second consumer of the group: its own tensor (autograd sums them)
    assert again.is_contiguous() and again.data_ptr() != first.data_ptr()
    assert row_gradient_columns(parts[1][:, :2]).is_contiguous()  # part of a group
    assert row_gradient_columns(parts[1][1:]).is_contiguous()  # not its first row
    assert row_gradient_columns(parts[1].float()).is_contiguous()  # another dtype: not the group
    assert row_gradient_columns(torch.zeros(5, 4, dtype=torch.float64)).is_contiguous()  # never split
    assert row_gradient_columns(parts[1].reshape(5, 2, 2))._base is first._base


def test_a_second_backward_gives_the_same_gradient():
    """retain_graph: the buffer went to the first backward's caller; the second makes its own."""
    rows = _rows()
    parts = split_columns(rows, SIZES)
    loss = _IntoBuffer.apply(parts[0]).sum() + parts[1].sum()
    first = torch.autograd.grad(loss, rows, retain_graph=True)[0].clone()
    second = torch.autograd.grad(loss, rows)[0]
    assert torch.equal(first, second)


def test_switched_off_it_concatenates_as_torch_split(monkeypatch):
    """``GRAD_INTO_CONSUMER_BUFFER`` off (the benchmark's ``split_cat`` lever): same gradient, a new tensor."""
    monkeypatch.setattr(split, "GRAD_INTO_CONSUMER_BUFFER", False)
    _IntoBuffer.made = []
    rows = _rows()
    captured = {}
    handle = rows.register_hook(lambda g: captured.update(ptr=g.data_ptr()))
    parts = split_columns(rows, SIZES)
    (_IntoBuffer.apply(parts[0]).sum() + parts[1].sum() * 2 + parts[3].sum()).backward()
    handle.remove()
    assert captured["ptr"] != _IntoBuffer.made[0].data_ptr()
    expected = torch.cat([torch.ones(5, 6), 2 * torch.ones(5, 4), torch.zeros(5, 2), torch.ones(5, 2)], dim=-1)
    assert torch.equal(rows.grad, expected.double())


def test_wide_column_copy_moves_the_same_bits_as_8_byte_words(monkeypatch):
    """``WIDE_COLUMN_COPY`` on: a bf16 group's gradient goes into its strided columns as int64 words (NaN payloads
    and signed zeros included), and falls back to the element copy where a row or the start is not 8-byte aligned."""
    monkeypatch.setattr(split, "WIDE_COLUMN_COPY", True)
    buffer = torch.zeros(6, 12 + 8 + 4, dtype=torch.bfloat16)
    grad = torch.randn(6, 8).to(torch.bfloat16)
    grad[0, :3] = torch.tensor([float("nan"), -0.0, float("inf")])
    grad.view(torch.int16)[1, 0] = 0x7FC1  # a NaN with a payload: copied as its bits
    columns = buffer[:, 12:20]
    assert split.as_words(columns).shape == (6, 2) and split.as_words(columns).stride() == (6, 1)
    split.copy_columns(columns, grad)
    assert torch.equal(columns.view(torch.int16), grad.view(torch.int16))
    assert torch.equal(buffer[:, :12].float(), torch.zeros(6, 12)) and torch.equal(buffer[:, 20:].float(),
                                                                                     torch.zeros(6, 4))
    odd = buffer[:, 2:10]  # starts 4 bytes into a word: the element copy
    assert split.as_words(odd) is None
    split.copy_columns(odd, grad)
    assert torch.equal(odd.view(torch.int16), grad.view(torch.int16))
    assert split.as_words(torch.zeros(6, 3, dtype=torch.bfloat16)) is None  # a row of 6 bytes


def test_the_split_backward_copies_through_copy_columns(monkeypatch):
    """Groups no consumer wrote reach in_proj's gradient through copy_columns (the wide copy when it is on)."""
    calls = []
    monkeypatch.setattr(split, "copy_columns", lambda columns, g: (calls.append(columns.shape), columns.copy_(g)))
    rows = _rows()
    parts = split_columns(rows, SIZES)
    (_IntoBuffer.apply(parts[0]).sum() + 2 * parts[1].sum()).backward()
    assert calls == [(5, 4), (5, 2), (5, 2)]
    expected = torch.cat([torch.ones(5, 6), 2 * torch.ones(5, 4), torch.zeros(5, 4)], dim=-1)
    assert torch.equal(rows.grad, expected.double())
