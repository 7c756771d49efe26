"""GatedDeltaNet.forward for megatron-core 0.19.2, dispatching to a gdn-cp mode.

The pinned patch calls :func:`should_dispatch` at the top of ``GatedDeltaNet.forward`` and
hands over to :func:`gated_delta_net_forward` when it says so (CP > 1, or packed THD
input); CP=1 SBHD stays on the stock path.

Data flow (per CP rank, per TP rank), with T_local = S_local * B rows:

    hidden_states [S_local, B, H] --in_proj--> [S_local, B, q|k|v|z|beta|alpha]
      -> packed rows [T_local, ...] (THD: B == 1; SBHD: b-major)
      -> gates g = -exp(A_log) * softplus(alpha + dt_bias) (fp32), beta = sigmoid(beta)
      -> gdn_core(mode) -> o [T_local, Hv, Dv]
      -> gated norm with z -> [S_local, B, Hv*Dv] --out_proj--> [S_local, B, H]

The gates are computed per token before the mode, with the full A_log and dt_bias, so no
mode slices them; headwise slices only the conv weight. Submodules (in_proj, out_norm,
out_proj) are called exactly as the stock forward calls them, so the local and the
TransformerEngine specs both work.
"""

from __future__ import annotations

import logging
from functools import partial

import torch
import torch.nn.functional as F

from ..comm import route_all_to_all
from ..layout import CONTIGUOUS, ZIGZAG
from ..layout.plan import CPPlan, RouteCache, plan_for_sbhd
from ..modes import GDNShape, gdn_core, sbhd_to_thd, thd_to_sbhd
from ..ops import get_backend
from .swap import choose_swap_point, chunkwise_swap

__all__ = ["should_dispatch", "gated_delta_net_forward", "resolve_cp_group", "choose_backend", "ROUTE_CACHE_ATTR"]

logger = logging.getLogger(__name__)

ROUTE_CACHE_ATTR = "_gdn_cp_route_cache"  # RouteCache stored on each micro-batch's PackedSeqParams
_SWAP_ATTR = "_gdn_cp_swap_points"  # chunkwise swap point per (setting, hidden size, dtype) on a module
_SBHD_PLANS_ATTR = "_gdn_cp_sbhd_plans"
_VALIDATED_ATTR = "_gdn_cp_validated_modes"  # (mode, tp, cp) already checked on this module


def _is_thd(packed_seq_params) -> bool:
    return packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", None) == "thd"


def resolve_cp_group(module, packed_seq_params):
    """The CP group of this micro-batch: PackedSeqParams.cp_group (dynamic CP) or the static one.

    Raises ValueError when ``cp_group`` and ``local_cp_size`` do not come together or disagree.
    """
    group = getattr(packed_seq_params, "cp_group", None) if packed_seq_params is not None else None
    local = getattr(packed_seq_params, "local_cp_size", None) if packed_seq_params is not None else None
    if group is None and local is None:
        return module.pg_collection.cp
    if group is None or local is None:
        raise ValueError(
            f"PackedSeqParams.cp_group and local_cp_size must be set together for dynamic CP, got "
            f"cp_group={'set' if group is not None else None}, local_cp_size={local}; set both or neither"
        )
    if local != group.size():
        raise ValueError(
            f"PackedSeqParams.local_cp_size={local} does not match cp_group.size()={group.size()}; "
            f"pass the size of the group this micro-batch is split over"
        )
    return group


def should_dispatch(module, packed_seq_params) -> bool:
    """True when gdn-cp handles the call: CP > 1 (static or dynamic) or packed THD input.

    A static CP group of more than one rank always dispatches, even when this micro-batch's
    dynamic group has a single rank: the stock code below the hand-over would use the static
    group (``self.cp_size``, ``pg_collection.cp``); gdn-cp runs such a micro-batch without CP.
    """
    if _is_thd(packed_seq_params):
        return True
    if module.pg_collection.cp.size() > 1:
        return True
    return resolve_cp_group(module, packed_seq_params).size() > 1


def _checked_mode(module, cp: int) -> str:
    """``config.linear_cp_mode`` validated for this module's heads, TP and the CP size of the call.

    Hybrid models never run TransformerConfig's gated_delta_net checks, and a dynamic CP group
    can differ from the static one, so the forward checks (before any collective). A legal
    (mode, tp, cp) is remembered per module: later calls cost one set lookup.
    """
    mode = getattr(module.config, "linear_cp_mode", "headwise")
    done = module.__dict__.setdefault(_VALIDATED_ATTR, set())
    key = (mode, module.tp_size, cp) if isinstance(mode, str) else None
    if key is not None and key in done:
        return mode
    from types import SimpleNamespace

    from .config import validate_linear_cp_mode

    try:
        validate_linear_cp_mode(
            SimpleNamespace(
                linear_cp_mode=mode,
                linear_num_key_heads=module.num_key_heads,
                linear_num_value_heads=module.num_value_heads,
                tensor_model_parallel_size=module.tp_size,
                context_parallel_size=cp,
            )
        )
    except ValueError as e:
        raise ValueError(
            f"GatedDeltaNet (layer {getattr(module, 'layer_number', None)}), CP group of this call "
            f"has {cp} ranks: {e}"
        ) from None
    done.add(key)
    return mode


