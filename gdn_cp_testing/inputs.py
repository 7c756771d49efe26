"""Seeded inputs for the FLA kernels and the Megatron layer, and the CP=1 answer of the core (the
core's own inputs are the main job's: :mod:`gdn_cp.modes.inputs`).

Everything is drawn from a ``torch.Generator`` on the CPU (the same numbers on every rank, every
device and every CP size) and then cast and moved, so a CP run and its CP=1 reference see
identical values. Layouts: packed rows ``[T, ...]`` (THD, batch folded away) for the core;
``[T, B, hidden]`` for the Megatron layer.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from gdn_cp.modes.inputs import core_leaves

__all__ = ["cp1_core_answer", "fla_core_inputs", "hidden_inputs"]


def cp1_core_answer(inputs: dict, shape, cu: Sequence[int], backend="reference"):
    """CP=1 output ``[T, Hv, Dv]`` and gradients ``{name: grad}`` of the core on the whole packed
    stream: the reference every CP mode is compared with."""
    from gdn_cp.modes.local import local_core
    from gdn_cp.ops import get_backend

    leaves = core_leaves(inputs)
    o = local_core(
        leaves["qkv"], leaves["g"], leaves["beta"], leaves["conv_weight"], leaves["conv_bias"],
        shape=shape, cu_seqlens=list(cu), backend=get_backend(backend), glue="auto",
    )
    o.backward(inputs["dout"])
    return o.detach(), {k: v.grad for k, v in leaves.items()}


def fla_core_inputs(t_global: int, *, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                    width: int, seed: int = 0) -> dict:
    """fp32 CPU inputs of the FLA backend's CP core, in FLA's gate convention (``g =
    logsigmoid(x + 3)``, decay close to 1): ``qkv [T, C]``, ``g``, ``beta [T, Hv]``, ``w [C, W]``,
    ``b [C]``, ``do [T, Hv, Dv]`` with ``C = 2*Hk*Dk + Hv*Dv``. Cast and slice them per rank."""
    c = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim
    gen = torch.Generator().manual_seed(seed)
    return {
        "qkv": torch.randn(t_global, c, generator=gen),
        "g": F.logsigmoid(torch.randn(t_global, num_v_heads, generator=gen) + 3.0),
        "beta": torch.sigmoid(torch.randn(t_global, num_v_heads, generator=gen)),
        "w": torch.randn(c, width, generator=gen) * 0.5,
        "b": torch.randn(c, generator=gen) * 0.1,
        "do": torch.randn(t_global, num_v_heads, head_v_dim, generator=gen),
    }


def hidden_inputs(t: int, batch: int, dtype: torch.dtype, seed: int, hidden: int, device="cpu"):
    """``(x, dout)``, both ``[t, batch, hidden]``: a Megatron layer's input and output gradient."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, batch, hidden, generator=gen, dtype=torch.float64)
    dout = torch.randn(t, batch, hidden, generator=gen, dtype=torch.float64)
    return x.to(device=device, dtype=dtype), dout.to(device=device, dtype=dtype)
