"""GatedDeltaNet.forward for the pinned megatron-core, handed to a gdn-cp mode.

The pinned patch calls :func:`gated_delta_net_forward` at the top of ``GatedDeltaNet.forward``. It
returns ``(out, out_bias)`` where gdn-cp runs the call (CP > 1, static or dynamic, or packed THD
input) and None where the stock code below the hand-over runs (CP=1 SBHD). It reads as

    state   = the layer's gdn-cp state (its adapter; the activation and TP gradient sum seen to once)
    group   = the micro-batch's CP group (checked)
    context = every check of the call, before any collective (:func:`call_context`)
    mode.run(context, hidden_states, the layer's per-token work)

and names no mode: the mode (:mod:`gdn_cp.modes`) owns its whole segment, layout swaps included.

Data flow (per CP rank, per TP rank), with T_local = S_local * B rows:

    hidden_states [S_local, B, H] --in_proj--> [S_local, B, q|k|v|z|beta|alpha]
      -> packed rows [T_local, ...] (b-major; THD: B == 1)
      -> gates g = -exp(A_log) * softplus(alpha + dt_bias) (fp32), beta = sigmoid(beta)
      -> the mode's core -> o [T_local, Hv, Dv]
      -> gated norm with z -> [S_local, B, Hv*Dv] --out_proj--> [S_local, B, H]

The per-token steps (:class:`LayerSegment`) run where the mode says (chunkwise may run them on its
contiguous rows). The gates are computed per token before the core, with the full A_log and
dt_bias, so no mode slices them; headwise slices only the conv weight. Submodules (in_proj,
out_norm, out_proj) are called exactly as the stock forward calls them, so the local and the
TransformerEngine specs both work. The layer is read only through its release's adapter
(:mod:`gdn_cp.megatron.pins`), kept in gdn-cp's one entry of the layer's ``__dict__``
(:class:`LayerState`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Optional

import torch

from ..checks import as_int
from ..comm import group_ranks
from ..layout import PER_DOCUMENT
from ..layout.plan import CPPlan, RouteCache, plan_for_sbhd
from ..modes.context import CallContext, LayerFacts, Projected
from ..modes.core import prepare_mode
from ..modes.packing import sbhd_to_thd, thd_to_sbhd
from ..modes.settings import THD_SPLIT_FIELD, Settings
from ..ops.fused import gates
from ..ops.shape import GDNShape
from . import config as _config
from .backend import choose_backend
from .pins.lookup import adapter_class
from .thd_split import resolve_thd_split
from .tp_grads import install_tp_grad_sum

__all__ = [
    "LayerSegment", "LayerState", "ROUTE_CACHE_ATTR", "call_context", "gated_delta_net_forward",
    "layer_state", "should_dispatch",
]

logger = logging.getLogger(__name__)

ROUTE_CACHE_ATTR = "_gdn_cp_route_cache"  # RouteCache stored on each micro-batch's PackedSeqParams
STATE_ATTR = "_gdn_cp"  # the LayerState in each GatedDeltaNet's __dict__


@dataclass
class LayerState:
    """gdn-cp's own state of one GatedDeltaNet, kept in the layer's ``__dict__`` (no parameter,
    buffer or submodule, so ``state_dict`` and module hooks never see it): its release's adapter,
    and what was checked or built once for it."""

    adapter: Any  # pins.core_<version>.LayerAdapter
    shape: GDNShape  # the TP-local head shape (the grouped-heads rule checked once, here)
    act_fn: Any = None  # the activation found to be SiLU
    legal_modes: set = field(default_factory=set)  # (mode, tp, cp) found legal for the heads
    disjoint_groups: dict = field(default_factory=dict)  # id(CP group) -> group, checked against TP
    sbhd_plans: dict = field(default_factory=dict)  # (S, B, cp, rank) -> CPPlan
    gated_norms: dict = field(default_factory=dict)  # (backend, out_norm hooked) -> (fn, eps) | None

    @property
    def label(self) -> str:
        return f"GatedDeltaNet layer {self.adapter.layer_number}"


def layer_state(module) -> LayerState:
    """``module``'s :class:`LayerState`, made on its first call: the adapter of its megatron-core
    release, the head shape; and, on every call whose activation is new, the SiLU check (a hybrid
    model's config never sees its pattern, so its GDN layers are checked here:
    :func:`gdn_cp.megatron.config.check_gdn_activation`); on the first call the TP gradient sum of
    ``out_norm`` (:mod:`gdn_cp.megatron.tp_grads`)."""
    state = module.__dict__.get(STATE_ATTR)
    if state is None:
        adapter = adapter_class(type(module))(module)
        _config.check_gdn_activation(adapter.activation,
                                     owner=f"GatedDeltaNet (layer {adapter.layer_number}): config.")
        install_tp_grad_sum(adapter)
        (num_k, num_v), (dk, dv) = adapter.local_heads, adapter.head_dims
        shape = GDNShape(num_k_heads=num_k, num_v_heads=num_v, head_k_dim=dk, head_v_dim=dv, qk_l2norm=adapter.qk_l2norm)
        state = module.__dict__[STATE_ATTR] = LayerState(adapter, shape, act_fn=adapter.activation)
    elif state.adapter.activation is not state.act_fn:  # act_fn replaced after the first call
        _config.check_gdn_activation(state.adapter.activation,
                                     owner=f"GatedDeltaNet (layer {state.adapter.layer_number}): config.")
        state.act_fn = state.adapter.activation
    return state


def _is_thd(packed_seq_params) -> bool:
    return packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", None) == "thd"


class _NoCP:
    """The CP "group" of a micro-batch split over no other rank: hybrid CP's ``local_cp_size=1``
    with ``cp_group=None``, which TransformerEngine (and so Megatron) treats as "CP off for this
    micro-batch". It answers what the forward asks of a group; no collective ever gets it."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


