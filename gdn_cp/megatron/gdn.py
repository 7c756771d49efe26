"""GatedDeltaNet.forward for the pinned megatron-core, dispatching to a gdn-cp mode.

The pinned patch calls :func:`should_dispatch` at the top of ``GatedDeltaNet.forward`` and
hands over to :func:`gated_delta_net_forward` when it says so (CP > 1, or packed THD
input); CP=1 SBHD stays on the stock path.

Data flow (per CP rank, per TP rank), with T_local = S_local * B rows:

    hidden_states [S_local, B, H] --in_proj--> [S_local, B, q|k|v|z|beta|alpha]
      -> packed rows [T_local, ...] (THD: B == 1; SBHD: b-major)
      -> gates g = -exp(A_log) * softplus(alpha + dt_bias) (fp32), beta = sigmoid(beta)
      -> gdn_core(mode) -> o [T_local, Hv, Dv]
      -> gated norm with z -> [S_local, B, Hv*Dv] --out_proj--> [S_local, B, H]

The mode decides once per call, before any collective, how it runs (its registry entry's
``prepare``: :class:`~gdn_cp.modes.call.ModeCall`). Where it moves rows to another layout around
its core (``swap_layout``: chunkwise's contiguous slices) and hidden_states are the narrower
tensors (:mod:`gdn_cp.megatron.swap`), the same forward moves hidden_states there before in_proj
and out_proj's output back after, and the core takes the moved rows as they are.

The gates are computed per token before the mode, with the full A_log and dt_bias, so no
mode slices them; headwise slices only the conv weight. Submodules (in_proj, out_norm,
out_proj) are called exactly as the stock forward calls them, so the local and the
TransformerEngine specs both work. The layer is read only through its release's adapter
(:mod:`gdn_cp.megatron.pins`), built once per call; gdn-cp keeps its own per-layer caches in the
layer's ``__dict__`` under ``_gdn_cp_*`` names (``LayerAdapter.own``).
"""

from __future__ import annotations

import logging
from functools import partial

import torch
import torch.nn.functional as F

from ..checks import as_int
from ..comm import group_ranks, route_all_to_all
from ..layout import PER_DOCUMENT, ZIGZAG
from ..layout.plan import CPPlan, RouteCache, plan_for_sbhd
from ..modes import GDNShape, ModeCall, gdn_core, sbhd_to_thd, thd_to_sbhd
from ..modes.spec import get_mode
from . import config as _config
from .backend import choose_backend as _choose_backend
from .pins.lookup import adapter_class
from .swap import choose_swap_point, chunkwise_swap
from .thd_split import THD_SPLIT_FIELD, resolve_thd_split
from .tp_grads import install_tp_grad_sum

__all__ = [
    "should_dispatch", "gated_delta_net_forward", "resolve_cp_group", "choose_backend", "layer_adapter", "ROUTE_CACHE_ATTR",
]

logger = logging.getLogger(__name__)

ROUTE_CACHE_ATTR = "_gdn_cp_route_cache"  # RouteCache stored on each micro-batch's PackedSeqParams
_SWAP_ATTR = "_gdn_cp_swap_points"  # layout swap point per (setting, hidden size, dtype) on a layer
_SBHD_PLANS_ATTR = "_gdn_cp_sbhd_plans"
_VALIDATED_ATTR = "_gdn_cp_validated_modes"  # (mode, tp, cp) already checked on this layer
_DISJOINT_ATTR = "_gdn_cp_cp_groups_disjoint_from_tp"  # id(CP group) -> the group, checked against TP
_NORM_ATTR = "_gdn_cp_gated_norm"  # (backend name, out_norm hooked) -> the fused gated norm (fn, eps) or None
_ACTIVATION_ATTR = "_gdn_cp_checked_activation"  # {"act_fn": the act_fn found to be SiLU} on this layer


def layer_adapter(module):
    """The adapter (``pins.core_<version>.LayerAdapter``) of ``module``'s megatron-core release."""
    return adapter_class(type(module))(module)


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


