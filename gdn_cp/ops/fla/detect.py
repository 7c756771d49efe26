"""What the installed flash-linear-attention (FLA) offers: feature detection, not a version pin.

:func:`features` probes once per process (later calls return the same answer): whether the
GDN kernels and the causal conv import (they need CUDA and a Triton that FLA accepts), and
whether FLA's context-parallel path is usable: ``fla.ops.cp.build_cp_context`` with a conv
kernel-size argument, and kernels that take ``cp_context``. :func:`detect_fla_cp` is the one
answer to "is FLA's chunkwise CP path usable here?" for ``auto``, ``doctor`` and the
chunkwise mode alike. Nothing here raises, and FLA is imported only when asked (importing
it touches CUDA), so importing this module is safe on a CPU-only machine.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
from dataclasses import dataclass
from typing import Callable, Optional

__all__ = [
    "FLAFeatures",
    "detect_fla_cp",
    "features",
    "fla_available",
    "fla_import_error",
    "fla_version",
    "has_cp_context",
    "has_zigzag_layout",
    "probe",
]


@dataclass(frozen=True)
class FLAFeatures:
    """The result of :func:`probe`."""

    import_error: Optional[str]  # why FLA's kernels do not import; None when they do
    cp_context_error: Optional[str]  # why FLA's cp context is not usable; None when it is
    kernel_size_arg: Optional[str] = None  # build_cp_context's name for the conv kernel size
    takes_cu_seqlens_cpu: bool = False  # build_cp_context takes the boundaries on the host too
    zigzag_layout: bool = False  # build_cp_context takes layout= (FLA >= 0.6)
    clamps_halo: bool = False  # FLACPContext clamps a halo longer than the rows (pre_num_conv_tokens)


def _params(fn) -> frozenset:
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return frozenset()


def probe(
    import_module: Callable = importlib.import_module, find_spec: Callable = importlib.util.find_spec
) -> FLAFeatures:
    """Probe FLA through ``import_module`` and ``find_spec`` (parameters, so tests can hand in fakes)."""
    if find_spec("fla") is None:
        missing = "flash-linear-attention (fla) is not installed (pip install flash-linear-attention)"
        return FLAFeatures(missing, missing)
    try:  # FLA raises many kinds at import (Triton API changes, CUDA)
        kernels = (
            import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule,
            import_module("fla.modules.convolution").causal_conv1d,
        )
    except Exception as exc:  # noqa: BLE001 - detection must never raise
        error = f"importing fla failed: {type(exc).__name__}: {exc}"
        return FLAFeatures(error, error)
    try:
        build = import_module("fla.ops.cp").build_cp_context
    except Exception as exc:  # noqa: BLE001
        return FLAFeatures(None, f"fla.ops.cp.build_cp_context is not importable ({type(exc).__name__}: {exc})")
    if not all("cp_context" in _params(fn) for fn in kernels):
        return FLAFeatures(None, "FLA's chunk_gated_delta_rule / causal_conv1d take no cp_context argument")
    params = _params(build)
    size_arg = next((a for a in ("conv1d_kernel_size", "kernel_size") if a in params), None)
    if size_arg is None:  # named conv1d_kernel_size in 0.4.x, kernel_size in some later trees
        return FLAFeatures(None, "fla.ops.cp.build_cp_context takes no conv kernel size argument")
    try:
        context_fields = getattr(import_module("fla.ops.cp.context").FLACPContext, "__dataclass_fields__", {})
    except Exception:  # noqa: BLE001
        context_fields = {}
    return FLAFeatures(
        import_error=None,
        cp_context_error=None,
        kernel_size_arg=size_arg,
        takes_cu_seqlens_cpu="cu_seqlens_cpu" in params,
        zigzag_layout="layout" in params,
        clamps_halo="pre_num_conv_tokens" in context_fields,
    )


@functools.lru_cache(maxsize=1)
def features() -> FLAFeatures:
    """:func:`probe` of this process's FLA, computed once."""
    return probe()


@functools.lru_cache(maxsize=1)
def fla_version() -> str | None:
    """Installed FLA version string (from package metadata; FLA is not imported), or None."""
    for dist in ("fla-core", "flash-linear-attention"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    if importlib.util.find_spec("fla") is None:
        return None
    try:  # a source checkout on sys.path without metadata
        return str(getattr(importlib.import_module("fla"), "__version__", "unknown"))
    except Exception:  # noqa: BLE001 - detection must never raise
        return None


def fla_import_error() -> str | None:
    """Why FLA's kernels do not import here, or None when they do."""
    return features().import_error


def fla_available() -> bool:
    """True when FLA's GDN kernels and causal conv import."""
    return features().import_error is None


def has_cp_context() -> bool:
    """True when FLA's cp context is usable (build_cp_context, kernels taking cp_context)."""
    return features().cp_context_error is None


def has_zigzag_layout() -> bool:
    """True when ``build_cp_context`` also takes ``layout=`` (FLA >= 0.6: a zigzag cp context;
    reported only: gdn-cp routes rows to the contiguous layout instead)."""
    return has_cp_context() and features().zigzag_layout


def detect_fla_cp(device_type: Optional[str] = None) -> tuple[bool, str]:
    """Whether FLA's chunkwise CP path is usable here: a CUDA device and a usable cp context.
    Returns ``(usable, reason)``. ``device_type`` (``"cuda"``, ``"cpu"``, ...) overrides device
    detection; on another device FLA is not looked at."""
    if device_type is None:
        try:
            import torch

            device_type = "cuda" if torch.cuda.is_available() else "cpu"
        except Exception as e:  # pragma: no cover - torch is a hard dependency
            return False, f"torch is not usable ({type(e).__name__}: {e})"
    if device_type != "cuda":
        return False, f"device is {device_type!r}, FLA's CP kernels need CUDA"
    problem = features().cp_context_error
    if problem is not None:
        return False, problem
    return True, "CUDA device, fla.ops.cp.build_cp_context importable and kernels taking cp_context"
