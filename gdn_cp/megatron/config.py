"""Config time: the hook the patched ``TransformerConfig.__post_init__`` calls, ``auto`` resolved once,
and ``gdn-cp doctor``'s table of modes (the rules it applies, shared with the layers: :mod:`.rules`).

* :func:`configure_linear_cp_mode` (the hook): every gdn-cp setting of the config and the environment
  checked (:func:`gdn_cp.megatron.rules.read_settings`), ``"auto"`` resolved once, before any model is
  built (logged with the reason; the field then holds the concrete mode) and, for a config that builds
  GDN layers, the heads checked against TP / CP (replacing stock 0.19.2's "heads divisible by TP*CP"
  assertion) and the activation (:mod:`gdn_cp.megatron.rules`, which a layer's first call applies too);
  a named ``linear_cp_backend`` that cannot run here (not installed, no GPU, head dims or a dtype its
  kernels refuse, ``deterministic_mode``) fails then, with the field, the value, why and the fix; ``auto``
  stays ``auto`` (it depends on the device the layer runs on);
* users may call :func:`resolve_linear_cp_mode` themselves; ``gdn-cp doctor`` calls
  :func:`explain_linear_cp_modes`.

The patched field defaults to ``auto``, so a config that only sets ``context_parallel_size`` runs
chunkwise, legal for the most head counts (upstream Megatron-LM's own ``linear_cp_mode`` defaults to
chunkwise too); ``headwise``, stock 0.19.2's one scheme, is chosen by name (the pin's ``STOCK_MODE``
is what a config without the field runs). Each GDN layer logs the mode it runs on its first call
(:mod:`gdn_cp.megatron.call`).

``auto`` depends on the heads, TP and CP alone, never on the machine: the same config resolves to
the same mode on a CPU node and a GPU node, with or without FLA. It picks the first legal mode in
the registry's ``auto_rank`` order (chunkwise, headwise, all_gather). chunkwise is legal wherever
any mode is (heads divisible by TP), so ``auto`` never picks the O(cp) all_gather fallback. Why
chunkwise first: every rank runs CP=1 work on its T/cp tokens (as headwise does on its heads), it
moves fewer bytes per token than headwise (docs/megatron.md, "chunkwise: where the layout swap happens") and
it takes any head count; where FLA's cp context cannot run, gdn-cp's own halo/state exchange gives
the same numbers. Megatron-LM rebuilds the config every micro-batch: the resolution is logged at
INFO once per process and request, at DEBUG after that.

Megatron's fields are read through the running release's adapter (:func:`gdn_cp.pins.running_release`,
looked up when the hook runs). This module
imports neither Megatron nor torch (the settings and the backend check import torch when they run).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from gdn_cp.modes.spec import AUTO, MODE_CHOICES, MODES, auto_choice, head_problem, no_legal_mode_error, unknown_mode_error

from ..pins import running_release
from .backend import check_linear_cp_backend
from .rules import any_mode_legal, check_gdn_activation, check_linear_cp_mode, checked_sizes, read_settings

__all__ = [
    "AUTO",
    "MODE_CHOICES",
    "configure_linear_cp_mode",
    "explain_linear_cp_modes",
    "resolve_linear_cp_mode",
]

_logger = logging.getLogger(__name__)

_LOGGED: set = set()  # (requested, resolved, heads, tp, cp) already logged at INFO by this process


def resolve_linear_cp_mode(
    requested: str,
    *,
    num_key_heads: int,
    num_value_heads: int,
    tp: int,
    cp: int,
    logger: Optional[logging.Logger] = None,
) -> str:
    """Turn a requested ``linear_cp_mode`` into the concrete mode to build the model with.

    Explicit modes are checked (:func:`check_linear_cp_mode`) and returned unchanged. ``"auto"``
    picks the first legal mode of chunkwise, headwise, all_gather, from the sizes alone, whatever
    the machine: chunkwise, legal wherever the heads divide TP, i.e. wherever any mode is. An INFO line with the requested and resolved modes, TP, CP, the
    heads and the reason is logged the first time this process resolves a request, DEBUG after.
    Never falls back silently: an illegal explicit mode raises ValueError.
    """
    if logger is not None and not callable(getattr(logger, "log", None)):
        raise TypeError(f"logger must be a logging.Logger or None, got {type(logger).__name__}")
    if isinstance(requested, str) and requested == AUTO:
        k, v, tp, cp = checked_sizes(num_key_heads, num_value_heads, tp, cp)
        mode, reason = auto_choice(k, v, tp, cp)
    elif not isinstance(requested, str) or requested not in MODES:
        raise unknown_mode_error(requested)
    else:
        k, v, tp, cp = checked_sizes(num_key_heads, num_value_heads, tp, cp)
        mode = check_linear_cp_mode(requested, num_key_heads=k, num_value_heads=v, tp=tp, cp=cp)
        reason = "explicitly requested and legal for these heads"
    key = (requested, mode, num_key_heads, num_value_heads, tp, cp)
    first = key not in _LOGGED
    _LOGGED.add(key)
    (logger or _logger).log(
        logging.INFO if first else logging.DEBUG,
        "gdn-cp linear_cp_mode: requested=%s resolved=%s (tp=%d, cp=%d, linear_num_key_heads=%d, "
        "linear_num_value_heads=%d): %s",
        requested, mode, tp, cp, k, v, reason,
    )  # fmt: skip
    return mode


def configure_linear_cp_mode(config: Any, *, logger: Optional[logging.Logger] = None) -> str:
    """The patched ``TransformerConfig.__post_init__`` hook; returns the mode the field holds.

    Every gdn-cp setting of the config and the environment is checked first
    (:func:`read_settings`: an unknown ``linear_cp_mode``, ``linear_cp_thd_split`` or
    ``GDN_CP_*`` value fails when the config is built). Which configs have their GDN heads looked at
    (the rule; docs/megatron.md, "Install, patch, configure"):

    * the config builds GDN layers (``experimental_attention_variant='gated_delta_net'``, where
      stock 0.19.2 checks the heads against TP*CP): ``"auto"`` is resolved here, once, with the
      config's own heads, TP and CP (logged; see :func:`resolve_linear_cp_mode`), the field is
      set to the result, the heads are checked against the mode, and ``activation_func`` must be
      SiLU (:func:`check_gdn_activation`) (ValueError with the fix);
    * a hybrid model (``is_hybrid_model``): its layer pattern, which the config does not see,
      decides whether there are GDN layers. ``"auto"`` is resolved (logged) when some mode is
      legal for the config's heads; when none is, the field keeps ``"auto"`` and the first GDN
      layer's forward, if there is one, raises with the reason. Each GDN layer's forward checks
      the heads against the mode (:func:`check_linear_cp_mode`) and the activation
      (:func:`check_gdn_activation`; Megatron-LM's patched ``validate_args`` checks it earlier from
      ``--hybrid-layer-pattern``);
    * any other config builds no GDN layer: only the settings are checked (a typo still fails);
      nothing is resolved, checked against the heads or logged.

    A named ``linear_cp_backend`` must also run here (:func:`gdn_cp.megatron.backend.check_linear_cp_backend`).

    Args:
        config: the ``TransformerConfig`` being built, read through the running release's adapter
            (:func:`gdn_cp.pins.running_release`, found now).
        logger: where ``auto``'s resolution is logged (default: this module's).

    Returns:
        str: the mode ``config.linear_cp_mode`` holds afterwards (``auto`` resolved, or kept for a hybrid model
        whose heads no mode can split). ValueError / TypeError naming the field, its value and the fix.
    """
    adapter = running_release()  # the running megatron-core's, found now (gdn_cp.pins.lookup)
    f = adapter.read_config(config)
    settings = read_settings(f)
    check_linear_cp_backend(settings.backend, builds_gdn=f.builds_gdn or f.hybrid, deterministic=settings.deterministic,
                            head_dims=f.head_dims, dtype=f.params_dtype)
    mode = settings.mode
    if not (f.builds_gdn or f.hybrid):
        return mode
    k, v, tp, cp = checked_sizes(f.num_key_heads, f.num_value_heads, f.tp, f.cp, config=True)
    if mode == AUTO:
        if not any_mode_legal(k, v, tp, cp):
            if not f.builds_gdn:
                return mode  # a hybrid model that may have no GDN layer: its GDN layers raise, if any
            raise no_legal_mode_error(k, v, tp, cp, context="TransformerConfig with linear_cp_mode='auto' resolves "
                                                             "it from these fields")
        mode = resolve_linear_cp_mode(AUTO, num_key_heads=k, num_value_heads=v, tp=tp, cp=cp, logger=logger)
        adapter.set_linear_cp_mode(config, mode)
    if f.builds_gdn:
        check_linear_cp_mode(mode, num_key_heads=k, num_value_heads=v, tp=tp, cp=cp)
        check_gdn_activation(f.activation)
    return mode


def explain_linear_cp_modes(
    *,
    num_key_heads: int,
    num_value_heads: int,
    tp: int,
    cp: int,
) -> dict[str, dict[str, Any]]:
    """Per mode, whether it is legal and why, plus what ``auto`` resolves to (for ``gdn-cp doctor``).

    Returns ``{mode: {"legal": bool, "reason": str}, ..., "auto": {"legal": bool, "resolved": str |
    None, "reason": str}}`` with the modes in the registry's order.
    """
    k, v, tp, cp = checked_sizes(num_key_heads, num_value_heads, tp, cp)
    out: dict[str, dict[str, Any]] = {}
    for name, spec in MODES.items():
        problem = head_problem(name, num_key_heads=k, num_value_heads=v, tp=tp, cp=cp)
        if problem is None:
            out[name] = {"legal": True, "reason": f"heads divisible by {spec.divisor_text(tp, cp)}; {spec.cost}"}
        else:
            out[name] = {"legal": False, "reason": problem}
    try:
        mode, reason = auto_choice(k, v, tp, cp)
        out[AUTO] = {"legal": True, "resolved": mode, "reason": reason}
    except ValueError as e:
        out[AUTO] = {"legal": False, "resolved": None, "reason": str(e)}
    return out