NO_CP = _NoCP()


def _cp_group(adapter, packed_seq_params):
    """The CP group of this micro-batch: PackedSeqParams.cp_group (dynamic CP), :data:`NO_CP` for
    ``local_cp_size=1`` without a group (hybrid CP's "no CP for this sub-sample", as
    TransformerEngine reads it), or the static one.

    Raises ValueError (before any collective) when ``cp_group`` and ``local_cp_size`` do not come
    together (other than that case), ``local_cp_size`` is not a positive integer or not the
    group's size, or this rank is not a member of ``cp_group``.
    """
    group = getattr(packed_seq_params, "cp_group", None) if packed_seq_params is not None else None
    local = getattr(packed_seq_params, "local_cp_size", None) if packed_seq_params is not None else None
    if group is None and local is None:
        return adapter.static_cp_group
    if group is None and as_int(local) == 1:
        return NO_CP
    if group is None or local is None:
        raise ValueError(
            f"PackedSeqParams.cp_group and local_cp_size must be set together for dynamic CP, got "
            f"cp_group={'set' if group is not None else None}, local_cp_size={local}; set both, or neither, "
            f"or local_cp_size=1 alone (no CP for this micro-batch)"
        )
    if as_int(local) is None or local < 1:
        raise ValueError(
            f"PackedSeqParams.local_cp_size={local!r} must be a positive integer: the number of ranks "
            "of cp_group this micro-batch is split over"
        )
    if local != group.size():
        raise ValueError(
            f"PackedSeqParams.local_cp_size={local} does not match cp_group.size()={group.size()}; "
            f"pass the size of the group this micro-batch is split over"
        )
    if group.rank() < 0:
        raise ValueError(
            f"PackedSeqParams.cp_group (size {local}) does not contain this rank; pass, on every rank, "
            "the CP group that rank belongs to for this micro-batch"
        )
    return group


def should_dispatch(adapter, group, packed_seq_params) -> bool:
    """True when gdn-cp runs the call: packed THD input, or CP > 1 (static or this micro-batch's).

    A static CP group of more than one rank always dispatches, even when this micro-batch's
    dynamic group has a single rank: the stock code below the hand-over would use the static
    group (``self.cp_size``, ``pg_collection.cp``); gdn-cp runs such a micro-batch without CP.
    """
    return _is_thd(packed_seq_params) or adapter.static_cp_group.size() > 1 or group.size() > 1


