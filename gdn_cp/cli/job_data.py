"""The main job's data (``gdn-cp run``): a realistic packed micro-batch and seeded inputs of the GDN
core, the same on every rank, device and CP size.

A packing is a list of Python ints ``[0, c_1, ..., T_global]``; sequence i holds global rows
``[cu[i], cu[i+1])``; equal neighbours are empty padding slots. Inputs are drawn from a
``torch.Generator`` on the CPU, then cast and moved, so a CP run and its CP=1 reference see the
same values. The tests' own packings and inputs (``gdn_cp_testing``) build on these.
"""

from __future__ import annotations

import random
from typing import Iterable

import torch
import torch.nn.functional as F

__all__ = ["CORE_GRAD_NAMES", "core_inputs", "core_leaves", "cumsum0", "packed_boundaries"]

# Tensors of the core that get gradients: activations (per row) and the conv parameters.
CORE_GRAD_NAMES = ("qkv", "g", "beta", "conv_weight", "conv_bias")
CORE_ROW_NAMES = ("qkv", "g", "beta")


def _gate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def core_inputs(t_global: int, shape, width: int, dtype: torch.dtype, seed: int, device="cpu") -> dict:
    """Global inputs of ``gdn_cp.modes.gdn_core`` for ``t_global`` packed rows.

    ``qkv [T, conv_dim]``, ``g [T, Hv]`` (log decay, fp32 or fp64: -0.3*softplus, so the state
    carried between ranks matters), ``beta [T, Hv]``, ``conv_weight [conv_dim, W]``,
    ``conv_bias [conv_dim]`` and the output gradient ``dout [T, Hv, Dv]``. ``shape`` is a
    ``gdn_cp.modes.GDNShape``.
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(*size, dt=dtype, scale=1.0):
        return (torch.randn(*size, generator=gen, dtype=torch.float64) * scale).to(dt).to(device)

    return {
        "qkv": randn(t_global, shape.conv_dim),
        "g": -F.softplus(randn(t_global, shape.num_v_heads, dt=torch.float64)).to(_gate_dtype(dtype)) * 0.3,
        "beta": torch.sigmoid(randn(t_global, shape.num_v_heads, dt=torch.float64)).to(dtype),
        "conv_weight": randn(shape.conv_dim, width, scale=0.5),
        "conv_bias": randn(shape.conv_dim, scale=0.1),
        "dout": randn(t_global, shape.num_v_heads, shape.head_v_dim),
    }


def core_leaves(inputs: dict, rows=None) -> dict:
    """Fresh leaf tensors (``requires_grad``) of :data:`CORE_GRAD_NAMES`: the per-row ones indexed
    by ``rows`` (a rank's rows; all rows when None), the conv parameters whole."""
    out = {}
    for k in CORE_GRAD_NAMES:
        t = inputs[k][rows] if (rows is not None and k in CORE_ROW_NAMES) else inputs[k]
        out[k] = t.detach().clone().requires_grad_(True)
    return out


def cumsum0(lengths: Iterable[int]) -> list[int]:
    """``[0, l0, l0+l1, ...]``: boundaries from sequence lengths."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def packed_boundaries(num_sequences: int, t_global: int, cp: int, seed: int) -> list[int]:
    """A realistic micro-batch: ``num_sequences`` mixed lengths (short and long), each a multiple
    of ``2*cp``, summing to ``t_global`` (a multiple of ``2*cp``), with two empty padding slots."""
    if num_sequences < 1:
        raise ValueError(f"num_sequences={num_sequences} must be >= 1")
    if t_global <= 0 or t_global % (2 * cp):
        raise ValueError(f"t_global={t_global} must be a positive multiple of 2*cp={2 * cp}")
    rng = random.Random(seed)
    unit = 2 * cp
    units = t_global // unit
    weights = [rng.choice([1, 1, 2, 3, 8, 20]) * rng.random() + 0.05 for _ in range(num_sequences)]
    lengths = [max(0, int(units * w / sum(weights))) for w in weights]
    for i in rng.sample(range(num_sequences), k=min(2, num_sequences)):
        lengths[i] = 0  # empty padding slots
    lengths[max(range(num_sequences), key=lambda i: lengths[i])] += units - sum(lengths)
    return cumsum0(n * unit for n in lengths)