def choose_backend(module, device: torch.device):
    """deterministic_mode -> reference; CUDA with FLA -> fla; otherwise reference."""
    if module.config.deterministic_mode or device.type != "cuda":
        return get_backend("reference")
    from ..ops.fla import fla_available

    if fla_available():
        return get_backend("fla")
    return get_backend("reference")


def _thd_plan(packed_seq_params, group, t_global: int) -> CPPlan:
    cu = packed_seq_params.cu_seqlens_q_padded
    name = "cu_seqlens_q_padded"
    if cu is None:
        cu, name = packed_seq_params.cu_seqlens_q, "cu_seqlens_q"
    if cu is None:
        raise ValueError("PackedSeqParams with qkv_format='thd' needs cu_seqlens_q_padded or cu_seqlens_q")
    cache = getattr(packed_seq_params, ROUTE_CACHE_ATTR, None)
    if cache is None:
        cache = RouteCache()
        setattr(packed_seq_params, ROUTE_CACHE_ATTR, cache)
    plan = cache.plan(cu, group.size(), group.rank())
    if plan.t_global != t_global:
        raise ValueError(
            f"PackedSeqParams.{name}[-1]={plan.t_global} does not match the packed length "
            f"T_global={t_global} (local rows x cp); pass the padded boundaries that cover every row"
        )
    return plan


def _sbhd_plan(module, seq_len: int, batch: int, group) -> CPPlan:
    plans = module.__dict__.setdefault(_SBHD_PLANS_ATTR, {})
    key = (seq_len, batch, group.size(), group.rank())  # ints only: can never go stale
    if key not in plans:
        plans[key] = plan_for_sbhd(seq_len, batch, group.size(), group.rank())
    return plans[key]


def _core_shape(module) -> GDNShape:
    return GDNShape(
        num_k_heads=module.num_k_heads_local_tp,
        num_v_heads=module.num_v_heads_local_tp,
        head_k_dim=module.key_head_dim,
        head_v_dim=module.value_head_dim,
        qk_l2norm=module.use_qk_l2norm,
    )


def _gated_norm_to_rows(module, core_out, gate, batch: int, thd: bool):
    """``o, z [T_local, Hv, Dv]`` -> gated norm -> ``[S_local, B, Hv*Dv]``."""
    y = module._apply_gated_norm(core_out, gate)  # [T_local*Hv, Dv]
    y = y.reshape(core_out.shape[0], -1)
    return y.unsqueeze(1) if thd else thd_to_sbhd(y, batch).contiguous()


def _core(module, rows, shape: GDNShape, mode: str, plan, group, cp: int, device, layout: str = "zigzag"):
    """in_proj rows ``[T, D_tp]`` -> gates -> mode -> ``(o, z)``, both ``[T, Hv, Dv]``."""
    qkv, gate, beta, alpha = torch.split(
        rows, [shape.conv_dim, shape.value_dim, shape.num_v_heads, shape.num_v_heads], dim=-1
    )
    g = -module.A_log.exp() * F.softplus(alpha.float() + module.dt_bias)  # [T, Hv] fp32, as stock
    beta = beta.sigmoid()
    conv_weight = module.conv1d.weight.reshape(module.conv1d.weight.shape[0], -1)  # [C, 1, W] -> [C, W]
    conv_bias = module.conv1d.bias if module.conv_bias else None
    core_out = gdn_core(
        qkv, g, beta, conv_weight, conv_bias, shape=shape, mode=mode, plan=plan,
        group=group if cp > 1 else None, backend=choose_backend(module, device), layout=layout,
    )
    return core_out, gate.reshape(core_out.shape)


def _gated_norm(module, core_out, gate, batch: int, thd: bool):
    """Gated norm, under ``gdn_norm_out`` selective recompute when configured (as stock)."""
    if not module.recompute_norm_out:
        return _gated_norm_to_rows(module, core_out, gate, batch, thd)
    from megatron.core import tensor_parallel

    module.norm_out_checkpoint = tensor_parallel.CheckpointWithoutOutput()
    norm_fn = partial(_gated_norm_to_rows, module, batch=batch, thd=thd)
    return module.norm_out_checkpoint.checkpoint(norm_fn, core_out, gate)


