"""Whether FlashQLA can run here, and why not: feature detection, probed once per process.

FlashQLA (``flash-qla``, the Qwen team's TileLang kernels, MIT) imports only where TileLang finds an
NVIDIA GPU of a compute capability it has kernels for: ``flash_qla`` asks TileLang for the target
at import time and raises on anything else, and TileLang compiles each kernel with the machine's
``nvcc`` on first use. So :func:`probe` looks, in order, at what is installed (package specs, no
import), at the GPU torch sees, and only then imports ``flash_qla``; it never raises, and its
first problem is the reason the backend gives. Versions come from package metadata
(:func:`flashqla_version`, :func:`tilelang_version`), never from an import, so ``gdn-cp doctor``
reads them on any machine.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
from dataclasses import dataclass
from typing import Callable, Optional

from ..installed import dist_version

__all__ = [
    "CHUNK_GDR_ARGS",
    "CAPABILITIES",
    "FlashQLAFeatures",
    "features",
    "flashqla_problem",
    "flashqla_version",
    "conv_choice",
    "fused_norm_choice",
    "probe",
    "stack_report",
    "tilelang_version",
]


CAPABILITIES = {(9, 0): "sm_90", (10, 0): "sm_100", (10, 3): "sm_103", (12, 0): "sm_120", (12, 1): "sm_121"}
"""The compute capabilities FlashQLA 0.1.3 has kernels for (``flash_qla.ops.gated_delta_rule.chunk``
refuses any other at import). gdn-cp's GPU suite ran it on sm_90 (H200) only."""

CHUNK_GDR_ARGS = ("q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state",
                  "use_qk_l2norm_in_kernel", "cu_seqlens", "auto_cp")
"""What gdn-cp passes to ``flash_qla.chunk_gated_delta_rule`` (FlashQLA >= 0.1.1's FLA-compatible signature)."""

_INSTALL = "pip install -e '.[flashqla]' (flash-qla and tilelang; TileLang needs nvcc on the GPU machine)"


@dataclass(frozen=True)
class FlashQLAFeatures:
    """The result of :func:`probe`. ``problem``: why FlashQLA cannot run here (None when it can);
    ``capability``: the GPU's ``(major, minor)`` (None without one); ``inter_card_cp``: whether
    ``build_cp_context`` takes ``enable_inter`` (FlashQLA >= 0.1.3's context parallelism over ranks,
    on the contiguous layout); ``chunk_size``: its chunk length on this GPU."""

    problem: Optional[str]
    capability: Optional[tuple[int, int]] = None
    inter_card_cp: bool = False
    chunk_size: Optional[int] = None


def flashqla_version() -> Optional[str]:
    """The installed flash-qla's version (package metadata; nothing imported), or None."""
    return dist_version("flash-qla", "flash_qla")


def tilelang_version() -> Optional[str]:
    """The installed TileLang's version (package metadata; nothing imported), or None."""
    return dist_version("tilelang")


