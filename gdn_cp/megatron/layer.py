"""A GatedDeltaNet layer's gdn-cp state, made on its first call and kept in the layer's ``__dict__``.

On the first call: the layer's release adapter (:mod:`gdn_cp.megatron.pins`), the SiLU check (a hybrid
model's config never sees its pattern, so its GDN layers are checked here), gdn-cp's settings (the
config's fields and the environment, read and checked once: :func:`gdn_cp.megatron.rules.read_settings`),
the TP-local head shape and out_norm's TP gradient sum (:mod:`gdn_cp.megatron.tp_grads`). Later calls read
none of it again; :func:`reset_settings` makes a layer read the config and the environment again (tests
and benchmarks that change them between calls). The backend is chosen once per layer and device type
(:func:`choose_backend`), and what a call checked or built for the layer is kept here too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..ops.registry import get_backend, resolve_backend
from ..ops.shape import GDNShape
from .config import BACKEND_FIELD, backend_fix, dtype_name
from .pins.lookup import adapter_class
from .rules import check_gdn_activation, read_settings
from .tp_grads import install_tp_grad_sum

if TYPE_CHECKING:
    from ..modes.settings import Settings
    from ..ops.contract import Backend

__all__ = ["STATE_ATTR", "LayerState", "choose_backend", "layer_state", "reset_settings"]

logger = logging.getLogger(__name__)

STATE_ATTR = "_gdn_cp"  # the LayerState in each GatedDeltaNet's __dict__
_LOGGED_CHOICES: set = set()  # (requested, device type, deterministic, head dims, dtype): logged at INFO once


@dataclass
class LayerState:
    """gdn-cp's own state of one GatedDeltaNet, kept in the layer's ``__dict__`` (no parameter,
    buffer or submodule, so ``state_dict`` and module hooks never see it): what its first call read,
    and what was checked or built once for it."""

    adapter: Any  # pins.megatron_core_<version>.LayerAdapter
    shape: GDNShape  # the TP-local head shape (the grouped-heads rule checked once, here)
    settings: Settings  # the config's fields and the environment, read and checked once
    hybrid_context_parallel: bool  # config.hybrid_context_parallel (the THD cut's fallback)
    backends: dict = field(default_factory=dict)  # device type -> Backend
    legal_modes: set = field(default_factory=set)  # (mode, tp, cp) found legal for the heads
    disjoint_groups: dict = field(default_factory=dict)  # id(CP group) -> group, checked against TP
    sbhd_plans: dict = field(default_factory=dict)  # (S, B, cp, rank) -> CPPlan
    gated_norms: dict = field(default_factory=dict)  # (backend, out_norm hooked) -> (fn, eps) | None

    @property
    def label(self) -> str:
        return f"GatedDeltaNet layer {self.adapter.layer_number}"

    def backend(self, device) -> Backend:
        """The backend this layer runs on ``device``'s type (:func:`choose_backend`, once per type)."""
        backend = self.backends.get(device.type)
        if backend is None:
            backend = self.backends[device.type] = choose_backend(self.settings, self.adapter, device)
        return backend


def layer_state(module) -> LayerState:
    """``module``'s :class:`LayerState`, made on its first call (module docstring); a first call that
    fails (an activation other than SiLU, a bad setting) keeps nothing, so the next call checks again."""
    state = module.__dict__.get(STATE_ATTR)
    if state is None:
        adapter = adapter_class(type(module))(module)
        check_gdn_activation(adapter.activation, owner=f"GatedDeltaNet (layer {adapter.layer_number}): config.")
        fields = adapter.config_fields
        settings = read_settings(fields)
        install_tp_grad_sum(adapter)
        (num_k, num_v), (dk, dv) = adapter.local_heads, adapter.head_dims
        shape = GDNShape(num_k_heads=num_k, num_v_heads=num_v, head_k_dim=dk, head_v_dim=dv, qk_l2norm=adapter.qk_l2norm)
        state = module.__dict__[STATE_ATTR] = LayerState(adapter, shape, settings, fields.hybrid_context_parallel)
    return state


def reset_settings(model) -> int:
    """Forget what every GatedDeltaNet of ``model`` (a module, or a layer itself) read on its first call:
    each reads its config's fields and the environment again on its next call (and chooses its backend
    again). For tests and benchmarks that change them between calls. Returns how many layers forgot."""
    layers = [m for m in model.modules() if STATE_ATTR in m.__dict__]
    for m in layers:
        del m.__dict__[STATE_ATTR]
    return len(layers)


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