def _swap_point(module, shape: GDNShape, hidden_states) -> str:
    """chunkwise's swap point for this module (see :mod:`gdn_cp.megatron.swap`), decided once
    per (setting, hidden size, dtype) and logged."""
    key = (chunkwise_swap(), hidden_states.shape[-1], hidden_states.dtype)
    choices = module.__dict__.setdefault(_SWAP_ATTR, {})
    if key not in choices:
        choice = choose_swap_point(
            shape=shape, hidden_size=key[1], tp=module.tp_size, sequence_parallel=module.sp_size > 1,
            act_bytes=hidden_states.element_size(), requested=key[0],
        )
        logger.info(
            "GatedDeltaNet layer %s chunkwise layout swap at %s (%s; core %d B/token, hidden %s B/token, "
            "stock headwise %d B/token)", getattr(module, "layer_number", None), choice.point, choice.reason,
            choice.core_bytes, choice.hidden_bytes, choice.stock_headwise_bytes,
        )
        choices[key] = choice.point
    return choices[key]


def _forward_hidden_swap(module, hidden_states, plan, group, shape: GDNShape, thd: bool, batch: int):
    """chunkwise with the layout swap on hidden_states: route ``[T_local, H]`` zigzag ->
    contiguous, run in_proj ... out_proj on contiguous rows, route the output back."""
    to_c, to_z = plan.route(ZIGZAG, CONTIGUOUS), plan.route(CONTIGUOUS, ZIGZAG)
    hidden = hidden_states.shape[-1]
    rows = hidden_states.reshape(-1, hidden) if thd else sbhd_to_thd(hidden_states)
    rows_c = route_all_to_all(rows, to_c, to_z, group).unsqueeze(1)  # [T_c, 1, H]: a packed micro-batch
    qkvzba, _ = module.in_proj(rows_c)
    core_out, gate = _core(
        module, qkvzba.reshape(-1, qkvzba.shape[-1]), shape, "chunkwise", plan, group, group.size(),
        hidden_states.device, layout="contiguous",
    )
    norm_out = _gated_norm(module, core_out, gate, 1, True)
    out_c, out_bias = module.out_proj(norm_out)  # [T_c, 1, H]
    if module.recompute_norm_out:
        module.norm_out_checkpoint.discard_output_and_register_recompute(out_c)
    out = route_all_to_all(out_c.reshape(-1, out_c.shape[-1]), to_z, to_c, group)
    return (out.unsqueeze(1) if thd else thd_to_sbhd(out, batch)), out_bias


def gated_delta_net_forward(
    module,
    hidden_states: torch.Tensor,
    attention_mask=None,
    inference_context=None,
    packed_seq_params=None,
    sequence_len_offset=None,
    **kwargs,
):
    """Replacement for ``GatedDeltaNet.forward`` under gdn-cp; returns ``(out, out_bias)``."""
    if inference_context is not None or kwargs.get("inference_params") is not None:
        raise NotImplementedError("GDN does not support inference in megatron-core 0.19.2 (nor in gdn-cp)")
    thd = _is_thd(packed_seq_params)
    group = resolve_cp_group(module, packed_seq_params)
    cp = group.size()
    mode = _checked_mode(module, cp)
    shape = _core_shape(module)

    # Everything that can be checked is checked before the first collective (in_proj may
    # communicate under sequence parallelism).
    s_local, batch = hidden_states.shape[0] * module.sp_size, hidden_states.shape[1]
    if thd:
        if batch != 1:
            raise ValueError(f"packed (THD) input needs batch 1, got hidden_states of shape {tuple(hidden_states.shape)}")
        plan = _thd_plan(packed_seq_params, group, s_local * cp)
    else:
        plan = _sbhd_plan(module, s_local * cp, batch, group)
    if plan.t_local != s_local * batch:
        raise ValueError(f"plan expects {plan.t_local} local rows, hidden_states gives {s_local * batch}")

    if mode == "chunkwise" and cp > 1 and _swap_point(module, shape, hidden_states) == "hidden":
        return _forward_hidden_swap(module, hidden_states, plan, group, shape, thd, batch)

    qkvzba, _ = module.in_proj(hidden_states)  # [S_local, B, D_tp]
    rows = qkvzba.reshape(-1, qkvzba.shape[-1]) if thd else sbhd_to_thd(qkvzba)
    core_out, gate = _core(module, rows, shape, mode, plan, group, cp, hidden_states.device)
    norm_out = _gated_norm(module, core_out, gate, batch, thd)
    out, out_bias = module.out_proj(norm_out)
    if module.recompute_norm_out:
        module.norm_out_checkpoint.discard_output_and_register_recompute(out)
    return out, out_bias
