"""The rules a ``TransformerConfig`` and a GatedDeltaNet layer are both held to: the mode against the
heads, TP and CP; SiLU; gdn-cp's settings read from the config's fields and the environment (the
backend's rule: :mod:`.backend`). The config-time hook (:mod:`.config`) applies them when the config is
built, a layer (:mod:`.layer`) on its first call (a hybrid model's config never sees its GDN layers) and
a call (:mod:`.call`) for its CP group's size (a dynamic CP group brings another size).

The mode names and head rules live in :mod:`gdn_cp.modes.spec` (the registry); this module applies
them to Megatron's fields. Imports neither Megatron nor torch (the activation probe and the settings
import torch when they run).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Optional

from gdn_cp.checks import MAX_CP_SIZE, MAX_TP_SIZE, as_int, size_limit_problem
from gdn_cp.modes.spec import AUTO, MODE_NAMES, MODES, auto_choice, heads_error, legal_modes, unknown_mode_error

if TYPE_CHECKING:
    from gdn_cp.modes.settings import Settings

__all__ = ["any_mode_legal", "check_gdn_activation", "check_linear_cp_mode", "checked_sizes", "legal_list",
           "read_settings"]

_RESOLVER = "gdn_cp.megatron.resolve_linear_cp_mode"


def legal_list(names=None) -> str:
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


def checked_sizes(num_key_heads, num_value_heads, tp, cp, *, config: bool = False) -> tuple[int, int, int, int]:
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


def check_linear_cp_mode(mode: Any, *, num_key_heads: Any, num_value_heads: Any, tp: Any, cp: Any) -> str:
    """The one validation of a concrete ``linear_cp_mode`` against the GDN heads and TP / CP sizes.

    Returns ``mode``. Raises ValueError naming the field, its value and the fix: for ``auto``
    (it must be resolved before the model is built), unknown modes, sizes that are not positive
    integers, and heads the mode cannot split (see :func:`gdn_cp.modes.spec.head_problem`).
    """
    if isinstance(mode, str) and mode == AUTO:
        try:
            k, v, tp, cp = checked_sizes(num_key_heads, num_value_heads, tp, cp)
        except ValueError:  # the sizes are not the problem named here
            pass
        else:
            auto_choice(k, v, tp, cp)  # no mode legal (why a hybrid model's config left it unresolved): that error
        raise ValueError(
            "linear_cp_mode='auto' must be resolved before the model is built: the patched "
            "TransformerConfig resolves it when the config is built (a field set to 'auto' later is "
            f"not); set a concrete mode ({legal_list()}) or resolve it with {_RESOLVER}('auto', "
            "num_key_heads=..., num_value_heads=..., tp=..., cp=...)."
        )
    if not isinstance(mode, str) or mode not in MODES:
        raise unknown_mode_error(mode)
    k, v, tp, cp = checked_sizes(num_key_heads, num_value_heads, tp, cp)
    error = heads_error(mode, num_key_heads=k, num_value_heads=v, tp=tp, cp=cp)
    if error is not None:
        raise error
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


def any_mode_legal(k: int, v: int, tp: int, cp: int) -> bool:
    return bool(legal_modes(k, v, tp, cp))



def read_settings(fields: Any, environ: Optional[Mapping[str, str]] = None) -> Settings:
    """gdn-cp's :class:`~gdn_cp.modes.settings.Settings` of a ``TransformerConfig`` whose fields the
    pin's adapter read (``ConfigFields``: ``linear_cp_mode``, ``linear_cp_thd_split``,
    ``linear_cp_backend``, ``deterministic_mode``), with the environment's ``GDN_CP_*`` settings, checked
    now. ValueError / TypeError naming the field or the variable. Read when the config is built and
    once per layer (:func:`gdn_cp.megatron.layer.layer_state`; :func:`gdn_cp.megatron.layer.reset_settings`
    reads them again)."""
    from gdn_cp.modes.settings import Settings  # imports torch (the THD cuts' names live with the layouts)

    return Settings.from_environment(environ, mode=fields.linear_cp_mode, thd_split=fields.thd_split,
                                     backend=fields.linear_cp_backend, deterministic=fields.deterministic)
