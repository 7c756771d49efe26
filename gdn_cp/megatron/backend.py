"""``linear_cp_backend`` at the Megatron boundary: which per-rank math backend the GDN layers run.

The backends and the rule that picks one are :mod:`gdn_cp.ops.registry`'s (``auto``: FlashQLA where it
is installed, runs on the GPU and takes the layer (head dims 128, bf16 / fp16), else FLA where it
imports, else the plain-torch reference; ``deterministic_mode``: the reference). This module applies it
to Megatron's fields, in two places:

* :func:`check_linear_cp_backend`, when the config is built (:mod:`gdn_cp.megatron.config`): a named
  backend that cannot run here (not installed, no GPU, head dims or dtype its kernels refuse,
  ``deterministic_mode``) fails then, with the field, the value, why and the fix. ``auto`` stays
  ``auto``: it depends on the device the layer runs on;
* :func:`choose_backend`, on each layer's first call (:mod:`gdn_cp.megatron.layer`): the registry's
  answer for the layer's settings, device, head dims and dtype, logged at INFO once per process and
  answer; a named backend that cannot run is a ValueError there too, before any collective. Never a
  switch to another backend on its own.

The value itself (``auto`` or a backend) is checked with the other settings
(:class:`gdn_cp.modes.settings.Settings`). Megatron's fields are read through the pin's adapter.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

from ..ops.registry import AUTO as AUTO_BACKEND
from ..ops.registry import AUTO_ORDER, ORACLE, get_backend, resolve_backend

if TYPE_CHECKING:
    from ..modes.settings import Settings
    from ..ops.contract import Backend

__all__ = ["BACKEND_FIELD", "backend_fix", "check_linear_cp_backend", "choose_backend", "dtype_name"]

logger = logging.getLogger(__name__)

BACKEND_FIELD = "linear_cp_backend"
_LOGGED_CHOICES: set = set()  # (requested, device type, deterministic, head dims, dtype): logged at INFO once


def backend_fix() -> str:
    """The fix a refused ``linear_cp_backend`` names."""
    return (f"set {BACKEND_FIELD}='{AUTO_BACKEND}' (the first of {AUTO_ORDER} that runs here and takes the layer) or "
            f"'{ORACLE}' (plain torch, any device and dtype); Megatron-LM: --linear-cp-backend")


def dtype_name(dtype) -> Optional[str]:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the registry's dtype names); None stays None."""
    return None if dtype is None else str(dtype).replace("torch.", "")


def check_linear_cp_backend(requested: str, *, builds_gdn: bool, deterministic: bool,
                            head_dims: Optional[tuple[int, int]], dtype: Any) -> None:
    """The config-time check of a named ``linear_cp_backend`` (``requested``: a checked
    ``Settings.backend``; ValueError with the fix): where the config builds GDN layers (or may: a
    hybrid model), it must run on this machine's device (the GPU where torch sees one) for these head
    dims (``linear_key_head_dim``, ``linear_value_head_dim``) and ``dtype`` (``params_dtype``, the
    activations' dtype in Megatron's mixed precision)."""
    where = "TransformerConfig."
    if requested == AUTO_BACKEND or not builds_gdn:
        return
    import torch

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        resolve_backend(requested, device_type, deterministic=deterministic, head_dims=head_dims,
                        dtype=dtype_name(dtype))
    except ValueError as err:
        raise ValueError(f"{where}{BACKEND_FIELD}={requested!r} (device {device_type}, head dims {head_dims}, "
                         f"params_dtype {dtype_name(dtype)}, deterministic_mode={deterministic}): {err}. "
                         f"Fix: {backend_fix()}.") from None


def choose_backend(settings: Settings, layer, device) -> Backend:
    """The backend a layer runs: :func:`gdn_cp.ops.registry.resolve_backend` of its ``settings``
    (``backend``, ``deterministic``, ``backend_settings``) for ``layer`` (the pin's ``LayerAdapter``: its
    head dims and activations' dtype) on ``device`` (where its activations are); logged at INFO once per
    process and answer. ValueError (before any collective) for a named backend that cannot run here;
    never a switch to another backend on its own."""
    requested, deterministic = settings.backend, settings.deterministic
    dtype = dtype_name(layer.activation_dtype)
    try:
        name, why = resolve_backend(requested, device.type, deterministic=deterministic, head_dims=layer.head_dims,
                                    dtype=dtype)
    except ValueError as err:
        raise ValueError(f"GatedDeltaNet (layer {layer.layer_number}): config.{BACKEND_FIELD}={requested!r} on "
                         f"{device.type}, head dims {layer.head_dims}, {dtype}: {err}. Fix: {backend_fix()}.") from None
    key = (requested, device.type, deterministic, layer.head_dims, dtype)
    if key not in _LOGGED_CHOICES:
        _LOGGED_CHOICES.add(key)
        logger.info("gdn-cp %s: requested=%s resolved=%s (device %s, head dims %s, %s, deterministic_mode=%s): %s",
                    BACKEND_FIELD, requested, name, device.type, layer.head_dims, dtype, deterministic, why)
    return get_backend(name, settings.backend_settings)
