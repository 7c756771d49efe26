"""Depthwise causal conv1d over THD-packed sequences, in plain torch.

The short conv of a GDN layer (kernel W=4 on q/k/v) must not see across sequence boundaries, and
under chunkwise context parallelism a rank's first sequence continues from its left neighbour: the
W-1 rows that neighbour holds arrive as a ``halo``. Boundaries are host ints, so every mask here
is built on the host from them and shipped to the device; nothing is read back from the device.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from ...layout.boundaries import host_boundaries
from ...layout.device import host_to_device

__all__ = ["causal_conv1d", "compute_dtype"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64; everything else (fp32, bf16, fp16) is computed in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}; cast it with .float()")


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    cu_seqlens: Sequence[int],
    halo: Optional[torch.Tensor] = None,
    activation: Optional[str] = "silu",
) -> torch.Tensor:
    """Depthwise causal conv over packed sequences: ``y = act(bias + sum_j weight[:, j] * x[t-(W-1)+j])``.

    Args:
        x: [T, C] packed tokens (no batch dim).
        weight: [C, W] depthwise taps (Megatron's [C, 1, W] with the middle dim squeezed).
        bias: [C] or None.
        cu_seqlens: host ints (Boundaries or a list) 0 = cu[0] <= ... <= cu[-1] = T; empty sequences
            allowed. Rows before a sequence's start read as zeros.
        halo: [W-1, C] or None: the W-1 rows preceding x[0] in the first sequence
            (halo[-1] is the row right before x[0]); rows belonging to no sequence must be zeros.
        activation: "silu" or None.

    Returns:
        y: [T, C] in x.dtype, accumulated in fp32 (fp64 for fp64 x). Same as
        ``Conv1d(C, C, W, groups=C, padding=W-1)(x_seq.T)[..., :len]`` per sequence.
    """
    _check_float("x", x)
    _check_float("weight", weight)
    if x.dim() != 2:
        raise ValueError(
            f"x must be [T, C] (packed, no batch dim), got shape {tuple(x.shape)}; flatten batch and time first"
        )
    T, C = x.shape
    if weight.dim() == 3 and weight.shape[1] == 1:
        raise ValueError(
            f"weight must be [C, W], got Megatron's [C, 1, W] shape {tuple(weight.shape)}; pass weight.squeeze(1)"
        )
    if weight.dim() != 2 or weight.shape[0] != C or weight.shape[1] < 1:
        raise ValueError(f"weight must be [C, W] with C={C} (x.shape[1]) and W >= 1, got shape {tuple(weight.shape)}")
    W = weight.shape[1]
    if bias is not None:
        _check_float("bias", bias)
        if bias.shape != (C,):
            raise ValueError(f"bias must be [C] with C={C}, got shape {tuple(bias.shape)}; pass None for no bias")
    if halo is not None:
        _check_float("halo", halo)
        if halo.shape != (W - 1, C):
            raise ValueError(
                f"halo must be [W-1, C] = [{W - 1}, {C}], got shape {tuple(halo.shape)}; pass the last W-1 rows "
                f"before x[0] (zeros where they belong to no sequence), or None"
            )
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    for name, t in (("weight", weight), ("bias", bias), ("halo", halo)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}; move it with .to(x.device)")
    cu = host_boundaries(cu_seqlens, T)

    dtype = compute_dtype(x.dtype)
    xc = x.to(dtype)
    front = halo.to(dtype) if halo is not None else xc.new_zeros(W - 1, C)
    xp = torch.cat([front, xc], dim=0)  # [W-1+T, C]; row r is token r-(W-1)

    # pos[t] = t - start of t's sequence; tap with shift s reads a valid row iff pos[t] >= s.
    # With a halo, the sequence that starts at row 0 continues into it: never masked.
    starts = torch.tensor(cu[:-1], dtype=torch.long)
    lengths = torch.tensor([b - a for a, b in zip(cu[:-1], cu[1:])], dtype=torch.long)
    pos = torch.arange(T, dtype=torch.long) - torch.repeat_interleave(starts, lengths, output_size=T)
    if halo is not None:
        pos = torch.where(pos == torch.arange(T), torch.full_like(pos, W), pos)
    shifts = torch.arange(W - 1, -1, -1, dtype=torch.long)  # tap j reads x[t - shifts[j]]
    valid = host_to_device(pos[:, None] >= shifts[None, :], x.device)  # [T, W]

    w = weight.to(dtype)
    y = xc.new_zeros(T, C) if bias is None else bias.to(dtype).expand(T, C)
    for j in range(W):
        y = y + w[:, j] * torch.where(valid[:, j : j + 1], xp[j : j + T], 0.0)
    if activation == "silu":
        y = F.silu(y)
    return y.to(x.dtype)
