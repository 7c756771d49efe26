"""Validated packed-sequence boundaries: the one place where cu_seqlens rules live.

Everything downstream (segments, routes, plans) works on Python ints, so a device
``cu_seqlens`` is read to the host exactly once per micro-batch, here.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["validate_cu_seqlens", "sbhd_cu_seqlens"]

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _to_int_list(cu_seqlens, name: str) -> list[int]:
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1:
            raise ValueError(
                f"{name} must be a 1-D tensor of boundaries, got shape {tuple(cu_seqlens.shape)}; "
                f"pass [0, end_0, end_1, ..., T_global]"
            )
        if cu_seqlens.dtype not in _INT_DTYPES:
            raise TypeError(
                f"{name} must have an integer dtype, got {cu_seqlens.dtype}; use torch.int32 or torch.int64"
            )
        # The single device->host transfer of the micro-batch.
        return [int(v) for v in cu_seqlens.tolist()]
    if isinstance(cu_seqlens, (list, tuple)):
        out = []
        for i, v in enumerate(cu_seqlens):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name}[{i}] must be an int, got {type(v).__name__} {v!r}")
            out.append(v)
        return out
    raise TypeError(
        f"{name} must be a 1-D integer tensor or a list of ints, got {type(cu_seqlens).__name__}"
    )


def validate_cu_seqlens(
    cu_seqlens,
    cp_size: int,
    *,
    t_global: int | None = None,
    name: str = "cu_seqlens",
) -> tuple[int, ...]:
    """Check packed boundaries for a zigzag CP split and return them as Python ints.

    Rules (each violation raises ValueError naming the value and the fix):
    starts at 0, never decreases (equal neighbours are empty padding slots), ends at
    ``t_global`` when given, every sequence length divisible by ``2 * cp_size`` (the
    zigzag cut), and so ``T_global`` divisible by ``cp_size``.
    """
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    cu = _to_int_list(cu_seqlens, name)
    if len(cu) < 2:
        raise ValueError(f"{name} needs at least 2 boundaries [0, T_global], got {cu}")
    if cu[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {cu[0]}; boundaries are offsets into the packed stream")
    for i in range(1, len(cu)):
        if cu[i] < cu[i - 1]:
            raise ValueError(
                f"{name} must be non-decreasing, but {name}[{i}]={cu[i]} < {name}[{i - 1}]={cu[i - 1]}"
            )
    if t_global is not None and cu[-1] != t_global:
        raise ValueError(
            f"{name}[-1]={cu[-1]} must equal the packed length T_global={t_global}; "
            f"pass the padded boundaries (cu_seqlens_q_padded) that cover every row"
        )
    step = 2 * cp_size
    for i in range(len(cu) - 1):
        length = cu[i + 1] - cu[i]
        if length % step:
            raise ValueError(
                f"sequence {i} of {name} has length {length}, not divisible by 2*cp={step}; "
                f"pad every sequence to a multiple of {step} (Megatron: cu_seqlens_q_padded)"
            )
    if cu[-1] % cp_size:  # implied by the rule above; kept so the message is direct
        raise ValueError(f"T_global={cu[-1]} is not divisible by cp={cp_size}")
    return tuple(cu)


def sbhd_cu_seqlens(seq_len: int, batch: int) -> tuple[int, ...]:
    """SBHD as packed THD: batch element b is sequence b, so ``[S, B]`` b-major is ``[B*S]``."""
    return tuple(b * seq_len for b in range(batch + 1))
