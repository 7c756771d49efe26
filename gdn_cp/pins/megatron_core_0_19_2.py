"""Adapter for megatron-core 0.19.2: everything gdn-cp reads from or calls on its classes.

gdn-cp's forward (:mod:`gdn_cp.megatron.gdn`) and config hook (:mod:`gdn_cp.megatron.config`)
touch Megatron objects only through this module, so another release is one more module like
this one (see :mod:`gdn_cp.pins`). Imports neither torch nor Megatron at import time.

``GatedDeltaNet`` (megatron/core/ssm/gated_delta_net/common.py, gdn.py) attributes used:
``pg_collection.cp``, ``tp_size``, ``sp_size``, ``layer_number``, ``config``,
``num_key_heads`` / ``num_value_heads`` (global), ``num_k_heads_local_tp`` /
``num_v_heads_local_tp``, ``key_head_dim`` / ``value_head_dim``, ``use_qk_l2norm``, ``A_log``,
``dt_bias``, ``conv1d`` and ``conv_bias``, ``in_proj``, ``_apply_gated_norm`` (out_norm and the
gate), ``out_norm``'s parameters, ``out_proj``, ``recompute_norm_out`` and ``norm_out_checkpoint``.

How 0.19.2 splits the layer over TP (``tensor_model_parallel=True`` on the sharded parameters):
``in_proj`` is a column-parallel linear whose output channels are the sections
``q|k|v|z|beta|alpha``, each split over TP (``in_proj_split_sections``); ``conv1d`` holds the
TP-local ``q|k|v`` channels; ``A_log`` / ``dt_bias`` the TP-local value heads; ``out_proj`` is
row-parallel over the value heads. Replicated over TP: ``out_norm`` (one weight shared by every
value head) and ``out_proj``'s bias.

``TransformerConfig`` fields used: ``linear_cp_mode``, ``linear_cp_thd_split`` and
``linear_cp_backend`` (added by the patch), ``linear_num_key_heads``, ``linear_num_value_heads``,
``linear_key_head_dim``, ``linear_value_head_dim``, ``params_dtype``, ``tensor_model_parallel_size``,
``context_parallel_size``, ``experimental_attention_variant``, ``activation_func`` (the layer keeps
it as ``act_fn``), ``deterministic_mode``, ``sequence_parallel``, ``hybrid_context_parallel``.

``out_norm`` modules the fused gated norm takes (:func:`fused_rms_norm_problem`): torch's
``RMSNorm`` and TransformerEngine's ``transformer_engine.pytorch.module.rmsnorm.RMSNorm`` (what
Megatron's ``TENorm`` builds for ``normalization="RMSNorm"``), recognised by its class's module and
qualname, so TransformerEngine is never imported here. TE 2.x's RMSNorm (module/rmsnorm.py over
ops/basic/rmsnorm.py; read at 2.19 and 2.20.0.dev0, same files) computes ``x * rsqrt(mean(x^2) +
eps) * (weight + 1 if zero_centered_gamma else weight)`` over the last dims ``weight.shape``, has
no bias, and keeps ``sequence_parallel`` as a tag on its weight for Megatron.

``PackedSeqParams`` fields used (:func:`read_packed_seq_params`): ``qkv_format``, ``cu_seqlens_q_padded``
/ ``cu_seqlens_q``, ``cp_group`` and ``local_cp_size`` (dynamic CP).
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from ..checks import as_int
from . import adapter as _interface
from .adapter import ConfigFields, PackedSeqFields

__all__ = [
    "RELEASE", "Release", "VERSION", "STOCK_MODE", "STOCK_BACKEND", "ConfigFields", "read_config", "set_linear_cp_mode", "LayerAdapter", "TE_RMSNORM",
    "PackedSeqFields", "fused_rms_norm_eps", "fused_rms_norm_problem", "fused_rms_norm_weight", "out_norm_hooked",
    "read_packed_seq_params", "BATCH_PAD_VALUES", "BATCH_SEQUENCE_KEYS", "HYBRID_GDN", "HYBRID_PER_DOCUMENT",
    "gpt_layer_pattern", "megatron_lm_args", "megatron_lm_thd_split",
]

VERSION = "0.19.2"

STOCK_MODE = "headwise"
"""The ``linear_cp_mode`` of a config without the patch's field: 0.19.2's own (and only) GDN CP scheme."""

STOCK_BACKEND = "auto"
"""The ``linear_cp_backend`` of a config without the patch's field (gdn-cp's registry then chooses)."""

TE_RMSNORM = ("transformer_engine.pytorch.module.rmsnorm", "RMSNorm")
"""``(module, qualname)`` of TransformerEngine's RMSNorm module (``te.pytorch.RMSNorm``)."""


