"""The three CP modes: rank-local zigzag tensors in, rank-local zigzag tensors out.

:func:`gdn_core` is the one entry point; nothing here knows about Megatron.
"""

from __future__ import annotations

import torch

from ..comm import group_size
from ..layout.plan import CPPlan
from .all_gather import all_gather_core
from .chunkwise import chunkwise_core, contiguous_core
from .common import GDNShape, check_inputs, local_core
from .headwise import check_headwise, headwise_core
from .packing import sbhd_to_thd, thd_to_sbhd

__all__ = ["MODES", "GDNShape", "gdn_core", "local_core", "sbhd_to_thd", "thd_to_sbhd"]

MODES = ("headwise", "chunkwise", "all_gather")
_CORES = {"headwise": headwise_core, "chunkwise": chunkwise_core, "all_gather": all_gather_core}


def gdn_core(
    qkv: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    *,
    shape: GDNShape,
    mode: str,
    plan: CPPlan,
    group,
    backend,
    layout: str = "zigzag",
) -> torch.Tensor:
    """GDN core (conv + SiLU + gated delta rule) under context parallelism.

    qkv ``[T_local, C]`` pre-conv, g ``[T_local, Hv]`` fp32 log decay, beta ``[T_local, Hv]``,
    all rank-local rows in zigzag layout for ``plan`` (THD; SBHD via :func:`sbhd_to_thd`).
    conv_weight ``[C, W]``. Returns ``o [T_local, Hv, Dv]`` in the same rows. Every check
    runs before the first collective; there is no fallback to another mode.

    ``layout="contiguous"`` (chunkwise only): the rows are already in the contiguous layout
    (the caller swapped layouts on hidden_states) and the output stays there.
    """
    if mode not in _CORES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if layout not in ("zigzag", "contiguous") or (layout == "contiguous" and mode != "chunkwise"):
        raise ValueError(
            f"layout={layout!r} with mode={mode!r}: only chunkwise takes contiguous rows; pass zigzag rows"
        )
    world = 1 if group is None else group_size(group)
    check_inputs(qkv, g, beta, conv_weight, conv_bias, shape, plan, world)
    if world == 1:
        return local_core(qkv, g, beta, conv_weight, conv_bias, shape=shape, cu_seqlens=plan.cu, backend=backend)
    if mode == "headwise":
        check_headwise(shape, world)
    if layout == "contiguous":
        return contiguous_core(qkv, g, beta, conv_weight, conv_bias, shape=shape, plan=plan, group=group, backend=backend)
    return _CORES[mode](qkv, g, beta, conv_weight, conv_bias, shape=shape, plan=plan, group=group, backend=backend)