def resolve_cp_group(module, packed_seq_params):
    """The CP group of this micro-batch: PackedSeqParams.cp_group (dynamic CP), :data:`NO_CP` for
    ``local_cp_size=1`` without a group (hybrid CP's "no CP for this sub-sample", as
    TransformerEngine reads it), or the static one.

    Raises ValueError (before any collective) when ``cp_group`` and ``local_cp_size`` do not come
    together (other than that case), ``local_cp_size`` is not a positive integer or not the
    group's size, or this rank is not a member of ``cp_group``.
    """
    group = _dynamic_cp_group(packed_seq_params)
    return layer_adapter(module).static_cp_group if group is None else group


def _cp_group(layer, packed_seq_params):
    """:func:`resolve_cp_group` for the call's adapter."""
    group = _dynamic_cp_group(packed_seq_params)
    return layer.static_cp_group if group is None else group


def _dynamic_cp_group(packed_seq_params):
    """The micro-batch's own CP group (or :data:`NO_CP`), None when it brings none; checked."""
    group = getattr(packed_seq_params, "cp_group", None) if packed_seq_params is not None else None
    local = getattr(packed_seq_params, "local_cp_size", None) if packed_seq_params is not None else None
    if group is None and local is None:
        return None
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


def should_dispatch(module, packed_seq_params) -> bool:
    """True when gdn-cp handles the call: CP > 1 (static or dynamic) or packed THD input.

    A static CP group of more than one rank always dispatches, even when this micro-batch's
    dynamic group has a single rank: the stock code below the hand-over would use the static
    group (``self.cp_size``, ``pg_collection.cp``); gdn-cp runs such a micro-batch without CP.

    This is the one gdn-cp function every forward of the patched layer runs (the stock CP=1 SBHD
    path too), so it also refuses, before any collective, an activation other than SiLU (GDN's
    conv and gate compute SiLU: :func:`gdn_cp.megatron.config.check_gdn_activation`; a hybrid
    model's config never sees its pattern, so its GDN layers are checked here), and installs, on
    the first call, the TP gradient sum of ``out_norm`` (:mod:`gdn_cp.megatron.tp_grads`).
    """
    layer = layer_adapter(module)
    checked = layer.own(_ACTIVATION_ATTR, dict)
    if checked.get("act_fn") is not layer.activation:
        _config.check_gdn_activation(layer.activation, owner=f"GatedDeltaNet (layer {layer.layer_number}): config.")
        checked["act_fn"] = layer.activation
    install_tp_grad_sum(layer)
    if _is_thd(packed_seq_params):
        return True
    if layer.static_cp_group.size() > 1:
        return True
    return _cp_group(layer, packed_seq_params).size() > 1


def _check_cp_group_disjoint_from_tp(layer, group, dynamic: bool) -> None:
    """ValueError when the CP group shares a rank other than this one with the TP group.

    The ranks of one TP group hold the same tokens (or, under sequence parallelism, slices that
    in_proj gathers), so a CP group must take one rank of each TP group: a CP group inside a TP
    group would split tokens that TP expects to be identical. Checked on the host (group
    membership, no collective) once per (layer, group).
    """
    if layer.tp_size == 1 or group.size() == 1:
        return
    checked = layer.own(_DISJOINT_ATTR, dict)
    if checked.get(id(group)) is group:
        return
    cp_ranks, tp_ranks = group_ranks(group), group_ranks(layer.tp_group)
    shared = sorted(set(cp_ranks) & set(tp_ranks))
    if len(shared) > 1:
        field = "PackedSeqParams.cp_group" if dynamic else "pg_collection.cp (the static CP group)"
        raise ValueError(
            f"{field} has ranks {list(cp_ranks)}, of which {shared} are also in this layer's tensor-parallel "
            f"group {list(tp_ranks)}; a CP group may hold at most one rank of each TP group: pass the ranks "
            f"that share this rank's TP index (Megatron's layout: rank = tp_rank + {layer.tp_size} * cp_rank)"
        )
    checked[id(group)] = group  # keeps the group alive, so its id cannot be reused by another