def _check_cp_group_disjoint_from_tp(state: LayerState, group, dynamic: bool) -> None:
    """ValueError when the CP group shares a rank other than this one with the TP group.

    The ranks of one TP group hold the same tokens (or, under sequence parallelism, slices that
    in_proj gathers), so a CP group must take one rank of each TP group: a CP group inside a TP
    group would split tokens that TP expects to be identical. Checked on the host (group
    membership, no collective) once per (layer, group).
    """
    layer = state.adapter
    if layer.tp_size == 1 or group.size() == 1 or state.disjoint_groups.get(id(group)) is group:
        return
    cp_ranks, tp_ranks = group_ranks(group), group_ranks(layer.tp_group)
    shared = sorted(set(cp_ranks) & set(tp_ranks))
    if len(shared) > 1:
        what = "PackedSeqParams.cp_group" if dynamic else "pg_collection.cp (the static CP group)"
        raise ValueError(
            f"{what} has ranks {list(cp_ranks)}, of which {shared} are also in this layer's tensor-parallel "
            f"group {list(tp_ranks)}; a CP group may hold at most one rank of each TP group: pass the ranks "
            f"that share this rank's TP index (Megatron's layout: rank = tp_rank + {layer.tp_size} * cp_rank)"
        )
    state.disjoint_groups[id(group)] = group  # keeps the group alive, so its id cannot be reused by another


def _check_mode(state: LayerState, mode: str, cp: int) -> None:
    """``linear_cp_mode`` checked for this layer's heads, TP and the CP size of the call.

    Hybrid models never run TransformerConfig's gated_delta_net checks, and a dynamic CP group
    can differ from the static one, so the forward checks (before any collective) with the same
    function as the config, once per (mode, TP, CP) and layer. The first one a layer runs is
    logged at INFO (the mode each layer runs, once, at start-up), another CP size of a later call
    (dynamic CP) at DEBUG.
    """
    layer = state.adapter
    key = (mode, layer.tp_size, cp)
    if key in state.legal_modes:
        return
    try:
        _config.check_linear_cp_mode(
            mode, num_key_heads=layer.num_key_heads, num_value_heads=layer.num_value_heads, tp=layer.tp_size, cp=cp
        )
    except ValueError as e:
        raise ValueError(f"GatedDeltaNet (layer {layer.layer_number}), CP group of this call has {cp} ranks: {e}") from None
    logger.log(
        logging.DEBUG if state.legal_modes else logging.INFO,
        "GatedDeltaNet layer %s runs linear_cp_mode=%s (TP=%d, CP=%d, linear_num_key_heads=%d, linear_num_value_heads=%d)",
        layer.layer_number, mode, layer.tp_size, cp, layer.num_key_heads, layer.num_value_heads,
    )
    state.legal_modes.add(key)


def _thd_plan(settings: Settings, hybrid_context_parallel: bool, packed_seq_params, group, t_global: int) -> CPPlan:
    """The micro-batch's plan (cached on its PackedSeqParams), for the THD split Megatron made
    (:mod:`gdn_cp.megatron.thd_split`: recorded by its splitter, else the config's setting, else
    hybrid CP's whole row, else a ValueError at CP > 1)."""
    cu = packed_seq_params.cu_seqlens_q_padded
    name = "cu_seqlens_q_padded"
    if cu is None:
        cu, name = packed_seq_params.cu_seqlens_q, "cu_seqlens_q"
    if cu is None:
        raise ValueError("PackedSeqParams with qkv_format='thd' needs cu_seqlens_q_padded or cu_seqlens_q")
    split, why = resolve_thd_split(settings.thd_split, hybrid_context_parallel=hybrid_context_parallel,
                                   cu_seqlens=cu, cp=group.size())
    cache = getattr(packed_seq_params, ROUTE_CACHE_ATTR, None)
    if cache is None:
        cache = RouteCache()
        setattr(packed_seq_params, ROUTE_CACHE_ATTR, cache)
    try:
        plan = cache.plan(cu, group.size(), group.rank(), split)
    except ValueError as e:
        hint = "" if split != PER_DOCUMENT else (
            ". If these rows were cut as one whole row (Megatron-LM --dataloader-inter-document-masking, hybrid "
            "CP, or get_batch_on_this_cp_rank(..., use_per_sequence_balancing=True)), set "
            f"TransformerConfig.{THD_SPLIT_FIELD}='whole_row'"
        )
        raise ValueError(f"PackedSeqParams.{name} ({split} split: {why}): {e}{hint}") from None
    if plan.t_global != t_global:
        raise ValueError(
            f"PackedSeqParams.{name}[-1]={plan.t_global} does not match the packed length "
            f"T_global={t_global} (local rows x cp); pass the padded boundaries that cover every row"
        )
    return plan


