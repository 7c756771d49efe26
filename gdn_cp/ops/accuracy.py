"""How far a result is from its reference, and how far is close enough: the relative errors and
every limit they are held to, with its reason. ``gdn-cp run`` and ``gdn-cp selftest`` judge with
these, and so do the tests (``gdn_cp_testing``), so a limit changes in one place.

Errors (``max_rel``, ``rel_l2``) compute in fp64 on the CPU (a device->host copy: checking code
only). They return ``inf`` when a tensor is missing (``None``, e.g. a gradient that never arrived)
or the shapes differ, so a comparison against a tolerance fails instead of raising. An all-zero
reference has no scale: the error is 0.0 when ``got`` is all zero too, else ``inf``. NaN anywhere
gives NaN, which no ``err <= tol`` accepts.

* :func:`max_rel` = ``max |got - want| / max |want|``: the strict metric of the fp64/fp32 parity
  checks (one bad element shows up at full size);
* :func:`rel_l2` = ``||got - want|| / ||want||`` (a normalized RMS): the metric of bf16 and FLA
  comparisons, where single elements round at 8 bits.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .registry import backend_spec

__all__ = [
    "CP_VS_CP1_MAX_REL",
    "FLA_CP_CEILING_REL_L2",
    "FLA_CP_VS_CP1_REL_L2",
    "FLA_VS_FP64_REL_L2",
    "MEGATRON_BF16_REL_L2",
    "MEGATRON_FP32_REL_L2",
    "STOCK_CORE_VS_FP64_MAX_REL",
    "cp_vs_cp1_tolerance",
    "max_rel",
    "rel_l2",
    "worst",
]


def _pair(got: Optional[torch.Tensor], want: Optional[torch.Tensor]):
    if got is None or want is None or tuple(got.shape) != tuple(want.shape):
        return None
    return got.detach().to("cpu", torch.float64), want.detach().to("cpu", torch.float64)


def _ratio(num: float, den: float) -> float:
    if math.isnan(num) or math.isnan(den):
        return math.nan
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def _relative(got: Optional[torch.Tensor], want: Optional[torch.Tensor], size) -> float:
    """``size(got - want) / size(want)``, with the module docstring's rules for None, shapes, zeros."""
    pair = _pair(got, want)
    if pair is None:
        return math.inf
    a, b = pair
    if b.numel() == 0:
        return 0.0
    return _ratio(size(a - b), size(b))


def max_rel(got: Optional[torch.Tensor], want: Optional[torch.Tensor]) -> float:
    """``max |got - want| / max |want|`` (see the module docstring for None, shapes, zeros)."""
    return _relative(got, want, lambda t: float(t.abs().max()))


def rel_l2(got: Optional[torch.Tensor], want: Optional[torch.Tensor]) -> float:
    """``||got - want||_2 / ||want||_2`` (see the module docstring for None, shapes, zeros)."""
    return _relative(got, want, lambda t: float(t.norm()))


def worst(errors: dict[str, float]) -> tuple[str, float]:
    """``(name, error)`` of the largest error in ``{name: error}`` (NaN counts as the worst)."""
    if not errors:
        return "-", 0.0
    return max(errors.items(), key=lambda kv: math.inf if math.isnan(kv[1]) else kv[1])


# CP vs CP=1 on the reference backend (max_rel). CP cuts sequences at other rows than CP=1, so the
# chunked scan sums in another order: fp64 agrees to ~1e-12, fp32 to ~1e-6. Any layout, halo or
# state bug shows up far above these (the mutation tests check it does).
CP_VS_CP1_MAX_REL = {torch.float64: 1e-10, torch.float32: 1e-5}

# A backend's kernels vs the fp64 reference (rel_l2), per compute dtype: each backend's spec says its own
# (BackendSpec.tolerances, read by gdn-cp selftest and the GPU tests); FLA's, by name for the tests.
FLA_VS_FP64_REL_L2 = backend_spec("fla").tolerances

# FLA chunkwise at cp=N vs FLA at CP=1 (rel_l2), the targets: outputs and gradients.
FLA_CP_VS_CP1_REL_L2 = {"float32": {"out": 1e-4, "grad": 1e-4}, "bfloat16": {"out": 2e-3, "grad": 1e-2}}
# A sequence cut at a rank boundary that is not a multiple of FLA's 64-row chunk is chunked
# differently from CP=1, so CP and CP=1 are two roundings of the same math. A tensor over the
# target above still passes when CP is as accurate as CP=1 against fp64 and within this ceiling of
# CP=1 (the GPU test records that the target itself was missed).
FLA_CP_CEILING_REL_L2 = {"float32": 5e-4, "bfloat16": 5e-3}

# The patched Megatron GatedDeltaNet in bf16 on the GPU vs the same module at CP=1 (rel_l2): the CP=1
# answer is itself bf16, and per-rank bf16 parameter gradients are summed over CP.
MEGATRON_BF16_REL_L2 = {"out": 2e-2, "grad": 3e-2}
# The same in fp32 (FLA backend): FLA's fp32 kernels use TF32 dots (FLA_VS_FP64_REL_L2: 5e-3 from
# fp64), and CP / TP cut the scan and the projections differently from CP=1, so the two sides carry
# different TF32 roundings. A layout, halo, state or TP-split bug shows up at 1e-1 and above.
MEGATRON_FP32_REL_L2 = {"out": 2e-3, "grad": 5e-3}


# An fp64 model against stock megatron-core 0.19.2's own GDN code (max_rel): stock's deterministic
# core (torch_chunk_gated_delta_rule) computes in fp32 whatever the model dtype, so outputs and
# gradients agree to ~1e-5 (8e-6 seen on the end-to-end GPTModel's gradients). A wrong document
# boundary (state or conv not reset) shows up at 1e-1 and above.
STOCK_CORE_VS_FP64_MAX_REL = 1e-4


def cp_vs_cp1_tolerance(dtype: str, backend: str) -> float:
    """max_rel allowed between a CP run and CP=1 on the same backend and dtype (``gdn-cp run``).

    fp64 and fp32 on the reference backend as in :data:`CP_VS_CP1_MAX_REL`, with fp32 loosened to
    1e-4 for the longer main-job sequences; a backend whose fp32 path uses TF32 dots (FLA's: its
    registry entry says ``tf32_dots``) 1e-2; bf16 rounds at 8 bits (5e-2).
    """
    if dtype == "float64":
        return CP_VS_CP1_MAX_REL[torch.float64]
    if dtype == "bfloat16":
        return 5e-2
    if dtype == "float32":
        return 1e-2 if backend_spec(backend).tf32_dots else 1e-4
    raise ValueError(f"dtype={dtype!r} has no tolerance; use float64, float32 or bfloat16")
