"""How close is close enough, per comparison and dtype, with the reason for each number.

Every comparison in the tests, ``gdn-cp run`` and ``gdn-cp selftest`` takes its limit from here,
so a limit changes in one place and its reason stays next to it.
"""

from __future__ import annotations

import torch

from ..ops.registry import backend_spec

__all__ = [
    "CP_VS_CP1_MAX_REL",
    "FLA_CP_CEILING_REL_L2",
    "FLA_CP_VS_CP1_REL_L2",
    "FLA_VS_FP64_REL_L2",
    "MEGATRON_BF16_REL_L2",
    "MEGATRON_FP32_REL_L2",
    "STOCK_CORE_VS_FP64_MAX_REL",
    "cp_vs_cp1_tolerance",
]

# CP vs CP=1 on the reference backend (max_rel). CP cuts sequences at other rows than CP=1, so the
# chunked scan sums in another order: fp64 agrees to ~1e-12, fp32 to ~1e-6. Any layout, halo or
# state bug shows up far above these (the mutation tests check it does).
CP_VS_CP1_MAX_REL = {torch.float64: 1e-10, torch.float32: 1e-5}

# FLA's kernels vs the fp64 reference (rel_l2), per compute dtype. FLA's fp32 path uses TF32 dots
# (~1.5e-3 seen at head dim 64); bf16 rounds inputs and outputs at 8 bits.
FLA_VS_FP64_REL_L2 = {"float32": 5e-3, "bfloat16": 1e-2}

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
