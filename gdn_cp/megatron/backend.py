"""``linear_cp_backend`` at the Megatron boundary: which per-rank math backend the GDN layers run.

The backends and the rule that picks one are :mod:`gdn_cp.ops.registry`'s (``auto``: FlashQLA where
it is installed, runs on the GPU and takes the layer (head dims 128, bf16 / fp16), else FLA where
it imports, else the plain-torch reference; ``deterministic_mode``: the reference). This module
applies it to Megatron's fields, in two places:

* :func:`check_linear_cp_backend`, from the patched ``TransformerConfig.__post_init__`` (through
  :func:`gdn_cp.megatron.config.configure_linear_cp_mode`): a value that is not a backend fails when
  the config is built, and so does a named backend that cannot run here (not installed, no GPU,
  head dims or dtype its kernels refuse, ``deterministic_mode``), with the field, the value, why
  and the fix. ``auto`` stays ``auto``: it depends on the device the layer runs on;
* :func:`choose_backend`, from every layer call of the patched forward: the registry's answer for
  the call's settings (``Settings.backend``, ``deterministic``), the layer's device, head dims and
  dtype (the same on every call: a pure function of what is installed), logged at INFO once per
  process and answer; a named backend that cannot run is a ValueError there too, before any
  collective. Never a switch to another backend on its own.

The value itself (``auto`` or a backend) is checked with the other settings
(:class:`gdn_cp.modes.settings.Settings`).

Megatron's fields are read through the pin's adapter (:mod:`gdn_cp.megatron.pins`).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from ..ops.registry import AUTO, AUTO_ORDER, ORACLE, get_backend, resolve_backend

__all__ = ["BACKEND_FIELD", "check_linear_cp_backend", "choose_backend"]

logger = logging.getLogger(__name__)

BACKEND_FIELD = "linear_cp_backend"
_CHOSEN: dict = {}  # (requested, device type, deterministic, head dims, dtype) -> backend name, logged once


def _fix(requested: str) -> str:
    return (f"set {BACKEND_FIELD}='{AUTO}' (the first of {AUTO_ORDER} that runs here and takes the layer) or "
            f"'{ORACLE}' (plain torch, any device and dtype); Megatron-LM: --linear-cp-backend")


def _dtype_name(dtype) -> Optional[str]:
    return None if dtype is None else str(dtype).replace("torch.", "")


def check_linear_cp_backend(requested: str, *, builds_gdn: bool, deterministic: bool,
                            head_dims: Optional[tuple[int, int]], dtype: Any) -> None:
    """The config-time check of a named ``linear_cp_backend`` (``requested``: a checked
    ``Settings.backend``; ValueError with the fix): where the config builds GDN layers (or may: a
    hybrid model), it must run on this machine's device (the GPU where torch sees one) for these head
    dims (``linear_key_head_dim``, ``linear_value_head_dim``) and ``dtype`` (``params_dtype``, the
    activations' dtype in Megatron's mixed precision)."""
    where = "TransformerConfig."
    if requested == AUTO or not builds_gdn:
        return
    import torch

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        resolve_backend(requested, device_type, deterministic=deterministic, head_dims=head_dims,
                        dtype=_dtype_name(dtype))
    except ValueError as err:
        raise ValueError(f"{where}{BACKEND_FIELD}={requested!r} (device {device_type}, head dims {head_dims}, "
                         f"params_dtype {_dtype_name(dtype)}, deterministic_mode={deterministic}): {err}. "
                         f"Fix: {_fix(requested)}.") from None


def choose_backend(settings, layer, device):
    """The backend a layer call runs: :func:`gdn_cp.ops.registry.resolve_backend` of the call's
    ``settings`` (:class:`gdn_cp.modes.settings.Settings`: ``backend``, ``deterministic``) for
    ``layer`` (the pin's ``LayerAdapter``: its head dims and activations' dtype) on ``device`` (where
    its activations are); logged once per process and answer. ValueError (before any collective)
    for a named backend that cannot run here."""
    requested, deterministic = settings.backend, settings.deterministic
    dtype = _dtype_name(layer.activation_dtype)
    key = (requested, device.type, deterministic, layer.head_dims, dtype)
    name = _CHOSEN.get(key)
    if name is None:
        try:
            name, why = resolve_backend(requested, device.type, deterministic=deterministic,
                                        head_dims=layer.head_dims, dtype=dtype)
        except ValueError as err:
            raise ValueError(f"GatedDeltaNet (layer {layer.layer_number}): config.{BACKEND_FIELD}={requested!r} on "
                             f"{device.type}, head dims {layer.head_dims}, {dtype}: {err}. Fix: {_fix(requested)}."
                             ) from None
        _CHOSEN[key] = name
        logger.info("gdn-cp %s: requested=%s resolved=%s (device %s, head dims %s, %s, deterministic_mode=%s): %s",
                    BACKEND_FIELD, requested, name, device.type, layer.head_dims, dtype, deterministic, why)
    return get_backend(name)