def _checked_mode(layer, cp: int) -> str:
    """``config.linear_cp_mode`` checked for this layer's heads, TP and the CP size of the call.

    Hybrid models never run TransformerConfig's gated_delta_net checks, and a dynamic CP group
    can differ from the static one, so the forward checks (before any collective) with the same
    function as the config. A legal (mode, tp, cp) is remembered per layer: later calls cost one
    set lookup. The first one a layer runs is logged at INFO (the mode each layer runs, once, at
    start-up), another CP size of a later call (dynamic CP) at DEBUG.
    """
    mode = layer.linear_cp_mode
    done = layer.own(_VALIDATED_ATTR, set)
    key = (mode, layer.tp_size, cp) if isinstance(mode, str) else None
    if key is not None and key in done:
        return mode
    try:
        _config.check_linear_cp_mode(
            mode, num_key_heads=layer.num_key_heads, num_value_heads=layer.num_value_heads, tp=layer.tp_size, cp=cp
        )
    except ValueError as e:
        raise ValueError(f"GatedDeltaNet (layer {layer.layer_number}), CP group of this call has {cp} ranks: {e}") from None
    logger.log(
        logging.DEBUG if done else logging.INFO,
        "GatedDeltaNet layer %s runs linear_cp_mode=%s (TP=%d, CP=%d, linear_num_key_heads=%d, linear_num_value_heads=%d)",
        layer.layer_number, mode, layer.tp_size, cp, layer.num_key_heads, layer.num_value_heads,
    )
    done.add(key)
    return mode


def choose_backend(layer, device: torch.device):
    """The backend the forward runs for ``layer`` (its adapter: ``layer_adapter(module)``) on
    ``device``: ``config.linear_cp_backend`` as :func:`gdn_cp.megatron.backend.choose_backend`
    resolves it (``auto``: the plain-torch oracle under ``deterministic_mode``, else FlashQLA where it
    runs and takes the layer, else FLA where it imports, else the reference), logged once."""
    return _choose_backend(layer, device)


def _thd_plan(layer, packed_seq_params, group, t_global: int) -> CPPlan:
    """The micro-batch's plan (cached on its PackedSeqParams), for the THD split Megatron made
    (:mod:`gdn_cp.megatron.thd_split`: recorded by its splitter, else the config's setting, else
    hybrid CP's whole row, else a ValueError at CP > 1)."""
    cu = packed_seq_params.cu_seqlens_q_padded
    name = "cu_seqlens_q_padded"
    if cu is None:
        cu, name = packed_seq_params.cu_seqlens_q, "cu_seqlens_q"
    if cu is None:
        raise ValueError("PackedSeqParams with qkv_format='thd' needs cu_seqlens_q_padded or cu_seqlens_q")
    split, why = resolve_thd_split(
        layer.thd_split_setting, hybrid_context_parallel=layer.hybrid_context_parallel, cu_seqlens=cu,
        cp=group.size(),
    )
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


def _sbhd_plan(layer, seq_len: int, batch: int, group) -> CPPlan:
    plans = layer.own(_SBHD_PLANS_ATTR, dict)
    key = (seq_len, batch, group.size(), group.rank())  # ints only: can never go stale
    if key not in plans:
        plans[key] = plan_for_sbhd(seq_len, batch, group.size(), group.rank())
    return plans[key]


def _core_shape(layer) -> GDNShape:
    (num_k, num_v), (dk, dv) = layer.local_heads, layer.head_dims
    return GDNShape(num_k_heads=num_k, num_v_heads=num_v, head_k_dim=dk, head_v_dim=dv, qk_l2norm=layer.qk_l2norm)


