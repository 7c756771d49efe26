"""What the installed flash-linear-attention (FLA) offers: feature detection, not a version pin.

:func:`features` probes once per process (later calls return the same answer): whether the
GDN kernels and the causal conv import (they need CUDA and a Triton that FLA accepts), what the
kernels take (grouped value heads, the gates in the kernel, the fused gated RMSNorm), and
whether FLA's context-parallel path is usable: ``fla.ops.cp.build_cp_context`` with a conv
kernel-size argument, and kernels that take ``cp_context`` (plus ``layout="zigzag"`` in FLA >=
0.6). :func:`detect_fla_cp` is the one answer to "is FLA's chunkwise CP path usable here?" for
``doctor`` and the chunkwise mode alike (``auto`` does not ask it: it depends on the sizes alone); :func:`stack_report` says, for logs,
``doctor`` and ``selftest``, which stack this is and what gdn-cp uses of it. Nothing here
raises, and FLA is imported only when asked (importing it touches CUDA), so importing this
module is safe on a CPU-only machine.
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
    "FLAFeatures",
    "detect_fla_cp",
    "features",
    "fla_available",
    "fla_import_error",
    "fla_own_gated_delta_rule",
    "fla_version",
    "gdn_kernel_backends",
    "has_cp_context",
    "has_zigzag_layout",
    "own_kernel",
    "probe",
    "stack_report",
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
    # What the kernels take (known whenever they import, with or without a usable cp context):
    grouped_value_heads: bool = False  # chunk_gated_delta_rule takes q/k at the key heads (GVA, FLA >= 0.5)
    gate_in_kernel: bool = False  # use_gate_in_kernel with A_log / dt_bias (FLA >= 0.5)
    beta_sigmoid_in_kernel: bool = False  # use_beta_sigmoid_in_kernel (FLA >= 0.5)
    fused_gated_norm: bool = False  # fla.modules.fused_norm_gate.rms_norm_gated: RMSNorm(x) * silu(z) in one kernel


def _params(fn) -> frozenset:
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return frozenset()


def _module_source(fn) -> str:
    """The source of the module that defines ``fn`` ('' when there is none: a fake, a C function)."""
    try:
        return inspect.getsource(inspect.getmodule(fn))
    except (TypeError, OSError):
        return ""


def _kernel_features(gdr, import_module: Callable) -> dict:
    """What FLA's chunk_gated_delta_rule takes beyond FLA 0.4's arguments, and the fused gated norm.

    Grouped value heads and the in-kernel gate are not in the signature (FLA checks ``HV % H`` and
    reads ``use_gate_in_kernel`` from ``**kwargs``), so the defining module's source is read."""
    source = _module_source(gdr)
    try:
        import_module("fla.modules.fused_norm_gate").rms_norm_gated
        fused_norm = True
    except Exception:  # noqa: BLE001 - detection must never raise
        fused_norm = False
    return {
        "grouped_value_heads": "HV % H" in source,
        "gate_in_kernel": "use_gate_in_kernel" in source and "dt_bias" in source,
        "beta_sigmoid_in_kernel": "use_beta_sigmoid_in_kernel" in _params(gdr),
        "fused_gated_norm": fused_norm,
    }


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
    found = _kernel_features(kernels[0], import_module)
    try:
        build = import_module("fla.ops.cp").build_cp_context
    except Exception as exc:  # noqa: BLE001
        return FLAFeatures(None, f"fla.ops.cp.build_cp_context is not importable ({type(exc).__name__}: {exc})",
                           **found)
    if not all("cp_context" in _params(fn) for fn in kernels):
        return FLAFeatures(None, "FLA's chunk_gated_delta_rule / causal_conv1d take no cp_context argument", **found)
    params = _params(build)
    size_arg = next((a for a in ("conv1d_kernel_size", "kernel_size") if a in params), None)
    if size_arg is None:  # named conv1d_kernel_size in 0.4.x, kernel_size in some later trees
        return FLAFeatures(None, "fla.ops.cp.build_cp_context takes no conv kernel size argument", **found)
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
        **found,
    )


@functools.lru_cache(maxsize=1)
def features() -> FLAFeatures:
    """:func:`probe` of this process's FLA, computed once."""
    return probe()


@functools.lru_cache(maxsize=1)
def fla_version() -> str | None:
    """Installed FLA version string (from package metadata; FLA is not imported), or None."""
    version = dist_version("fla-core", "flash-linear-attention")
    if version is not None:
        return version
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
    """True when ``build_cp_context`` also takes ``layout=`` (FLA >= 0.6: a zigzag cp context, which
    chunkwise uses on rows that are one zigzag-cut stream, with no layout all-to-all)."""
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


