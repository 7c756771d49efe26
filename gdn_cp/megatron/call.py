"""One GatedDeltaNet call, checked before any collective (in_proj may communicate under sequence
parallelism): the micro-batch's CP group (dynamic CP), whether gdn-cp runs the call, the group against
TP, the mode against the heads for this CP size, the micro-batch's plan, the backend ->
:class:`~gdn_cp.modes.context.CallContext`.

Per call only what changes per call: the layer's settings, shape and backend were read once
(:mod:`gdn_cp.megatron.layer`); the mode is checked once per (mode, TP, CP) and the CP group once per
group; the THD cut is decided once per micro-batch and the plan built once per micro-batch, both kept on
its ``PackedSeqParams`` (the route cache never outlives it); an SBHD plan is kept per layer and shape.
``PackedSeqParams`` is read through the layer's release adapter (:mod:`gdn_cp.pins`).
"""

from __future__ import annotations

import logging

import torch

from ..checks import as_int
from ..comm import group_ranks
from ..layout import PER_DOCUMENT
from ..layout.plan import CPPlan, RouteCache, plan_for_sbhd
from ..modes.context import CallContext, LayerFacts
from ..modes.settings import THD_SPLIT_FIELD
from .layer import LayerState
from .rules import check_linear_cp_mode
from .thd_split import resolve_thd_split

__all__ = ["NO_CP", "ROUTE_CACHE_ATTR", "SPLIT_ATTR", "call_context", "check_mode", "cp_group", "should_dispatch"]

logger = logging.getLogger(__name__)

ROUTE_CACHE_ATTR = "_gdn_cp_route_cache"  # RouteCache stored on each micro-batch's PackedSeqParams
SPLIT_ATTR = "_gdn_cp_thd_split"  # the THD cut decided for the micro-batch: {(id(cu), cp, setting): (cu, split, why)}


class _NoCP:
    """The CP "group" of a micro-batch split over no other rank: hybrid CP's ``local_cp_size=1``
    with ``cp_group=None``, which TransformerEngine (and so Megatron) treats as "CP off for this
    micro-batch". It answers what the forward asks of a group; no collective ever gets it."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


NO_CP = _NoCP()


def cp_group(state: LayerState, batch):
    """The CP group of this micro-batch: PackedSeqParams.cp_group (dynamic CP), :data:`NO_CP` for
    ``local_cp_size=1`` without a group (hybrid CP's "no CP for this sub-sample", as
    TransformerEngine reads it), or the static one.

    Raises ValueError (before any collective) when ``cp_group`` and ``local_cp_size`` do not come
    together (other than that case), ``local_cp_size`` is not a positive integer or not the
    group's size, or this rank is not a member of ``cp_group``.
    """
    group, local = batch.cp_group, batch.local_cp_size
    if group is None and local is None:
        return state.adapter.static_cp_group
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


def should_dispatch(state: LayerState, group, batch) -> bool:
    """True when gdn-cp runs the call: packed THD input, or CP > 1 (static or this micro-batch's).

    A static CP group of more than one rank always dispatches, even when this micro-batch's
    dynamic group has a single rank: the stock code below the hand-over would use the static
    group (``self.cp_size``, ``pg_collection.cp``); gdn-cp runs such a micro-batch without CP.
    """
    return batch.thd or state.adapter.static_cp_group.size() > 1 or group.size() > 1


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


def check_mode(state: LayerState, cp: int) -> None:
    """The layer's ``linear_cp_mode`` checked for its heads, TP and the CP size of the call.

    Hybrid models never run TransformerConfig's gated_delta_net checks, and a dynamic CP group
    can differ from the static one, so the forward checks (before any collective) with the same
    rule as the config, once per (mode, TP, CP) and layer. The first one a layer runs is
    logged at INFO (the mode each layer runs, once, at start-up), another CP size of a later call
    (dynamic CP) at DEBUG.
    """
    layer, mode = state.adapter, state.settings.mode
    key = (mode, layer.tp_size, cp)
    if key in state.legal_modes:
        return
    try:
        check_linear_cp_mode(
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


def _micro_batch_memo(batch, attr: str, make):
    """What gdn-cp keeps on a micro-batch's ``PackedSeqParams`` under ``attr`` (made by ``make`` first)."""
    memo = getattr(batch.params, attr, None)
    if memo is None:
        memo = make()
        setattr(batch.params, attr, memo)
    return memo


def _thd_plan(state: LayerState, batch, group, t_global: int) -> CPPlan:
    """The micro-batch's plan for the THD cut Megatron made (:mod:`gdn_cp.megatron.thd_split`: recorded
    by its splitter, else the config's setting, else hybrid CP's whole row, else a ValueError at CP > 1),
    the cut decided once per micro-batch and the plan cached on its PackedSeqParams."""
    cu, name, cp = batch.cu_seqlens, batch.cu_name, group.size()
    if cu is None:
        raise ValueError("PackedSeqParams with qkv_format='thd' needs cu_seqlens_q_padded or cu_seqlens_q")
    setting = state.settings.thd_split
    splits = _micro_batch_memo(batch, SPLIT_ATTR, dict)
    key = (id(cu), cp, setting, state.hybrid_context_parallel)
    decided = splits.get(key)
    if decided is None or decided[0] is not cu:
        split, why = resolve_thd_split(setting, hybrid_context_parallel=state.hybrid_context_parallel, cu_seqlens=cu,
                                       cp=cp)
        decided = splits[key] = (cu, split, why)  # holds cu: its id cannot be reused meanwhile
    _, split, why = decided
    try:
        plan = _micro_batch_memo(batch, ROUTE_CACHE_ATTR, RouteCache).plan(cu, cp, group.rank(), split)
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


def call_context(state: LayerState, group, hidden_states: torch.Tensor, batch) -> CallContext:
    """Every check of one layer call, before any collective: the CP group against TP, the mode against
    the heads, the micro-batch's plan against the rows, the backend. Returns the call's context.
    ``batch``: the micro-batch's ``PackedSeqParams`` fields, as the layer's adapter reads them."""
    layer = state.adapter
    cp = group.size()
    _check_cp_group_disjoint_from_tp(state, group, dynamic=group is not layer.static_cp_group)
    check_mode(state, cp)
    s_local, rows = hidden_states.shape[0] * layer.sp_size, hidden_states.shape[1]  # rows: the batch size
    if batch.thd:
        if rows != 1:
            raise ValueError(f"packed (THD) input needs batch 1, got hidden_states of shape {tuple(hidden_states.shape)}")
        plan = _thd_plan(state, batch, group, s_local * cp)
    else:
        plan = _sbhd_plan(state, s_local * cp, rows, group)
    if plan.t_local != s_local * rows:
        raise ValueError(f"plan expects {plan.t_local} local rows, hidden_states gives {s_local * rows}")
    facts = LayerFacts(label=state.label, hidden_size=hidden_states.shape[-1], tp=layer.tp_size,
                       sequence_parallel=layer.sp_size > 1, act_bytes=hidden_states.element_size())
    return CallContext(settings=state.settings, shape=state.shape, plan=plan, group=group if cp > 1 else None,
                       backend=state.backend, layer=facts)