def _fused_gated_norm(layer, backend):
    """``(fn, weight, eps)``: the backend's fused gated RMSNorm for this layer, or None when the
    backend has none or the layer's gated norm is not plain RMSNorm * silu. Decided once per
    (layer, backend, whether out_norm has forward hooks now) and logged."""
    choices = layer.own(_NORM_ATTR, dict)
    # out_norm's forward hooks come and go (Megatron DDP's param-gather pre-hooks): decided per state
    name = (getattr(backend, "__name__", type(backend).__name__), layer.out_norm_hooked)
    if name not in choices:
        make = getattr(backend, "fused_gated_rms_norm", None)
        fn = make() if make is not None else None
        weight, eps, why = layer.plain_rms_gated_norm() if fn is not None else (None, None, None)
        if fn is None:
            why = f"the {name[0]} backend has no fused gated RMSNorm"
        choices[name] = None if weight is None else (fn, eps)
        logger.info("GatedDeltaNet layer %s gated norm: %s", layer.layer_number,
                    "the backend's fused RMSNorm * silu(z) kernel" if weight is not None
                    else f"the layer's own out_norm * act(z) ({why})")
    entry = choices[name]
    return None if entry is None else (entry[0], layer.gated_norm_weight(), entry[1])


def _gated_norm_to_rows(layer, core_out, gate, batch: int, thd: bool, fused=None):
    """``o, z [T_local, Hv, Dv]`` -> gated norm -> ``[S_local, B, Hv*Dv]``."""
    if fused is None:
        y = layer.gated_norm(core_out, gate)  # [T_local*Hv, Dv]
    else:
        fn, weight, eps = fused
        dv = core_out.shape[-1]
        y = fn(core_out.reshape(-1, dv), gate.reshape(-1, dv), weight, eps)
    y = y.reshape(core_out.shape[0], -1)
    return y.unsqueeze(1) if thd else thd_to_sbhd(y, batch).contiguous()


def _core(layer, rows, shape: GDNShape, mode: str, plan, group, cp: int, backend, layout: str, call):
    """in_proj rows ``[T, D_tp]`` (in ``layout``) -> gates -> mode -> ``(o, z)``, both ``[T, Hv, Dv]``."""
    qkv, gate, beta, alpha = torch.split(
        rows, [shape.conv_dim, shape.value_dim, shape.num_v_heads, shape.num_v_heads], dim=-1
    )
    g = -layer.A_log.exp() * F.softplus(alpha.float() + layer.dt_bias)  # [T, Hv] fp32, as stock
    beta = beta.sigmoid()
    core_out = gdn_core(
        qkv, g, beta, layer.conv_weight, layer.conv_bias, shape=shape, mode=mode, plan=plan,
        group=group if cp > 1 else None, backend=backend, layout=layout, call=call,
    )
    return core_out, gate.reshape(core_out.shape)


def _gated_norm(layer, core_out, gate, batch: int, thd: bool, backend):
    """Gated norm (the backend's fused kernel where it fits), under ``gdn_norm_out`` selective
    recompute when configured (as stock)."""
    fused = _fused_gated_norm(layer, backend)
    if not layer.recompute_norm_out:
        return _gated_norm_to_rows(layer, core_out, gate, batch, thd, fused)
    norm_fn = partial(_gated_norm_to_rows, layer, batch=batch, thd=thd, fused=fused)
    return layer.new_norm_out_checkpoint().checkpoint(norm_fn, core_out, gate)


def _swap_point(layer, shape: GDNShape, hidden_states) -> str:
    """Where a mode that moves rows swaps layouts on this layer (see :mod:`gdn_cp.megatron.swap`):
    ``hidden`` or ``core``, decided once per (setting, hidden size, dtype) and logged."""
    key = (chunkwise_swap(), hidden_states.shape[-1], hidden_states.dtype)
    choices = layer.own(_SWAP_ATTR, dict)
    if key not in choices:
        choice = choose_swap_point(
            shape=shape, hidden_size=key[1], tp=layer.tp_size, sequence_parallel=layer.sp_size > 1,
            act_bytes=hidden_states.element_size(), requested=key[0],
        )
        logger.info(
            "GatedDeltaNet layer %s layout swap at %s (%s; core %d B/token, hidden %s B/token, "
            "stock headwise %d B/token)", layer.layer_number, choice.point, choice.reason,
            choice.core_bytes, choice.hidden_bytes, choice.stock_headwise_bytes,
        )
        choices[key] = choice.point
    return choices[key]


