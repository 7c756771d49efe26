"""Seeded inputs of the GDN core (:func:`gdn_cp.modes.gdn_core`), the same on every rank, device and CP
size: what ``gdn-cp run`` feeds it, and what the tests' and benchmarks' inputs (``gdn_cp_testing``)
build on; the packing they go with is :func:`gdn_cp.layout.packings.packed_boundaries`.

Inputs are drawn from a ``torch.Generator`` on the CPU, then cast and moved, so a CP run and its
CP=1 reference see the same values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["CORE_GRAD_NAMES", "core_inputs", "core_leaves"]

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