def read_config(config) -> ConfigFields:
    """Read the fields as they are (unchecked); absent ones take megatron-core 0.19.2's defaults
    (mode: ``headwise``, TP and CP: 1, ``activation_func``: ``F.gelu``; backend ``auto``)."""
    activation = getattr(config, "activation_func", _ABSENT)
    if activation is _ABSENT:
        import torch.nn.functional as F

        activation = F.gelu
    return ConfigFields(
        linear_cp_mode=getattr(config, "linear_cp_mode", STOCK_MODE),
        thd_split=getattr(config, "linear_cp_thd_split", None),
        num_key_heads=getattr(config, "linear_num_key_heads", None),
        num_value_heads=getattr(config, "linear_num_value_heads", None),
        tp=getattr(config, "tensor_model_parallel_size", 1),  # checked (positive ints) where used
        cp=getattr(config, "context_parallel_size", 1),
        builds_gdn=getattr(config, "experimental_attention_variant", None) == "gated_delta_net",
        hybrid=bool(getattr(config, "is_hybrid_model", False)),
        activation=activation,
        linear_cp_backend=getattr(config, "linear_cp_backend", STOCK_BACKEND),
        head_dims=(getattr(config, "linear_key_head_dim", None), getattr(config, "linear_value_head_dim", None)),
        params_dtype=getattr(config, "params_dtype", None),
        deterministic=bool(getattr(config, "deterministic_mode", False)),
        hybrid_context_parallel=bool(getattr(config, "hybrid_context_parallel", False)),
    )


_ABSENT = object()


_NO_PACKED_SEQ = PackedSeqFields(None, False, None, "cu_seqlens_q_padded", None, None)


def read_packed_seq_params(params) -> PackedSeqFields:
    """The fields of a micro-batch's ``PackedSeqParams`` (None: SBHD input, no dynamic CP)."""
    if params is None:
        return _NO_PACKED_SEQ
    cu, name = getattr(params, "cu_seqlens_q_padded", None), "cu_seqlens_q_padded"
    if cu is None:
        cu, name = getattr(params, "cu_seqlens_q", None), "cu_seqlens_q"
    return PackedSeqFields(params, getattr(params, "qkv_format", None) == "thd", cu, name,
                           getattr(params, "cp_group", None), getattr(params, "local_cp_size", None))


def set_linear_cp_mode(config, mode: str) -> None:
    """Store the resolved mode on the config (``TransformerConfig`` is a mutable dataclass)."""
    config.linear_cp_mode = mode


