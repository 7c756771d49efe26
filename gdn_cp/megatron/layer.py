"""A GatedDeltaNet layer's gdn-cp state, made on its first call and kept in the layer's ``__dict__``.

On the first call: the layer's release adapter (:func:`gdn_cp.pins.release_of_layer_class`: its release
found by the sha256 of its megatron-core's files), the SiLU check (a hybrid
model's config never sees its pattern, so its GDN layers are checked here), gdn-cp's settings (the
config's fields and the environment, read and checked once: :func:`gdn_cp.megatron.rules.read_settings`),
the backend for the layer's device (:func:`gdn_cp.megatron.backend.choose_backend`), out_norm's TP
gradient sum (:mod:`gdn_cp.megatron.tp_grads`) and the TP-local head shape. Later calls read none of it
again; :func:`reset_settings` makes a layer read the config and the environment again (tests and
benchmarks that change them between calls). What a call checked or built for the layer is kept here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..ops.shape import GDNShape
from .backend import choose_backend
from ..pins import LayerAdapter, release_of_layer_class
from .rules import check_gdn_activation, read_settings
from .tp_grads import install_tp_grad_sum

if TYPE_CHECKING:
    from ..modes.settings import Settings
    from ..ops.contract import Backend

__all__ = ["STATE_ATTR", "LayerState", "layer_state", "reset_settings"]

STATE_ATTR = "_gdn_cp"  # the LayerState in each GatedDeltaNet's __dict__


@dataclass
class LayerState:
    """gdn-cp's own state of one GatedDeltaNet, kept in the layer's ``__dict__`` (no parameter,
    buffer or submodule, so ``state_dict`` and module hooks never see it): what its first call read,
    and what was checked or built once for it."""

    adapter: LayerAdapter  # its release's view of the layer (gdn_cp.pins.adapter)
    shape: GDNShape  # the TP-local head shape (the grouped-heads rule checked once, here)
    settings: Settings  # the config's fields and the environment, read and checked once
    hybrid_context_parallel: bool  # config.hybrid_context_parallel (the THD cut's fallback)
    backend: Backend  # the per-rank kernels, chosen for the layer's device
    legal_modes: set = field(default_factory=set)  # (mode, tp, cp) found legal for the heads
    disjoint_groups: dict = field(default_factory=dict)  # id(CP group) -> group, checked against TP
    sbhd_plans: dict = field(default_factory=dict)  # (S, B, cp, rank) -> CPPlan
    gated_norms: dict = field(default_factory=dict)  # (backend, out_norm hooked) -> (fn, eps) | None

    @property
    def label(self) -> str:
        return f"GatedDeltaNet layer {self.adapter.layer_number}"


def layer_state(module) -> LayerState:
    """``module``'s :class:`LayerState`, made on its first call (module docstring); a first call that
    fails (an activation other than SiLU, a bad setting) keeps nothing, so the next call checks again."""
    state = module.__dict__.get(STATE_ATTR)
    if state is None:
        adapter = release_of_layer_class(type(module)).layer_adapter(module)
        check_gdn_activation(adapter.activation, owner=f"GatedDeltaNet (layer {adapter.layer_number}): config.")
        fields = adapter.config_fields
        settings = read_settings(fields)
        backend = choose_backend(settings, adapter, adapter.device)
        install_tp_grad_sum(adapter)
        (num_k, num_v), (dk, dv) = adapter.local_heads, adapter.head_dims
        shape = GDNShape(num_k_heads=num_k, num_v_heads=num_v, head_k_dim=dk, head_v_dim=dv, qk_l2norm=adapter.qk_l2norm)
        state = module.__dict__[STATE_ATTR] = LayerState(adapter, shape, settings, fields.hybrid_context_parallel,
                                                         backend)
    return state


def reset_settings(model) -> int:
    """Forget what every GatedDeltaNet of ``model`` (a module, or a layer itself) read on its first call:
    each reads its config's fields and the environment again on its next call (and chooses its backend
    again). For tests and benchmarks that change them between calls. Returns how many layers forgot."""
    layers = [m for m in model.modules() if STATE_ATTR in m.__dict__]
    for m in layers:
        del m.__dict__[STATE_ATTR]
    return len(layers)
