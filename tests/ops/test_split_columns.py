"""split_columns: torch.split's values and gradients; where a consumer's gradient is columns of a buffer laid
out like the whole row (gdn-cp's Triton conv backward makes one), the backward fills that buffer's other columns
and returns it instead of concatenating (the pass over in_proj's output gradient issue 45 asked to remove)."""

from __future__ import annotations

import pytest
import torch

from gdn_cp.ops.fused.split import empty_like_row_columns, split_columns

SIZES = [6, 4, 2, 2]


class _IntoBuffer(torch.autograd.Function):
    """Identity on a column group whose backward hands back its gradient as columns of a fresh [T, D] (what the
    Triton conv backward does), remembering the buffer."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        out = empty_like_row_columns(x)
        out.copy_(grad)
        _IntoBuffer.made = out
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
    """No concatenation: the gradient of the rows is the very buffer the first group's consumer wrote into."""
    rows = _rows()
    captured = {}
    handle = rows.register_hook(lambda g: captured.update(ptr=g.data_ptr()))
    parts = split_columns(rows, SIZES)
    (_IntoBuffer.apply(parts[0]).sum() + parts[1].sum() * 2 + parts[3].sum()).backward()
    handle.remove()
    assert captured["ptr"] == _IntoBuffer.made.data_ptr()
    expected = torch.cat([torch.ones(5, 6), 2 * torch.ones(5, 4), torch.zeros(5, 2), torch.ones(5, 2)], dim=-1)
    assert torch.equal(rows.grad, expected.double())


def test_empty_like_row_columns_keeps_the_column_layout():
    full = torch.zeros(4, 14)
    view = full[:, 6:10]
    made = empty_like_row_columns(view)
    assert made.shape == view.shape and made.stride() == view.stride() and made._base.shape == (4, 14)
    assert made.storage_offset() - made._base.storage_offset() == 6
    plain = empty_like_row_columns(torch.zeros(4, 3))
    assert plain.is_contiguous() and plain.shape == (4, 3)


def test_switched_off_it_concatenates_as_torch_split(monkeypatch):
    """``GRAD_INTO_CONSUMER_BUFFER`` off (the benchmark's ``split_cat`` lever): same gradient, a new tensor."""
    from gdn_cp.ops.fused import split

    monkeypatch.setattr(split, "GRAD_INTO_CONSUMER_BUFFER", False)
    rows = _rows()
    captured = {}
    handle = rows.register_hook(lambda g: captured.update(ptr=g.data_ptr()))
    parts = split_columns(rows, SIZES)
    (_IntoBuffer.apply(parts[0]).sum() + parts[1].sum() * 2 + parts[3].sum()).backward()
    handle.remove()
    assert captured["ptr"] != _IntoBuffer.made.data_ptr()
    expected = torch.cat([torch.ones(5, 6), 2 * torch.ones(5, 4), torch.zeros(5, 2), torch.ones(5, 2)], dim=-1)
    assert torch.equal(rows.grad, expected.double())
