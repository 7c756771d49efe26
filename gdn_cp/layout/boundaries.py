"""Validated packed-sequence boundaries: the one place where cu_seqlens rules live.

Everything downstream (segments, routes, plans) works on host values, so a device
``cu_seqlens`` is read to the host exactly once per micro-batch, here. The checks run in
numpy: a handful of tiny ops, each far cheaper than a torch CPU op.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["validate_cu_seqlens", "sbhd_cu_seqlens"]

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _to_host_int64(cu_seqlens, name: str) -> np.ndarray:
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
        # The single device->host transfer of the micro-batch (a copy: never the caller's memory).
        return cu_seqlens.detach().cpu().numpy().astype(np.int64)
    if isinstance(cu_seqlens, (list, tuple)):
        for i, v in enumerate(cu_seqlens):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name}[{i}] must be an int, got {type(v).__name__} {v!r}")
        return np.array(cu_seqlens, dtype=np.int64)
    raise TypeError(
        f"{name} must be a 1-D integer tensor or a list of ints, got {type(cu_seqlens).__name__}"
    )


def _first(mask: np.ndarray) -> int:
    return int(np.argmax(mask))


def validate_cu_seqlens(
    cu_seqlens,
    cp_size: int,
    *,
    t_global: int | None = None,
    name: str = "cu_seqlens",
    as_tensor: bool = False,
):
    """Check packed boundaries for a zigzag CP split; return them as a tuple of ints
    (or, with ``as_tensor``, an int64 CPU tensor).

    Rules (each violation raises ValueError naming the value and the fix):
    starts at 0, never decreases (equal neighbours are empty padding slots), ends at
    ``t_global`` when given, every sequence length divisible by ``2 * cp_size`` (the
    zigzag cut), and so ``T_global`` divisible by ``cp_size``. Checked with a few vector
    ops; the offending index is looked up only when a check fails.
    """
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    cu = _to_host_int64(cu_seqlens, name)
    if len(cu) < 2:
        raise ValueError(f"{name} needs at least 2 boundaries [0, T_global], got {cu.tolist()}")
    if int(cu[0]) != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(cu[0])}; boundaries are offsets into the packed stream")
    lengths = cu[1:] - cu[:-1]
    if (lengths < 0).any():
        i = _first(lengths < 0) + 1
        raise ValueError(
            f"{name} must be non-decreasing, but {name}[{i}]={int(cu[i])} < {name}[{i - 1}]={int(cu[i - 1])}"
        )
    if t_global is not None and int(cu[-1]) != t_global:
        raise ValueError(
            f"{name}[-1]={int(cu[-1])} must equal the packed length T_global={t_global}; "
            f"pass the padded boundaries (cu_seqlens_q_padded) that cover every row"
        )
    step = 2 * cp_size
    bad = lengths % step != 0
    if bad.any():
        i = _first(bad)
        raise ValueError(
            f"sequence {i} of {name} has length {int(lengths[i])}, not divisible by 2*cp={step}; "
            f"pad every sequence to a multiple of {step} (Megatron: cu_seqlens_q_padded)"
        )
    # T_global % cp == 0 follows from the rule above.
    return torch.from_numpy(cu) if as_tensor else tuple(cu.tolist())


def sbhd_cu_seqlens(seq_len: int, batch: int) -> tuple[int, ...]:
    """SBHD as packed THD: batch element b is sequence b, so ``[S, B]`` b-major is ``[B*S]``."""
    return tuple(b * seq_len for b in range(batch + 1))
