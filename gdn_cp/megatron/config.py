"""``linear_cp_mode`` at the Megatron boundary: the one check, ``auto`` resolution, and the hook
the patched ``TransformerConfig`` calls. The mode names and head rules live in
:mod:`gdn_cp.modes.spec` (the registry); this module only applies them to Megatron's fields.

Who calls what:

* the patched ``TransformerConfig.__post_init__`` calls :func:`configure_linear_cp_mode`: it
  resolves ``"auto"`` once, before any model is built (logged with the reason; the field then
  holds the concrete mode) and, for a config that builds GDN layers, checks the heads against
  TP / CP (replacing stock 0.19.2's "heads divisible by TP*CP" assertion);
* the patched ``GatedDeltaNet.forward`` reads its settings with :func:`read_settings` and calls
  :func:`check_linear_cp_mode` with the layer's heads, TP and the CP size of the call (dynamic CP
  groups; hybrid models, whose config never ran the GDN checks), and :func:`check_gdn_activation`
  on every layer's first call;
* users may call :func:`resolve_linear_cp_mode` themselves; ``gdn-cp doctor`` calls
  :func:`explain_linear_cp_modes`.

The patched field defaults to ``auto``, so a config that only sets ``context_parallel_size`` runs
chunkwise, legal for the most head counts (upstream Megatron-LM's own ``linear_cp_mode`` defaults to
chunkwise too); ``headwise``, stock 0.19.2's one scheme, is chosen by name (the pin's ``STOCK_MODE``
is what a config without the field runs). Each GDN layer logs the mode it runs on its first call
(:mod:`gdn_cp.megatron.gdn`).

``auto`` depends on the heads, TP and CP alone, never on the machine: the same config resolves to
the same mode on a CPU node and a GPU node, with or without FLA. It picks the first legal mode in
the registry's ``auto_rank`` order (chunkwise, headwise, all_gather). chunkwise is legal wherever
any mode is (heads divisible by TP), so ``auto`` never picks the O(cp) all_gather fallback. Why
chunkwise first: every rank runs CP=1 work on its T/cp tokens (as headwise does on its heads), it
moves fewer bytes per token than headwise (docs/megatron.md, "chunkwise: where the layout swap happens") and
it takes any head count; where FLA's cp context cannot run, gdn-cp's own halo/state exchange gives
the same numbers. Megatron-LM rebuilds the config every micro-batch: the resolution is logged at
INFO once per process and request, at DEBUG after that.

Megatron's fields are read through the pin's adapter (:mod:`gdn_cp.megatron.pins`). This module
imports neither Megatron nor torch.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import TYPE_CHECKING, Any, Optional

from gdn_cp.checks import MAX_CP_SIZE, MAX_TP_SIZE, as_int, size_limit_problem
from gdn_cp.env import CHUNKWISE_PATH_ENV, CHUNKWISE_SWAP_ENV
from gdn_cp.modes.spec import AUTO, MODE_CHOICES, MODE_NAMES, MODES, get_mode, head_problem, unknown_mode_error

if TYPE_CHECKING:
    from gdn_cp.modes.settings import Settings

__all__ = [
    "AUTO",
    "MODE_CHOICES",
    "check_gdn_activation",
    "check_linear_cp_mode",
    "configure_linear_cp_mode",
    "read_settings",
    "resolve_linear_cp_mode",
    "explain_linear_cp_modes",
]

_logger = logging.getLogger(__name__)

_RESOLVER = "gdn_cp.megatron.resolve_linear_cp_mode"
_LOGGED: set = set()  # (requested, resolved, heads, tp, cp) already logged at INFO by this process


def _legal_list(names=None) -> str:
    return ", ".join(repr(m) for m in (MODE_NAMES if names is None else names))


# What the sizes are called in a message: the keyword arguments of the public functions, or the
# TransformerConfig fields when the config hook checks them (never the one for the other).
_ARGUMENTS = ("num_key_heads", "num_value_heads", "tp", "cp")
_CONFIG_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "tensor_model_parallel_size", "context_parallel_size")


def _positive_int(name: str, value: Any, fix: str) -> int:
    """``value`` as an int (integer-likes such as NumPy integers accepted, see :mod:`gdn_cp.checks`)."""
    n = as_int(value)
    if n is None or n < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer; {fix}.")
    return n


def _checked_sizes(num_key_heads, num_value_heads, tp, cp, *, config: bool = False) -> tuple[int, int, int, int]:
    """Positive ints, and value heads a multiple of key heads (the GDN grouping every mode needs).

    Messages name the keyword arguments, or with ``config`` the TransformerConfig fields."""
    names = _CONFIG_FIELDS if config else _ARGUMENTS
    fix = "set it in the TransformerConfig" if config else "pass an int"
    k, v, tp, cp = (_positive_int(n, x, fix) for n, x in zip(names, (num_key_heads, num_value_heads, tp, cp)))
    for name, value, limit, what in ((names[2], tp, MAX_TP_SIZE, "TP group"), (names[3], cp, MAX_CP_SIZE, "CP group")):
        too_large = size_limit_problem(value, limit, what)
        if too_large:
            raise ValueError(f"{name}={value} is {too_large}.")
    if v % k:
        raise ValueError(
            f"{names[1]}={v} must be a multiple of {names[0]}={k} (value head h reads key "
            f"head h // (value heads / key heads)); choose head counts where it is, e.g. {k},{2 * k}."
        )
    return k, v, tp, cp


def _fix_hint(mode: str, k: int, v: int, tp: int, cp: int) -> str:
    """What to change so that ``mode`` (illegal for these heads) or another mode works."""
    others = [m for m in MODE_NAMES if m != mode and head_problem(m, num_key_heads=k, num_value_heads=v, tp=tp, cp=cp) is None]
    own = (
        "choose tensor_model_parallel_size * context_parallel_size dividing both head counts"
        if get_mode(mode).divides_by_cp
        else "choose a tensor_model_parallel_size that divides both head counts"
    )
    if not others:
        return own
    return f"set linear_cp_mode to {' or '.join(repr(m) for m in others)}, which these heads allow, or {own}"


def check_linear_cp_mode(mode: Any, *, num_key_heads: Any, num_value_heads: Any, tp: Any, cp: Any) -> str:
    """The one validation of a concrete ``linear_cp_mode`` against the GDN heads and TP / CP sizes.

    Returns ``mode``. Raises ValueError naming the field, its value and the fix: for ``auto``
    (it must be resolved before the model is built), unknown modes, sizes that are not positive
    integers, and heads the mode cannot split (see :func:`gdn_cp.modes.spec.head_problem`).
    """
    if isinstance(mode, str) and mode == AUTO:
        try:
            k, v, tp, cp = _checked_sizes(num_key_heads, num_value_heads, tp, cp)
            unresolvable = not _any_mode_legal(k, v, tp, cp)
        except ValueError:  # the sizes are not the problem named here
            unresolvable = False
        if unresolvable:  # why a hybrid model's config left it unresolved
            problems = [f"{m} is illegal ({head_problem(m, num_key_heads=k, num_value_heads=v, tp=tp, cp=cp)})"
                        for m in MODE_NAMES]
            raise ValueError(
                "linear_cp_mode='auto': no mode is legal: " + "; ".join(problems)
                + ". Fix: choose a tensor_model_parallel_size that divides both head counts."
            )
        raise ValueError(
            "linear_cp_mode='auto' must be resolved before the model is built: the patched "
            "TransformerConfig resolves it when the config is built (a field set to 'auto' later is "
            f"not); set a concrete mode ({_legal_list()}) or resolve it with {_RESOLVER}('auto', "
            "num_key_heads=..., num_value_heads=..., tp=..., cp=...)."
        )
    if not isinstance(mode, str) or mode not in MODES:
        raise unknown_mode_error(mode)
    k, v, tp, cp = _checked_sizes(num_key_heads, num_value_heads, tp, cp)
    problem = head_problem(mode, num_key_heads=k, num_value_heads=v, tp=tp, cp=cp)
    if problem is not None:
        raise ValueError(
            f"linear_cp_mode={mode!r} with tensor_model_parallel_size={tp}, context_parallel_size={cp}: "
            f"{problem}. Fix: {_fix_hint(mode, k, v, tp, cp)}."
        )
    return mode


_SILU_NAMES = ("silu", "swish")  # the names FLA's conv takes for SiLU (stock passes act_fn.__name__)


def _activation_not_silu(act: Any) -> Optional[str]:
    """None when ``act`` computes SiLU: ``torch.nn.functional.silu`` itself, or a function named
    ``silu`` / ``swish`` that gives SiLU's values on a probe (fp64, [-10, 10]); else the detail the
    message adds ("" for a function that does not even claim to be SiLU)."""
    import torch
    import torch.nn.functional as F

    if act is F.silu:
        return None
    name = getattr(act, "__name__", None)
    if name not in _SILU_NAMES:
        return ""
    probe = torch.linspace(-10.0, 10.0, 41, dtype=torch.float64)
    try:
        got = act(probe)
    except Exception as e:  # noqa: BLE001 - any failure means it is not usable as SiLU
        return f" (named {name!r}, but it raised {type(e).__name__}: {e} on a float64 CPU tensor)"
    if not isinstance(got, torch.Tensor) or got.shape != probe.shape or not torch.allclose(
            got.double(), F.silu(probe), rtol=1e-6, atol=1e-9):
        return f" (named {name!r}, but it does not compute SiLU)"
    return None


def check_gdn_activation(act: Any, *, owner: str = "TransformerConfig.") -> None:
    """ValueError unless ``act`` (``TransformerConfig.activation_func``, a GDN layer's ``act_fn``)
    computes SiLU. A GDN layer applies it after its conv and to its output gate; the kernels
    (FLA's conv and fused gated norm, gdn-cp's modes) compute SiLU whatever the config says, and
    stock megatron-core 0.19.2 asserts ``activation in ['silu', 'swish']`` at run time, so any
    other activation would make some path compute something else than the configured model.
    ``owner`` starts the message (the field's owner, e.g. ``"TransformerConfig."``)."""
    why = _activation_not_silu(act)
    if why is None:
        return
    name = getattr(act, "__name__", None) or repr(act)
    raise ValueError(
        f"{owner}activation_func={name}{why}, but gated delta net layers need SiLU: their conv and output gate "
        "compute SiLU (FLA's kernels, gdn-cp's modes), so another activation would not be the configured one. "
        "Fix: Megatron-LM: add --swiglu; Python: TransformerConfig(..., activation_func=torch.nn.functional.silu)."
    )


def _auto_choice(k: int, v: int, tp: int, cp: int) -> tuple[str, str]:
    """``auto``: the first legal mode in the registry's ``auto_rank`` order. Returns ``(mode,
    reason)``; a pure function of the sizes (a few integer checks)."""
    skipped: list[str] = []
    ordered = sorted(MODES.values(), key=lambda s: s.auto_rank)
    order = ", ".join(s.name for s in ordered)
    for spec in ordered:
        problem = head_problem(spec.name, num_key_heads=k, num_value_heads=v, tp=tp, cp=cp)
        if problem is not None:
            skipped.append(f"{spec.name} is illegal ({problem})")
            continue
        chosen = f"the first legal mode of {order}: heads divisible by {spec.divisor_text(tp, cp)}; {spec.cost}"
        return spec.name, "; ".join(skipped + [chosen])
    raise ValueError(
        "linear_cp_mode='auto': no mode is legal: "
        + "; ".join(skipped)
        + ". Fix: choose a tensor_model_parallel_size that divides both head counts."
    )


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
        k, v, tp, cp = _checked_sizes(num_key_heads, num_value_heads, tp, cp)
        mode, reason = _auto_choice(k, v, tp, cp)
    elif not isinstance(requested, str) or requested not in MODES:
        raise unknown_mode_error(requested)
    else:
        k, v, tp, cp = _checked_sizes(num_key_heads, num_value_heads, tp, cp)
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


def _any_mode_legal(k: int, v: int, tp: int, cp: int) -> bool:
    return any(head_problem(m, num_key_heads=k, num_value_heads=v, tp=tp, cp=cp) is None for m in MODE_NAMES)


@functools.lru_cache(maxsize=64)
def _settings(mode, thd_split, backend, deterministic, path: str, swap: str) -> Settings:
    from gdn_cp.modes.settings import Settings  # imports torch

    return Settings.from_environment({CHUNKWISE_PATH_ENV: path, CHUNKWISE_SWAP_ENV: swap}, mode=mode,
                                     thd_split=thd_split, backend=backend, deterministic=deterministic)


def read_settings(fields: Any) -> Settings:
    """gdn-cp's :class:`~gdn_cp.modes.settings.Settings` of a ``TransformerConfig`` whose fields the
    pin's adapter read (``ConfigFields``: ``linear_cp_mode``, ``linear_cp_thd_split``,
    ``linear_cp_backend``, ``deterministic_mode``), with the environment's (``GDN_CP_CHUNKWISE_PATH``,
    ``GDN_CP_CHUNKWISE_SWAP``), read on every call (a field set later, a variable changed, is seen)
    and checked once per distinct value. ValueError / TypeError naming the field or the variable."""
    environ = (os.environ.get(CHUNKWISE_PATH_ENV, ""), os.environ.get(CHUNKWISE_SWAP_ENV, ""))
    values = (fields.linear_cp_mode, fields.thd_split, fields.linear_cp_backend, fields.deterministic)
    try:
        return _settings(*values, *environ)
    except TypeError:  # a field that cannot be a cache key (a list, a dict): checked, and refused, uncached
        return _settings.__wrapped__(*values, *environ)


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

    A named ``linear_cp_backend`` must also run here
    (:func:`gdn_cp.megatron.backend.check_linear_cp_backend`).
    """
    from gdn_cp.megatron.pins import load_adapter

    from gdn_cp.megatron.backend import check_linear_cp_backend

    adapter = load_adapter()
    f = adapter.read_config(config)
    settings = read_settings(f)
    check_linear_cp_backend(settings.backend, builds_gdn=f.builds_gdn or f.hybrid, deterministic=settings.deterministic,
                            head_dims=f.head_dims, dtype=f.params_dtype)
    mode = settings.mode
    if not (f.builds_gdn or f.hybrid):
        return mode
    k, v, tp, cp = _checked_sizes(f.num_key_heads, f.num_value_heads, f.tp, f.cp, config=True)
    if mode == AUTO:
        if not f.builds_gdn and not _any_mode_legal(k, v, tp, cp):
            return mode  # a hybrid model that may have no GDN layer: its GDN layers raise, if any
        try:
            mode = resolve_linear_cp_mode(AUTO, num_key_heads=k, num_value_heads=v, tp=tp, cp=cp, logger=logger)
        except ValueError as e:
            raise ValueError(
                f"{e} (TransformerConfig with linear_cp_mode='auto' resolves it from these fields; "
                f"or set a concrete linear_cp_mode, one of {_legal_list()})"
            ) from None
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
    k, v, tp, cp = _checked_sizes(num_key_heads, num_value_heads, tp, cp)
    out: dict[str, dict[str, Any]] = {}
    for name, spec in MODES.items():
        problem = head_problem(name, num_key_heads=k, num_value_heads=v, tp=tp, cp=cp)
        if problem is None:
            out[name] = {"legal": True, "reason": f"heads divisible by {spec.divisor_text(tp, cp)}; {spec.cost}"}
        else:
            out[name] = {"legal": False, "reason": problem}
    try:
        mode, reason = _auto_choice(k, v, tp, cp)
        out[AUTO] = {"legal": True, "resolved": mode, "reason": reason}
    except ValueError as e:
        out[AUTO] = {"legal": False, "resolved": None, "reason": str(e)}
    return out
