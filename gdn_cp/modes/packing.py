"""SBHD <-> packed rows: ``[S_local, B, *F]`` <-> ``[B*S_local, *F]`` (b-major).

With batch element b as packed sequence b (boundaries ``b*S``), Megatron's SBHD zigzag
split is exactly the THD zigzag split, so every mode handles SBHD through the THD path.
"""

from __future__ import annotations

import torch

from ..checks import as_int
from ..layout.boundaries import MAX_BATCH

__all__ = ["sbhd_to_thd", "thd_to_sbhd"]


def sbhd_to_thd(x: torch.Tensor) -> torch.Tensor:
    """``[S, B, *F]`` -> ``[B*S, *F]``, batch element b's rows together (b-major)."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError(f"x must be a tensor [S, B, ...], got {_describe(x)}")
    return x.transpose(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def thd_to_sbhd(x: torch.Tensor, batch: int) -> torch.Tensor:
    """``[B*S, *F]`` (b-major) -> ``[S, B, *F]``; ``batch`` must divide the rows."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(f"x must be a tensor [B*S, ...], got {_describe(x)}")
    if as_int(batch) is None or not 1 <= batch <= MAX_BATCH or x.shape[0] % batch:
        raise ValueError(f"batch must be an int in [1, {MAX_BATCH}] dividing the {x.shape[0]} rows of x, got {batch!r}")
    return x.reshape(batch, x.shape[0] // batch, *x.shape[1:]).transpose(0, 1)


def _describe(x) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
