"""`linear_cp_mode`: the legal values, their head-count rules, validation and `auto` resolution.

The patched Megatron-Core ``TransformerConfig`` calls :func:`validate_linear_cp_mode` from its
gated_delta_net checks (instead of stock 0.19.2's "heads divisible by TP*CP" assertion), and
:func:`resolve_linear_cp_mode` turns ``"auto"`` into one concrete mode before the model is built.

Rules (``K`` = linear_num_key_heads, ``V`` = linear_num_value_heads):

=============  ==========================  =================================================
mode           heads must be divisible by  cost
=============  ==========================  =================================================
headwise       TP * CP                     two all-to-alls of every activation (stock scheme)
chunkwise      TP                          per-rank work = CP=1 work on T/CP tokens
all_gather     TP                          CP x compute and O(T) activation memory
=============  ==========================  =================================================

This module imports neither Megatron nor torch at import time (torch and FLA are only looked
at when ``auto`` has to detect the device / FLA and was not told).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

__all__ = [
    "LINEAR_CP_MODES",
    "AUTO",
    "linear_cp_mode_problem",
    "validate_linear_cp_mode",
    "detect_fla_cp",
    "resolve_linear_cp_mode",
    "explain_linear_cp_modes",
]

LINEAR_CP_MODES = ("headwise", "chunkwise", "all_gather")
AUTO = "auto"

_logger = logging.getLogger(__name__)

_RESOLVER = "gdn_cp.megatron.resolve_linear_cp_mode"


def _legal_list() -> str:
    return ", ".join(repr(m) for m in LINEAR_CP_MODES)


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer.")
    return value


def _divisor(mode: str, tp: int, cp: int) -> int:
    return tp * cp if mode == "headwise" else tp


def linear_cp_mode_problem(
    mode: str, *, num_key_heads: int, num_value_heads: int, tp: int, cp: int
) -> Optional[str]:
    """Why ``mode`` is illegal for these heads and TP / CP sizes, or ``None`` when it is legal.

    ``mode`` must be one of :data:`LINEAR_CP_MODES` (``auto`` and unknown values raise).
    """
    if mode not in LINEAR_CP_MODES:
        raise ValueError(f"linear_cp_mode={mode!r} is not a concrete mode; use one of {_legal_list()}.")
    tp = _check_positive_int("tensor_model_parallel_size", tp)
    cp = _check_positive_int("context_parallel_size", cp)
    num_key_heads = _check_positive_int("linear_num_key_heads", num_key_heads)
    num_value_heads = _check_positive_int("linear_num_value_heads", num_value_heads)
    div = _divisor(mode, tp, cp)
    what = f"TP*CP={tp}*{cp}={div}" if mode == "headwise" else f"TP={tp}"
    bad = [
        f"{field}={value} is not divisible by {what}"
        for field, value in (
            ("linear_num_key_heads", num_key_heads),
            ("linear_num_value_heads", num_value_heads),
        )
        if value % div != 0
    ]
    return "; ".join(bad) if bad else None


def _fix_hint(mode: str, num_key_heads: int, num_value_heads: int, tp: int, cp: int) -> str:
    if mode == "headwise":
        others = [
            m
            for m in ("chunkwise", "all_gather")
            if linear_cp_mode_problem(
                m, num_key_heads=num_key_heads, num_value_heads=num_value_heads, tp=tp, cp=cp
            )
            is None
        ]
        hint = (
            "choose tensor_model_parallel_size * context_parallel_size dividing both head counts"
        )
        if others:
            hint = (
                f"set linear_cp_mode='chunkwise' (or 'all_gather'), which only needs the heads "
                f"divisible by TP, or {hint}"
            )
        return hint
    return "choose a tensor_model_parallel_size that divides both head counts"


def validate_linear_cp_mode(config: Any) -> None:
    """Check ``config.linear_cp_mode`` against the GDN head counts and TP / CP sizes.

    Called by the patched ``TransformerConfig.__post_init__`` (gated_delta_net branch). Reads
    ``linear_cp_mode`` (default ``"headwise"`` when absent), ``linear_num_key_heads``,
    ``linear_num_value_heads``, ``tensor_model_parallel_size`` and ``context_parallel_size``.

    Raises:
        ValueError: naming the field, its value and the fix.
    """
    mode = getattr(config, "linear_cp_mode", "headwise")
    if mode == AUTO:
        raise ValueError(
            "linear_cp_mode='auto' cannot be used in TransformerConfig directly: resolve it "
            f"before building the config/model with {_RESOLVER}('auto', num_key_heads=..., "
            "num_value_heads=..., tp=..., cp=...) and pass the returned mode "
            f"({_legal_list()}) as linear_cp_mode."
        )
    if not isinstance(mode, str) or mode not in LINEAR_CP_MODES:
        raise ValueError(
            f"linear_cp_mode={mode!r} is not a known mode; set it to one of {_legal_list()} "
            f"(or resolve 'auto' with {_RESOLVER} before building the config)."
        )
    tp = getattr(config, "tensor_model_parallel_size", 1) or 1
    cp = getattr(config, "context_parallel_size", 1) or 1
    k = getattr(config, "linear_num_key_heads", None)
    v = getattr(config, "linear_num_value_heads", None)
    problem = linear_cp_mode_problem(mode, num_key_heads=k, num_value_heads=v, tp=tp, cp=cp)
    if problem is not None:
        raise ValueError(
            f"linear_cp_mode={mode!r} with tensor_model_parallel_size={tp}, "
            f"context_parallel_size={cp}: {problem}. Fix: {_fix_hint(mode, k, v, tp, cp)}."
        )


def detect_fla_cp(device_type: Optional[str] = None) -> tuple[bool, str]:
    """Whether FLA's chunkwise CP path is usable here: a CUDA device and a usable FLA cp context.
    Returns ``(usable, reason)``; ``device_type`` (``"cuda"`` / ``"cpu"``) overrides device
    detection. The one detector is :func:`gdn_cp.ops.fla.detect.detect_fla_cp` (imported here
    on first call, so importing this module stays light)."""
    from ..ops.fla.detect import detect_fla_cp as detect

    return detect(device_type)


def _resolve(
    requested: str,
    *,
    num_key_heads: int,
    num_value_heads: int,
    tp: int,
    cp: int,
    device_type: Optional[str],
    fla_usable: Optional[bool],
) -> tuple[str, str]:
    if requested in LINEAR_CP_MODES:
        problem = linear_cp_mode_problem(
            requested, num_key_heads=num_key_heads, num_value_heads=num_value_heads, tp=tp, cp=cp
        )
        if problem is not None:
            raise ValueError(
                f"linear_cp_mode={requested!r} with tensor_model_parallel_size={tp}, "
                f"context_parallel_size={cp}: {problem}. "
                f"Fix: {_fix_hint(requested, num_key_heads, num_value_heads, tp, cp)}."
            )
        return requested, "explicitly requested and legal for these heads"
    if requested != AUTO:
        raise ValueError(
            f"linear_cp_mode={requested!r} is not a known mode; use one of {_legal_list()} "
            f"or {AUTO!r}."
        )

    problems = {
        m: linear_cp_mode_problem(
            m, num_key_heads=num_key_heads, num_value_heads=num_value_heads, tp=tp, cp=cp
        )
        for m in LINEAR_CP_MODES
    }
    if problems["chunkwise"] is not None:  # chunkwise and all_gather share the TP-only rule
        raise ValueError(
            f"linear_cp_mode='auto': no mode is legal: {problems['chunkwise']}. "
            "Fix: choose a tensor_model_parallel_size that divides both head counts."
        )
    if fla_usable is None:
        fla_usable, fla_reason = detect_fla_cp(device_type)
    else:
        fla_reason = "FLA CP path given as usable" if fla_usable else "FLA CP path given as unusable"
    if fla_usable:
        return "chunkwise", f"FLA chunkwise CP path usable ({fla_reason})"
    if problems["headwise"] is None:
        return "headwise", f"FLA CP path not usable ({fla_reason}); heads divisible by TP*CP"
    return "all_gather", (
        f"FLA CP path not usable ({fla_reason}) and headwise is illegal "
        f"({problems['headwise']}); all_gather costs CP x compute"
    )


def resolve_linear_cp_mode(
    requested: str,
    *,
    num_key_heads: int,
    num_value_heads: int,
    tp: int,
    cp: int,
    device_type: Optional[str] = None,
    fla_usable: Optional[bool] = None,
    logger: Optional[logging.Logger] = None,
) -> str:
    """Turn a requested ``linear_cp_mode`` into the concrete mode to build the model with.

    Call it once, before building the TransformerConfig / model, and pass the result as
    ``linear_cp_mode``. Explicit modes are validated and returned unchanged. ``"auto"`` picks
    ``chunkwise`` when FLA's CP path is usable (CUDA device and ``fla.ops.cp.build_cp_context``
    importable; detected unless ``fla_usable`` / ``device_type`` are given), else ``headwise``
    when both head counts divide TP*CP, else ``all_gather``. One INFO line is logged with the
    requested and resolved modes, TP, CP, the heads and the reason. Never falls back silently:
    an illegal explicit mode raises ``ValueError``.
    """
    mode, reason = _resolve(
        requested,
        num_key_heads=num_key_heads,
        num_value_heads=num_value_heads,
        tp=tp,
        cp=cp,
        device_type=device_type,
        fla_usable=fla_usable,
    )
    (logger or _logger).info(
        "gdn-cp linear_cp_mode: requested=%s resolved=%s (tp=%d, cp=%d, "
        "linear_num_key_heads=%d, linear_num_value_heads=%d): %s",
        requested,
        mode,
        tp,
        cp,
        num_key_heads,
        num_value_heads,
        reason,
    )
    return mode


def explain_linear_cp_modes(
    *,
    num_key_heads: int,
    num_value_heads: int,
    tp: int,
    cp: int,
    device_type: Optional[str] = None,
    fla_usable: Optional[bool] = None,
) -> dict[str, dict[str, Any]]:
    """Per mode, whether it is legal and why, plus what ``auto`` resolves to (for ``gdn-cp doctor``).

    Returns ``{"headwise": {"legal": bool, "reason": str}, "chunkwise": ..., "all_gather": ...,
    "auto": {"legal": bool, "resolved": str | None, "reason": str}}``.
    """
    out: dict[str, dict[str, Any]] = {}
    costs = {
        "headwise": "two all-to-alls of every activation",
        "chunkwise": "per-rank compute of T/CP tokens plus a small state/halo exchange",
        "all_gather": "CP x compute and O(T) activation memory",
    }
    for m in LINEAR_CP_MODES:
        problem = linear_cp_mode_problem(
            m, num_key_heads=num_key_heads, num_value_heads=num_value_heads, tp=tp, cp=cp
        )
        div = "TP*CP" if m == "headwise" else "TP"
        if problem is None:
            out[m] = {"legal": True, "reason": f"heads divisible by {div}; costs {costs[m]}"}
        else:
            out[m] = {"legal": False, "reason": problem}
    try:
        mode, reason = _resolve(
            AUTO,
            num_key_heads=num_key_heads,
            num_value_heads=num_value_heads,
            tp=tp,
            cp=cp,
            device_type=device_type,
            fla_usable=fla_usable,
        )
        out[AUTO] = {"legal": True, "resolved": mode, "reason": reason}
    except ValueError as e:
        out[AUTO] = {"legal": False, "resolved": None, "reason": str(e)}
    return out