def _cuda_capability() -> tuple[Optional[tuple[int, int]], Optional[str]]:
    """``(capability of the current GPU, None)`` or ``(None, why there is none)``."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - detection must never raise
        return None, f"torch does not import ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available():
        return None, f"torch {torch.__version__} sees no CUDA GPU; FlashQLA's TileLang kernels run on NVIDIA sm_90+"
    try:
        return tuple(torch.cuda.get_device_capability()), None
    except Exception as exc:  # noqa: BLE001
        return None, f"the GPU's compute capability is unknown ({type(exc).__name__}: {exc})"


def _params(fn) -> frozenset:
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return frozenset()


def probe(import_module: Callable = importlib.import_module, find_spec: Callable = importlib.util.find_spec,
          cuda_capability: Callable = _cuda_capability) -> FlashQLAFeatures:
    """Probe FlashQLA through ``import_module``, ``find_spec`` and ``cuda_capability`` (parameters,
    so tests can hand in fakes). Never raises."""
    for package, dist in (("flash_qla", "flash-qla"), ("tilelang", "tilelang")):
        try:
            found = find_spec(package) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return FlashQLAFeatures(f"{dist} is not installed ({_INSTALL})")
    capability, why = cuda_capability()
    if capability is None:
        return FlashQLAFeatures(why)
    if capability not in CAPABILITIES:
        have = ", ".join(CAPABILITIES.values())
        return FlashQLAFeatures(f"the GPU is sm_{capability[0]}{capability[1]}; FlashQLA has kernels for {have} only",
                                capability)
    try:  # imports TileLang, which asks nvcc for the target; FlashQLA raises on a GPU it has no kernels for
        gdr = import_module("flash_qla").chunk_gated_delta_rule
        chunk = import_module("flash_qla.ops.gated_delta_rule.chunk")
    except Exception as exc:  # noqa: BLE001 - detection must never raise
        return FlashQLAFeatures(f"importing flash_qla failed: {type(exc).__name__}: {exc}", capability)
    missing = [a for a in CHUNK_GDR_ARGS if a not in _params(gdr)]
    if missing:
        return FlashQLAFeatures(f"flash_qla {flashqla_version()}'s chunk_gated_delta_rule takes no {', '.join(missing)} "
                                "(gdn-cp needs FlashQLA >= 0.1.1's FLA-compatible signature)", capability)
    build = getattr(chunk, "build_cp_context", None)
    inter = build is not None and "enable_inter" in _params(build) and "cp_context" in _params(gdr)
    return FlashQLAFeatures(None, capability, inter_card_cp=inter, chunk_size=getattr(chunk, "CHUNK_SIZE", None))


@functools.lru_cache(maxsize=1)
def features() -> FlashQLAFeatures:
    """:func:`probe` of this process, computed once."""
    return probe()


def flashqla_problem() -> Optional[str]:
    """Why the FlashQLA backend cannot run in this process (None when it can); never raises."""
    return features().problem


@functools.lru_cache(maxsize=1)  # no arguments: one answer per process (never cache on tensors)
def conv_choice() -> tuple[Callable, str]:
    """``(causal_conv1d, what it is)``: FLA's conv kernel where FLA imports, else gdn-cp's plain-torch
    conv; decided once per process (the stack report says which)."""
    from ..fla.detect import fla_import_error, fla_version

    why = fla_import_error()
    if why is None:
        from ..fla.kernels import causal_conv1d as fla_conv

        return fla_conv, f"FLA {fla_version()}'s causal_conv1d (FlashQLA has no conv)"
    from ..reference.conv import causal_conv1d as reference_conv

    return reference_conv, f"gdn-cp's plain-torch conv (FlashQLA has no conv; FLA does not import here: {why})"


def fused_norm_choice() -> tuple[Optional[Callable], str]:
    """``(FLA's fused gated RMSNorm or None, what the layer's gated norm is)``, decided once."""
    from ..fla.detect import fla_import_error

    if fla_import_error() is None:
        from ..fla.norm import fused_gated_rms_norm as fla_norm

        fn = fla_norm()
        if fn is not None:
            return fn, "FLA's fused RMSNorm * silu(z) (rms_norm_gated) where out_norm is plain RMSNorm"
    return None, "the layer's own out_norm, then * act(z) (no fused kernel without FLA)"


def stack_report() -> dict:
    """The FlashQLA stack of this process and what gdn-cp uses of it, for logs, ``doctor`` and
    ``selftest``: ``{"stack": "flash-qla 0.1.3 + tilelang 0.1.15", "problem": ..., "choices": {...}}``."""
    found = features()
    report = {"stack": f"flash-qla {flashqla_version()} + tilelang {tilelang_version()}",
              "flash_qla": flashqla_version(), "tilelang": tilelang_version(), "problem": found.problem, "choices": {}}
    if found.problem is not None:
        report["choices"]["kernels"] = f"not usable: {found.problem}"
        return report

    c = report["choices"]
    c["gated delta rule"] = ("flash_qla.chunk_gated_delta_rule: q/k at the key heads (GVA in the kernel), head dims "
                             "128 (a value head dim that is a multiple of 128 as 128-wide calls), bf16/fp16, "
                             "auto_cp (its split of long sequences inside one GPU) as GDN_CP_FLASHQLA_AUTO_CP says (default on)")
    c["conv"] = conv_choice()[1]
    c["chunkwise"] = ("native: FlashQLA's inter-card cp context (state exchange) with FLA's cp context for the conv"
                      if found.inter_card_cp else
                      "generic only: this FlashQLA has no inter-card cp context (FlashQLA >= 0.1.3)")
    c["gated norm"] = fused_norm_choice()[1]
    return report
