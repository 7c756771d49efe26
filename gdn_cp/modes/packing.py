"""SBHD <-> packed rows: ``[S_local, B, *F]`` <-> ``[B*S_local, *F]`` (b-major).

With batch element b as packed sequence b (boundaries ``b*S``), Megatron's SBHD zigzag
split is exactly the THD zigzag split, so every mode handles SBHD through the THD path.
"""

from __future__ import annotations

import torch

__all__ = ["sbhd_to_thd", "thd_to_sbhd"]


def sbhd_to_thd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def thd_to_sbhd(x: torch.Tensor, batch: int) -> torch.Tensor:
    return x.reshape(batch, x.shape[0] // batch, *x.shape[1:]).transpose(0, 1)