def gdn_kernel_backends(import_module: Callable = importlib.import_module) -> list[dict]:
    """The backends FLA (>= 0.6) may dispatch ``chunk_gated_delta_rule`` to instead of its own Triton
    kernels, best first: ``[{"name", "package", "available", "enabled", "env_var"}]`` (e.g. FlashQLA,
    ``flash_qla`` on TileLang: enabled by default whenever it imports, ``FLA_FLASH_QLA=0`` turns it
    off; FLA still uses Triton for a call its verifier refuses, e.g. under a cp context). Empty for
    an FLA without the registry (0.4.x) or when FLA does not import. Read afresh on every call (the
    switches are environment variables); never raises."""
    try:
        import_module("fla.ops.gated_delta_rule")  # registers its backends
        registry = getattr(import_module("fla.backends"), "_operation_registries", {}).get("gated_delta_rule")
        backends = registry._get_sorted_backends() if registry is not None else []
    except Exception:  # noqa: BLE001 - detection must never raise
        return []
    out = []
    for b in backends:
        try:
            out.append({"name": str(b.backend_type), "package": getattr(b, "package_name", None),
                        "available": bool(b.is_available()), "enabled": bool(b.is_enabled()),
                        "env_var": getattr(b, "env_var", None)})
        except Exception:  # noqa: BLE001
            continue
    return out


_DISPATCH_FILE = "fla/backends.py"  # where FLA >= 0.6 defines its dispatch wrapper


def own_kernel(fn: Callable) -> tuple[Callable, bool]:
    """``(FLA's own function behind its backend dispatch, True)``, or ``(fn, False)`` where ``fn`` is
    not dispatched (FLA 0.4.x, a fake).

    FLA >= 0.6 wraps ``chunk_gated_delta_rule`` in ``fla.backends``' dispatch, which hands a call to
    the first registered backend whose verifier accepts it: FlashQLA (``flash_qla``) whenever it is
    installed, on Hopper, bf16/fp16, head dims 128, no cp context (``FLA_FLASH_QLA=0`` turns it off).
    gdn-cp's FLA backend calls the function inside instead, so that it runs the kernels its name
    says (FLA's Triton kernels) whatever else is installed; FlashQLA is its own backend
    (``linear_cp_backend='flashqla'``). The dispatch wrapper is found along the ``__wrapped__``
    chain by the file its code lives in; the function inside is kept out of torch.compile graphs
    as FLA keeps the wrapper."""
    f, depth = fn, 0
    while f is not None and depth < 16:
        code = getattr(f, "__code__", None)
        if code is not None and code.co_filename.replace("\\", "/").endswith(_DISPATCH_FILE):
            inner = getattr(f, "__wrapped__", None)
            if inner is None:
                return fn, False
            import torch

            return torch.compiler.disable(inner), True
        f, depth = getattr(f, "__wrapped__", None), depth + 1
    return fn, False


@functools.lru_cache(maxsize=1)
def fla_own_gated_delta_rule() -> tuple[Callable, bool]:
    """``own_kernel(fla.ops.gated_delta_rule.chunk_gated_delta_rule)``, looked up once (imports FLA)."""
    return own_kernel(importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule)


def _kernel_backend_text(backends: list[dict]) -> str:
    """What gdn-cp's FLA backend runs, and what FLA's own dispatch would have done instead."""
    active = [b for b in backends if b["available"] and b["enabled"]]
    if active:
        b = active[0]
        return (f"FLA's Triton kernels: gdn-cp calls FLA's chunk_gated_delta_rule behind FLA's dispatch, which would "
                f"hand bf16 head-dim-128 calls to {b['name']} ({b['package']}, installed here); gdn-cp runs FlashQLA "
                "only as its own backend (linear_cp_backend='flashqla')")
    off = [f"{b['name']} ({'installed, off: ' + str(b['env_var']) + '=0' if b['available'] else 'not installed'})"
           for b in backends]
    return "FLA's Triton kernels" + (f" (FLA's dispatch registers: {', '.join(off)}; gdn-cp calls FLA's own function "
                                     "behind it)" if off else "")


def stack_report() -> dict:
    """The FLA stack of this process and what gdn-cp uses of it, for logs, ``doctor`` and ``selftest``.

    ``{"stack": "fla 0.6.0 + triton 3.7.1", "fla": ..., "triton": ..., "choices": {name: text}}``;
    imports FLA (through :func:`features`) unless it is not installed."""
    found = features()
    fla, triton = fla_version(), dist_version("triton")
    report = {"stack": f"fla {fla} + triton {triton}", "fla": fla, "triton": triton, "choices": {}}
    if found.import_error is not None:
        report["choices"]["kernels"] = f"not usable: {found.import_error}"
        return report
    c = report["choices"]
    c["grouped value heads"] = ("q/k at the key heads (FLA's GVA)" if found.grouped_value_heads else
                                "q/k repeated to the value heads (repeat_interleave; this FLA has no GVA)")
    c["kernel backend"] = _kernel_backend_text(gdn_kernel_backends())
    c["gates"] = "computed by gdn-cp before the kernel (fp32 g, sigmoid beta)"
    c["gated norm"] = ("FLA's fused RMSNorm * silu(z) (rms_norm_gated) where out_norm is torch's RMSNorm or "
                       "TransformerEngine's (Megatron's TENorm with normalization='RMSNorm'; zero_centered_gamma "
                       "as weight + 1); the layer's own out_norm, then * act(z), for any other norm"
                       if found.fused_gated_norm else "the layer's own out_norm, then * act(z) (no fused kernel)")
    if found.cp_context_error is not None:
        c["cp context"] = f"not usable: {found.cp_context_error}"
    else:
        c["cp context"] = ("contiguous; zigzag (no layout all-to-all) on rows that are one zigzag-cut stream"
                           if found.zigzag_layout else "contiguous only (zigzag rows are routed to it)")
    return report