def _sbhd_plan(state: LayerState, seq_len: int, batch: int, group) -> CPPlan:
    key = (seq_len, batch, group.size(), group.rank())  # ints only: can never go stale
    if key not in state.sbhd_plans:
        state.sbhd_plans[key] = plan_for_sbhd(seq_len, batch, group.size(), group.rank())
    return state.sbhd_plans[key]


def call_context(state: LayerState, group, hidden_states: torch.Tensor, packed_seq_params) -> CallContext:
    """Every check of one layer call, before any collective (in_proj may communicate under
    sequence parallelism): the settings, the CP group against TP, the mode against the heads, the
    micro-batch's plan against the rows, the backend. Returns the call's context."""
    layer = state.adapter
    fields = layer.config_fields
    settings = _config.read_settings(fields)
    cp = group.size()
    _check_cp_group_disjoint_from_tp(state, group, dynamic=group is not layer.static_cp_group)
    _check_mode(state, settings.mode, cp)
    s_local, batch = hidden_states.shape[0] * layer.sp_size, hidden_states.shape[1]
    if _is_thd(packed_seq_params):
        if batch != 1:
            raise ValueError(f"packed (THD) input needs batch 1, got hidden_states of shape {tuple(hidden_states.shape)}")
        plan = _thd_plan(settings, fields.hybrid_context_parallel, packed_seq_params, group, s_local * cp)
    else:
        plan = _sbhd_plan(state, s_local * cp, batch, group)
    if plan.t_local != s_local * batch:
        raise ValueError(f"plan expects {plan.t_local} local rows, hidden_states gives {s_local * batch}")
    facts = LayerFacts(label=state.label, hidden_size=hidden_states.shape[-1], tp=layer.tp_size,
                       sequence_parallel=layer.sp_size > 1, act_bytes=hidden_states.element_size())
    return CallContext(settings=settings, shape=state.shape, plan=plan, group=group if cp > 1 else None,
                       backend=choose_backend(settings, layer, hidden_states.device), layer=facts)