def _hidden_layout(layer, call: ModeCall | None, shape: GDNShape, hidden_states) -> str:
    """The layout hidden_states go into before in_proj: the mode's ``swap_layout`` where it moves
    rows on this call and the swap point is ``hidden``, else zigzag (where they are)."""
    if call is None or call.swap_layout is None or _swap_point(layer, shape, hidden_states) != "hidden":
        return ZIGZAG
    return call.swap_layout


def gated_delta_net_forward(
    module,
    hidden_states: torch.Tensor,
    attention_mask=None,
    inference_context=None,
    packed_seq_params=None,
    sequence_len_offset=None,
    **kwargs,
):
    """Replacement for ``GatedDeltaNet.forward`` under gdn-cp; returns ``(out, out_bias)``.

    ``hidden_states [S_local, B, H]`` (S_local split over TP under sequence parallelism); THD
    input is ``[T_local, 1, H]`` with ``packed_seq_params.qkv_format == 'thd'``.
    """
    if inference_context is not None or kwargs.get("inference_params") is not None:
        raise NotImplementedError("GDN does not support inference in megatron-core (nor in gdn-cp)")
    layer = layer_adapter(module)
    thd = _is_thd(packed_seq_params)
    group = _cp_group(layer, packed_seq_params)
    cp = group.size()
    _check_cp_group_disjoint_from_tp(layer, group, dynamic=group is not layer.static_cp_group)
    mode = _checked_mode(layer, cp)
    shape = _core_shape(layer)

    # Everything that can be checked is checked before the first collective (in_proj may
    # communicate under sequence parallelism).
    s_local, batch = hidden_states.shape[0] * layer.sp_size, hidden_states.shape[1]
    if thd:
        if batch != 1:
            raise ValueError(f"packed (THD) input needs batch 1, got hidden_states of shape {tuple(hidden_states.shape)}")
        plan = _thd_plan(layer, packed_seq_params, group, s_local * cp)
    else:
        plan = _sbhd_plan(layer, s_local * cp, batch, group)
    if plan.t_local != s_local * batch:
        raise ValueError(f"plan expects {plan.t_local} local rows, hidden_states gives {s_local * batch}")

    backend = choose_backend(layer, hidden_states.device)
    # the mode's decisions for this call (a setting the backend cannot honour fails here)
    call = get_mode(mode).prepare(backend, group, plan) if cp > 1 else None
    layout = _hidden_layout(layer, call, shape, hidden_states)
    moved = layout != ZIGZAG
    if moved:  # the layer runs on the mode's rows: [T_moved, 1, H], a packed micro-batch
        rows = hidden_states.reshape(-1, hidden_states.shape[-1]) if thd else sbhd_to_thd(hidden_states)
        to, back = plan.route(ZIGZAG, layout), plan.route(layout, ZIGZAG)
        hidden_states = route_all_to_all(rows, to, back, group).unsqueeze(1)
    packed, rows_batch = (True, 1) if moved else (thd, batch)

    qkvzba = layer.in_proj(hidden_states)  # [S_local, B, D_tp]
    rows = qkvzba.reshape(-1, qkvzba.shape[-1]) if packed else sbhd_to_thd(qkvzba)
    core_out, gate = _core(layer, rows, shape, mode, plan, group, cp, backend, layout, call)
    norm_out = _gated_norm(layer, core_out, gate, rows_batch, packed, backend)
    out, out_bias = layer.out_proj(norm_out)
    if layer.recompute_norm_out:
        layer.register_norm_out_recompute(out)
    if moved:
        out = route_all_to_all(out.reshape(-1, out.shape[-1]), back, to, group)
        out = out.unsqueeze(1) if thd else thd_to_sbhd(out, batch)
    return out, out_bias