def _class_name(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _is_te_rms_norm(norm) -> bool:
    return (type(norm).__module__, type(norm).__qualname__) == TE_RMSNORM


def out_norm_hooked(norm) -> bool:
    """True when calling ``norm`` runs forward hooks (its own or torch's global ones), which a fused
    kernel reading ``norm.weight`` would skip: e.g. Megatron DDP's ``--overlap-param-gather``
    pre-hook on every module, which waits for the parameter's all-gather before the module runs."""
    from torch.nn.modules import module as torch_module

    return bool(norm._forward_pre_hooks or norm._forward_hooks
                or getattr(torch_module, "_global_forward_pre_hooks", None)
                or getattr(torch_module, "_global_forward_hooks", None))


def fused_rms_norm_problem(norm, dim: int) -> Optional[str]:
    """None when ``norm(x)`` over ``[N, dim]`` rows is exactly ``x * rsqrt(mean(x^2) + eps) * w``
    with ``w = fused_rms_norm_weight(norm)`` and ``eps = float(norm.eps)``, so that a fused
    ``RMSNorm * silu(z)`` kernel may replace ``norm(x) * silu(z)``; else the reason it may not.

    Taken: torch's ``RMSNorm`` (or a subclass keeping its forward) with a weight over the last dim;
    TransformerEngine's RMSNorm (:data:`TE_RMSNORM`, that class exactly: a subclass may change its
    forward) with a 1-D weight of ``dim`` values, a positive ``eps``, ``zero_centered_gamma`` a bool
    (True: the weight is ``weight + 1``), no bias, and its ``sequence_parallel`` flag (if set) the one
    its weight is tagged with. Refused: anything else (LayerNorm, TE's LayerNorm, fused-residual
    norms, ...), and a norm with forward hooks (:func:`out_norm_hooked`)."""
    import torch

    if _is_te_rms_norm(norm):
        weight = getattr(norm, "weight", None)
        if type(weight) is not torch.nn.Parameter or weight.dim() != 1 or weight.shape[0] != dim:
            shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else None
            return (f"out_norm ({_class_name(norm)}) has weight {type(weight).__name__} of shape {shape}, not a "
                    f"parameter of shape ({dim},): it normalizes over other dims than the value head dim")
        if getattr(norm, "bias", None) is not None:
            return f"out_norm ({_class_name(norm)}) has a bias"
        eps = getattr(norm, "eps", None)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < float("inf"):
            return f"out_norm ({_class_name(norm)}) has eps={eps!r}, not a positive number"
        zero_centered = getattr(norm, "zero_centered_gamma", None)
        if not isinstance(zero_centered, bool):
            return f"out_norm ({_class_name(norm)}) has zero_centered_gamma={zero_centered!r}, not a bool"
        sp = getattr(norm, "sequence_parallel", None)
        if sp is not None and bool(getattr(weight, "sequence_parallel", False)) != bool(sp):
            return (f"out_norm ({_class_name(norm)}) has sequence_parallel={sp!r} but its weight is tagged "
                    f"sequence_parallel={getattr(weight, 'sequence_parallel', None)!r}: the weight is not the one "
                    "TransformerEngine set up")
    elif isinstance(norm, torch.nn.RMSNorm) and type(norm).forward is torch.nn.RMSNorm.forward:
        if norm.weight is None or len(norm.normalized_shape) != 1:
            return "out_norm has no weight or normalizes over more than the last dim"
    else:
        return (f"out_norm is {_class_name(norm)}, neither torch's RMSNorm nor TransformerEngine's RMSNorm "
                f"({'.'.join(TE_RMSNORM)})")
    if out_norm_hooked(norm):
        return "out_norm has forward hooks (e.g. Megatron DDP's --overlap-param-gather), which a fused kernel would skip"
    return None


def fused_rms_norm_eps(norm) -> float:
    """``eps`` of a norm :func:`fused_rms_norm_problem` takes (torch's ``None``: its dtype's eps)."""
    import torch

    eps = norm.eps if norm.eps is not None else torch.finfo(norm.weight.dtype).eps
    return float(eps)


def fused_rms_norm_weight(norm):
    """The weight a norm :func:`fused_rms_norm_problem` takes multiplies by: ``norm.weight``, or for
    TransformerEngine's ``zero_centered_gamma`` ``weight + 1``, computed here in the autograd graph
    (so ``norm.weight`` gets its gradient) in at least fp32, as TE adds the 1 in its fp32 compute
    (a bf16 ``weight + 1`` would round the weight to steps of 2**-7). Call it on every forward."""
    import torch

    weight = norm.weight
    if _is_te_rms_norm(norm) and norm.zero_centered_gamma:
        return weight.to(torch.promote_types(weight.dtype, torch.float32)) + 1
    return weight


class LayerAdapter(_interface.LayerAdapter):
    """gdn-cp's view of one ``GatedDeltaNet`` layer of megatron-core 0.19.2 (:class:`gdn_cp.pins.adapter.LayerAdapter`).

    Two slots (the layer, its release); the forward keeps one per layer. Shapes below are per TP rank.
    """

    __slots__ = ()

    # -- identity, config ---------------------------------------------------------------------
    @property
    def layer_number(self) -> Optional[int]:
        return getattr(self.layer, "layer_number", None)

    @property
    def activation(self):
        """The activation the layer computes with (``act_fn``, from ``config.activation_func``)."""
        return self.layer.act_fn

    # -- parallel sizes and groups ------------------------------------------------------------
    @property
    def static_cp_group(self):
        """The model's CP group (a micro-batch may bring its own: PackedSeqParams.cp_group)."""
        return self.layer.pg_collection.cp

    @property
    def tp_size(self) -> int:
        return self.layer.tp_size

    @property
    def tp_group(self):
        """The model's TP group (``pg_collection.tp``)."""
        return self.layer.pg_collection.tp

    @property
    def sp_size(self) -> int:
        """TP size under sequence parallelism (hidden_states are split along S over TP), else 1."""
        return self.layer.sp_size

    # -- heads --------------------------------------------------------------------------------
    @property
    def num_key_heads(self) -> int:
        """All key heads of the layer (``linear_num_key_heads``), before the TP split."""
        return self.layer.num_key_heads

    @property
    def num_value_heads(self) -> int:
        return self.layer.num_value_heads

    @property
    def local_heads(self) -> tuple[int, int]:
        """``(key heads, value heads)`` of this TP rank."""
        return self.layer.num_k_heads_local_tp, self.layer.num_v_heads_local_tp

    @property
    def head_dims(self) -> tuple[int, int]:
        """``(D_k, D_v)``."""
        return self.layer.key_head_dim, self.layer.value_head_dim

    @property
    def activation_dtype(self):
        """The dtype of the layer's activations: its parameters' (Megatron's mixed precision keeps the
        model in bf16 / fp16; the core's own check sees the real one before any collective)."""
        return self.layer.conv1d.weight.dtype

    @property
    def device(self):
        """Where the layer's parameters, and so its activations, are."""
        return self.layer.conv1d.weight.device

    @property
    def qk_l2norm(self) -> bool:
        return bool(self.layer.use_qk_l2norm)

    # -- parameters ---------------------------------------------------------------------------
    @property
    def A_log(self):  # noqa: N802 - Megatron's name
        """``[Hv_local]``."""
        return self.layer.A_log

    @property
    def dt_bias(self):
        """``[Hv_local]``."""
        return self.layer.dt_bias

    @property
    def conv_weight(self):
        """Depthwise conv weight ``[C_local, W]`` (the module holds ``[C_local, 1, W]``)."""
        w = self.layer.conv1d.weight
        return w.reshape(w.shape[0], -1)

    @property
    def conv_bias(self):
        """``[C_local]`` or None."""
        return self.layer.conv1d.bias if self.layer.conv_bias else None

    # -- TP-replicated parameters with per-rank partial gradients -----------------------------
    def tp_partial_grad_params(self) -> list:
        """``[(name, param)]``: parameters replicated over TP whose gradient on a TP rank covers only
        that rank's value heads, so the TP replicas must sum them to get the true gradient.

        That is ``out_norm``'s parameters: one norm weight (and bias, for LayerNorm) over D_v shared
        by every value head, applied on each rank to its own heads. Not here: ``out_proj.bias`` is
        replicated too but is added after out_proj's TP all-reduce, so each rank already has its
        full gradient; every other parameter is TP-sharded.
        """
        norm = self.layer.out_norm
        return [(f"out_norm.{name}", p) for name, p in norm.named_parameters()
                if not getattr(p, "tensor_model_parallel", False)]

    def finalize_sums_over_tp(self, param) -> bool:
        """True when 0.19.2's ``finalize_model_grads`` (``_allreduce_non_tensor_model_parallel_grads``)
        sums this parameter's gradient over TP itself: ``config.sequence_parallel`` on and the
        parameter tagged ``sequence_parallel`` (TransformerEngine's and Apex's norms tag their
        weights with the config's value). Its other TP reduction, an average of params tagged
        ``average_gradients_across_tp_domain``, leaves replicas that are already equal unchanged.
        """
        return bool(self.layer.config.sequence_parallel and getattr(param, "sequence_parallel", False))

    # -- submodules, called exactly as the stock forward calls them ---------------------------
    def in_proj(self, hidden_states):
        """``[S, B, H]`` -> ``[S', B, q|k|v|z|beta|alpha]`` (S' = S * sp_size: gathers under SP)."""
        out, _bias = self.layer.in_proj(hidden_states)
        return out

    def gated_norm(self, core_out, gate):
        """``o, z [T, Hv, Dv]`` -> ``out_norm(o) * act(z)`` as ``[T*Hv, Dv]``."""
        return self.layer._apply_gated_norm(core_out, gate)

    def plain_rms_gated_norm(self):
        """``(weight [Dv], eps, None)`` when ``_apply_gated_norm`` is exactly ``x / rms(x) * weight *
        silu(z)``: out_norm is torch's or TransformerEngine's RMSNorm (see
        :func:`fused_rms_norm_problem`; ``weight`` is :meth:`gated_norm_weight`) and the activation
        is SiLU; else ``(None, None, reason)``. A fused kernel may then replace it."""
        import torch.nn.functional as F

        norm, act = self.layer.out_norm, self.layer.act_fn
        why = fused_rms_norm_problem(norm, self.head_dims[1])
        if why is not None:
            return None, None, why
        if act is not F.silu and getattr(act, "__name__", None) not in ("silu", "swish"):
            return None, None, f"the gate activation is {getattr(act, '__name__', act)!r}, not silu"
        return self.gated_norm_weight(), fused_rms_norm_eps(norm), None

    @property
    def out_norm_hooked(self) -> bool:
        """Whether calling ``out_norm`` now runs forward hooks (:func:`out_norm_hooked`); hooks come
        and go (Megatron DDP enables and disables its param-gather pre-hooks)."""
        return out_norm_hooked(self.layer.out_norm)

    def gated_norm_weight(self):
        """The weight the fused gated norm multiplies by, read on every call
        (:func:`fused_rms_norm_weight`: ``weight + 1`` for TE's ``zero_centered_gamma``)."""
        return fused_rms_norm_weight(self.layer.out_norm)

    def out_proj(self, x):
        """``[S', B, Hv*Dv]`` -> ``(out [S, B, H], bias)``."""
        return self.layer.out_proj(x)

    # -- gdn_norm_out selective recompute -----------------------------------------------------
    @property
    def recompute_norm_out(self) -> bool:
        return bool(self.layer.recompute_norm_out)

    def new_norm_out_checkpoint(self):
        """A fresh ``CheckpointWithoutOutput``, kept on the layer as the stock forward keeps it."""
        from megatron.core import tensor_parallel

        self.layer.norm_out_checkpoint = tensor_parallel.CheckpointWithoutOutput()
        return self.layer.norm_out_checkpoint

    def register_norm_out_recompute(self, out) -> None:
        """Drop the norm output once ``out`` exists and recompute it in backward (as stock)."""
        self.layer.norm_out_checkpoint.discard_output_and_register_recompute(out)


# -- Megatron-LM's training scripts of this release (core_v0.19.x): its args, its batches ------------

def megatron_lm_thd_split(*, sft: bool, inter_document_masking: bool, hybrid_context_parallel: bool) -> Optional[str]:
    """The THD cut (gdn_cp.layout's name) Megatron-LM's ``get_batch`` (``pretrain_gpt.py`` /
    ``pretrain_hybrid.py``, core_v0.19.x) makes for these flags, or None when it makes none (no packed rows):
    ``use_per_sequence_balancing = --dataloader-inter-document-masking and not --sft`` cuts whole
    rows, hybrid CP cuts each sub-sample's row whole, ``--sft`` cuts per document."""
    if hybrid_context_parallel or (inter_document_masking and not sft):
        return "whole_row"
    if sft or inter_document_masking:
        return "per_document"
    return None


# Megatron's hybrid layer symbols (megatron/core/models/hybrid/hybrid_layer_allocation.py, Symbols,
# core_v0.19.x): "G" gated delta net, "-" MLP and "E" MoE act per token or know the whole-row cut;
# these expect every document of a packed row cut in 2*cp parts on its own (TransformerEngine's THD
# attention under CP; Mamba's CP reorders THD rows with thd_get_partitioned_indices). "|" and "/"
# separate pipeline stages and MTP patterns.
HYBRID_GDN = "G"
HYBRID_PER_DOCUMENT = {"*": "attention", "D": "DSA attention", "+": "MLA attention", "M": "Mamba"}


def gpt_layer_pattern(args: Any) -> Optional[list]:
    """pretrain_gpt.py's per-layer pattern for ``--experimental-attention-variant gated_delta_net``
    (1: GDN, 0: standard attention), as megatron-core 0.19's ``get_linear_attention_pattern`` builds
    it from ``--linear-attention-freq`` (int N: attention at every N-th layer; a list: as given), or
    None when it cannot be known here."""
    freq = getattr(args, "linear_attention_freq", None)
    if isinstance(freq, list):
        return list(freq)
    freq, n = as_int(freq), as_int(getattr(args, "num_layers", None))
    if freq is None or freq < 1 or n is None:
        return None
    return [0 if (i + 1) % freq == 0 else 1 for i in range(n)]


BATCH_SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
"""The ``[1, T]`` tensors of a flattened Megatron-LM batch that are cut (Megatron's own SEQUENCE_KEYS)."""

BATCH_PAD_VALUES = {"tokens": 0, "labels": 0, "loss_mask": 0, "position_ids": 0}
"""What a pad row holds in each of :data:`BATCH_SEQUENCE_KEYS` (Megatron's GPT dataset maps its pad token
to 0 in tokens and labels and masks it out of the loss)."""


QUANTIZED_ROW_MULTIPLE = {"fp8": 16, "mxfp8": 32, "fp4": 32}
"""Rows a quantized GEMM's token count is padded to in megatron-core 0.19 (``fp8_utils.get_fp8_align_size``:
32 for the mxfp8 recipe, else 16; ``fp4_utils.get_fp4_align_size``: 32)."""

ALLGATHER_REFUSES_VARIABLE_SEQ_LENGTHS = True
"""megatron-core 0.19's ``TransformerConfig`` refuses ``variable_seq_lengths`` with
``moe_token_dispatcher_type="allgather"`` (its default) in every model, with experts or without."""


def megatron_lm_args() -> Optional[Any]:
    """The args of the Megatron-LM run in this process (``megatron.training.get_args()``), or None
    when there is none: ``megatron.training`` never imported (megatron-core used on its own; it is
    not imported here, it is Python >= 3.12 only and heavy), or its args not set yet."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    if global_vars is None:
        return None
    try:
        return global_vars.get_args()
    except AssertionError:  # "args is not initialized"
        return None


class Release(_interface.ReleaseAdapter):
    """megatron-core 0.19.2 (:class:`gdn_cp.pins.adapter.ReleaseAdapter`): the module's functions and constants.

    The next release's adapter subclasses this class (and :class:`LayerAdapter`) and overrides what changed."""

    VERSION = VERSION
    STOCK_MODE = STOCK_MODE
    STOCK_BACKEND = STOCK_BACKEND
    LayerAdapter = LayerAdapter
    TE_RMSNORM = TE_RMSNORM
    HYBRID_GDN = HYBRID_GDN
    HYBRID_PER_DOCUMENT = HYBRID_PER_DOCUMENT
    BATCH_SEQUENCE_KEYS = BATCH_SEQUENCE_KEYS
    BATCH_PAD_VALUES = BATCH_PAD_VALUES
    QUANTIZED_ROW_MULTIPLE = QUANTIZED_ROW_MULTIPLE
    ALLGATHER_REFUSES_VARIABLE_SEQ_LENGTHS = ALLGATHER_REFUSES_VARIABLE_SEQ_LENGTHS

    def read_config(self, config) -> ConfigFields:
        return read_config(config)

    def set_linear_cp_mode(self, config, mode: str) -> None:
        set_linear_cp_mode(config, mode)

    def read_packed_seq_params(self, params) -> PackedSeqFields:
        return read_packed_seq_params(params)

    def megatron_lm_thd_split(self, *, sft: bool, inter_document_masking: bool,
                              hybrid_context_parallel: bool) -> Optional[str]:
        return megatron_lm_thd_split(sft=sft, inter_document_masking=inter_document_masking,
                                     hybrid_context_parallel=hybrid_context_parallel)

    def gpt_layer_pattern(self, args: Any) -> Optional[list]:
        return gpt_layer_pattern(args)

    def megatron_lm_args(self) -> Optional[Any]:
        return megatron_lm_args()

    def fused_rms_norm_problem(self, norm, dim: int) -> Optional[str]:
        return fused_rms_norm_problem(norm, dim)

    def fused_rms_norm_weight(self, norm):
        return fused_rms_norm_weight(norm)

    def fused_rms_norm_eps(self, norm) -> float:
        return fused_rms_norm_eps(norm)


RELEASE = Release()
"""The adapter instance of this release (its :class:`~gdn_cp.pins.table.Pin` row holds it)."""
