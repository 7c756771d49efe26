"""The gated RMSNorm of the GDN output in one FLA kernel: ``RMSNorm(o) * weight * silu(z)``.

Megatron's GatedDeltaNet applies ``out_norm`` to the core output and then multiplies by
``act(z)`` in fp32 (``_apply_gated_norm``): without torch.compile that is a norm kernel, an fp32
copy of z, the activation, the product and a cast forward, more of each backward, and fp32
intermediates ``[T*Hv, Dv]`` kept for backward. FLA's ``rms_norm_gated`` (``fla.modules.
fused_norm_gate``, FLA 0.4.2 and 0.6) does it in one kernel each way, in fp32 inside, keeping only
its bf16 inputs and one fp32 ``rstd`` per row. Same math (one rounding fewer).
"""

from __future__ import annotations

import functools
import importlib
from typing import Callable, Optional

import torch

from ..kernel_args import require_device
from .detect import features
from .spec import SPEC

__all__ = ["fused_gated_rms_norm", "gated_rms_norm"]


@functools.lru_cache(maxsize=1)
def _rms_norm_gated():
    return importlib.import_module("fla.modules.fused_norm_gate").rms_norm_gated


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x, z [N, D]`` (any strides; FLA copies what is not contiguous), ``weight [D]`` -> ``[N, D]``
    in x's dtype: ``x / sqrt(mean(x^2) + eps) * weight * silu(z)``, computed in fp32."""
    for name, t in (("x", x), ("z", z), ("weight", weight)):
        require_device(SPEC, name, t)
    if x.dim() != 2 or z.shape != x.shape:
        raise ValueError(f"x and z must both be [N, D]; got x {tuple(x.shape)}, z {tuple(z.shape)}")
    if tuple(weight.shape) != (x.shape[1],):
        raise ValueError(f"weight must be [D={x.shape[1]}]; got {tuple(weight.shape)}")
    if not isinstance(eps, float) or not eps > 0:
        raise ValueError(f"eps must be a positive float, got {eps!r}")
    return _rms_norm_gated()(x, z, weight, None, activation="swish", eps=eps)


def fused_gated_rms_norm() -> Optional[Callable]:
    """:func:`gated_rms_norm` when this FLA has the fused kernel, else None (the caller then uses
    the layer's own norm; :func:`gdn_cp.ops.fla.detect.stack_report` says which)."""
    return gated_rms_norm if features().fused_gated_norm else None