class LayerSegment:
    """The layer's per-token work around the core (:class:`gdn_cp.modes.context.Segment`), as the
    stock forward does it: in_proj and the gates before, the gated norm and out_proj after."""

    def __init__(self, state: LayerState, backend):
        self.state, self.layer, self.backend = state, state.adapter, backend
        self.conv_weight, self.conv_bias = self.layer.conv_weight, self.layer.conv_bias

    def project(self, hidden: torch.Tensor) -> Projected:
        """``hidden [S, B, H]`` -> in_proj -> packed rows ``[T, ...]``: q|k|v, the gates, z."""
        layer, shape = self.layer, self.state.shape
        qkvzba = layer.in_proj(hidden)  # [S', B, D_tp] (S' = S * sp_size)
        rows = sbhd_to_thd(qkvzba)
        qkv, gate, beta, alpha = torch.split(
            rows, [shape.conv_dim, shape.value_dim, shape.num_v_heads, shape.num_v_heads], dim=-1
        )
        g, beta = gates(alpha, beta, layer.A_log, layer.dt_bias)  # [T, Hv]: g fp32, as stock; fused on CUDA
        return Projected(qkv, g, beta, gate.reshape(rows.shape[0], shape.num_v_heads, shape.head_v_dim))

    def finish(self, o: torch.Tensor, gate: torch.Tensor, batch: int):
        """``o, z [T, Hv, Dv]`` -> gated norm (the backend's fused kernel where it fits; under
        ``gdn_norm_out`` selective recompute when configured, as stock) -> out_proj ->
        ``(out [T/batch, batch, H], out_bias)``."""
        layer = self.layer
        fused = self._fused_gated_norm()
        if layer.recompute_norm_out:
            norm_fn = partial(_gated_norm_to_rows, layer, batch=batch, fused=fused)
            norm_out = layer.new_norm_out_checkpoint().checkpoint(norm_fn, o, gate)
        else:
            norm_out = _gated_norm_to_rows(layer, o, gate, batch, fused)
        out, out_bias = layer.out_proj(norm_out)
        if layer.recompute_norm_out:
            layer.register_norm_out_recompute(out)
        return out, out_bias

    def _fused_gated_norm(self):
        """``(fn, weight, eps)``: the backend's fused gated RMSNorm for this layer, or None when the
        backend has none or the layer's gated norm is not plain RMSNorm * silu. Decided once per
        (layer, backend, whether out_norm has forward hooks now) and logged."""
        layer, backend = self.layer, self.backend
        # out_norm's forward hooks come and go (Megatron DDP's param-gather pre-hooks): decided per state
        key = (getattr(backend, "__name__", type(backend).__name__), layer.out_norm_hooked)
        choices = self.state.gated_norms
        if key not in choices:
            make = getattr(backend, "fused_gated_rms_norm", None)
            fn = make() if make is not None else None
            weight, eps, why = layer.plain_rms_gated_norm() if fn is not None else (None, None, None)
            if fn is None:
                why = f"the {key[0]} backend has no fused gated RMSNorm"
            choices[key] = None if weight is None else (fn, eps)
            logger.info("GatedDeltaNet layer %s gated norm: %s", layer.layer_number,
                        "the backend's fused RMSNorm * silu(z) kernel" if weight is not None
                        else f"the layer's own out_norm * act(z) ({why})")
        entry = choices[key]
        return None if entry is None else (entry[0], layer.gated_norm_weight(), entry[1])


def _gated_norm_to_rows(layer, o, gate, batch: int, fused=None):
    """``o, z [T, Hv, Dv]`` -> gated norm -> ``[T/batch, batch, Hv*Dv]``."""
    if fused is None:
        y = layer.gated_norm(o, gate)  # [T*Hv, Dv]
    else:
        fn, weight, eps = fused
        dv = o.shape[-1]
        y = fn(o.reshape(-1, dv), gate.reshape(-1, dv), weight, eps)
    return thd_to_sbhd(y.reshape(o.shape[0], -1), batch).contiguous()


def gated_delta_net_forward(
    module,
    hidden_states: torch.Tensor,
    attention_mask=None,
    inference_context=None,
    packed_seq_params=None,
    sequence_len_offset=None,
    **kwargs,
) -> Optional[tuple]:
    """The patched ``GatedDeltaNet.forward``'s hand-over: ``(out, out_bias)`` where gdn-cp runs the
    call, None where the stock code runs (CP=1 SBHD).

    ``hidden_states [S_local, B, H]`` (S_local split over TP under sequence parallelism); THD
    input is ``[T_local, 1, H]`` with ``packed_seq_params.qkv_format == 'thd'``.
    """
    state = layer_state(module)
    group = _cp_group(state.adapter, packed_seq_params)
    if not should_dispatch(state.adapter, group, packed_seq_params):
        return None
    if inference_context is not None or kwargs.get("inference_params") is not None:
        raise NotImplementedError("GDN does not support inference in megatron-core (nor in gdn-cp)")
    ctx = call_context(state, group, hidden_states, packed_seq_params)
    return prepare_mode(ctx).run(ctx, hidden_states, LayerSegment(state, ctx.backend))
