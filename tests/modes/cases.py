"""Global inputs for a GDN core and the CP=1 answer; rank slices of both.

Shared by the CPU parity tests and the GPU suite, so both compare against the same
thing: the reference backend run on the whole packed sequence at CP=1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gdn_cp.layout import build_natural_order
from gdn_cp.modes import GDNShape, local_core
from gdn_cp.ops import get_backend


def make_inputs(t_global, shape: GDNShape, width, dtype, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    gate_dtype = torch.float64 if dtype == torch.float64 else torch.float32

    def randn(*size, dt=dtype, scale=1.0):
        return (torch.randn(*size, generator=gen, dtype=torch.float64) * scale).to(dt).to(device)

    return {
        "qkv": randn(t_global, shape.conv_dim),
        "g": -F.softplus(randn(t_global, shape.num_v_heads, dt=torch.float64)).to(gate_dtype).to(device) * 0.3,
        "beta": torch.sigmoid(randn(t_global, shape.num_v_heads, dt=torch.float64)).to(dtype).to(device),
        "conv_weight": randn(shape.conv_dim, width, scale=0.5),
        "conv_bias": randn(shape.conv_dim, scale=0.1),
        "dout": randn(t_global, shape.num_v_heads, shape.head_v_dim),
    }


GRAD_NAMES = ("qkv", "g", "beta", "conv_weight", "conv_bias")


def reference_answer(inputs, shape, cu, backend="reference"):
    """CP=1 output and gradients on the whole packed stream."""
    leaves = {k: inputs[k].detach().clone().requires_grad_(True) for k in GRAD_NAMES}
    o = local_core(
        leaves["qkv"], leaves["g"], leaves["beta"], leaves["conv_weight"], leaves["conv_bias"],
        shape=shape, cu_seqlens=cu, backend=get_backend(backend),
    )
    o.backward(inputs["dout"])
    return o.detach(), {k: v.grad for k, v in leaves.items()}


def own_rows(cu, cp, rank, device="cpu"):
    return build_natural_order(list(cu), cp, rank).own_rows.to(device)


def rel_err(got, want):
    scale = want.abs().max().clamp_min(1e-30)
    return float((got.double() - want.double()).abs().max() / scale)
