"""What a release adapter offers: :class:`ReleaseAdapter` (one per megatron-core release) and
:class:`LayerAdapter` (its view of one ``GatedDeltaNet``), declared once.

Every read gdn-cp makes of Megatron (a ``TransformerConfig``, a ``PackedSeqParams``, a layer, Megatron-LM's
args and batches, TransformerEngine's RMSNorm) goes through these two classes, so a release is one subclass
of each. The next release's adapter subclasses the previous one's and overrides only what changed, e.g.::

    from .megatron_core_0_19_2 import Release as Release0192, LayerAdapter as LayerAdapter0192

    class LayerAdapter(LayerAdapter0192):
        __slots__ = ()
        @property
        def sp_size(self) -> int:  # 0.20 renamed it
            return self.layer.sequence_parallel_size

    class Release(Release0192):
        VERSION = "0.20.0"
        LayerAdapter = LayerAdapter
        def read_config(self, config): ...  # a field renamed; the layer's config_fields follows it

A :class:`LayerAdapter` reads the config and ``PackedSeqParams`` through its release
(:attr:`LayerAdapter.release`), so overriding :meth:`ReleaseAdapter.read_config` is enough for both.
Torch-free and Megatron-free (imports nothing of gdn_cp).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

__all__ = ["ConfigFields", "LayerAdapter", "PackedSeqFields", "ReleaseAdapter"]


@dataclass(frozen=True)
class ConfigFields:
    """The ``TransformerConfig`` fields gdn-cp reads: those that decide ``linear_cp_mode``, and its settings.

    ``builds_gdn``: the config itself asks for GDN layers (``experimental_attention_variant=
    'gated_delta_net'``), which is when stock 0.19.2 checks the heads against TP*CP. ``hybrid``:
    a hybrid model (``is_hybrid_model``), which places GDN layers through its layer pattern
    (``G`` in Megatron-LM's ``--hybrid-layer-pattern``); the config does not see the pattern, so
    its layers are checked by the forward. ``activation``: ``activation_func``, which a GDN layer
    applies after its conv and to its output gate (it must be SiLU). ``head_dims``:
    ``(linear_key_head_dim, linear_value_head_dim)``; ``deterministic``: ``deterministic_mode``; the
    others are the fields of the same names.
    """

    linear_cp_mode: Any
    thd_split: Any
    num_key_heads: Any
    num_value_heads: Any
    tp: Any
    cp: Any
    builds_gdn: bool
    hybrid: bool = False
    activation: Any = None
    linear_cp_backend: Any = "auto"
    head_dims: Optional[tuple] = None  # (linear_key_head_dim, linear_value_head_dim)
    params_dtype: Any = None
    deterministic: bool = False
    hybrid_context_parallel: bool = False


@dataclass(frozen=True)
class PackedSeqFields:
    """The ``PackedSeqParams`` fields gdn-cp reads, as they are (checked where they are used).

    ``params``: the ``PackedSeqParams`` itself (None: there is none; gdn-cp keeps its per-micro-batch
    caches on it); ``thd``: packed input (``qkv_format == "thd"``); ``cu_seqlens``: the boundaries the rows were cut
    with (``cu_seqlens_q_padded``, else ``cu_seqlens_q``; None: neither), ``cu_name`` the field it came
    from; ``cp_group`` / ``local_cp_size``: the micro-batch's dynamic CP group and its size (None: unset)."""

    params: Any
    thd: bool
    cu_seqlens: Any
    cu_name: str
    cp_group: Any
    local_cp_size: Any


class LayerAdapter(ABC):
    """gdn-cp's view of one ``GatedDeltaNet`` layer: every attribute the forward reads or calls.

    Shapes are per TP rank: ``T`` rows, ``Hv_local`` value heads, ``C_local`` conv channels (``q|k|v``).
    Made by :meth:`ReleaseAdapter.layer_adapter`; holds the layer and its release.
    """

    __slots__ = ("layer", "release")

    def __init__(self, layer, release: "ReleaseAdapter"):
        self.layer = layer
        self.release = release

    # -- identity, config, micro-batch -----------------------------------------------------------
    @property
    @abstractmethod
    def layer_number(self) -> Optional[int]: ...

    @property
    def config_fields(self) -> ConfigFields:
        """The layer's ``TransformerConfig`` fields (:meth:`ReleaseAdapter.read_config`), read now: a field
        set after the model was built is seen on the next call."""
        return self.release.read_config(self.layer.config)

    def packed_seq(self, params) -> PackedSeqFields:
        """A micro-batch's ``PackedSeqParams`` fields (:meth:`ReleaseAdapter.read_packed_seq_params`)."""
        return self.release.read_packed_seq_params(params)

    @property
    @abstractmethod
    def activation(self): """The activation the layer computes with (must be SiLU)."""

    # -- parallel sizes and groups ---------------------------------------------------------------
    @property
    @abstractmethod
    def static_cp_group(self): """The model's CP group (a micro-batch may bring its own)."""

    @property
    @abstractmethod
    def tp_size(self) -> int: ...

    @property
    @abstractmethod
    def tp_group(self): ...

    @property
    @abstractmethod
    def sp_size(self) -> int: """TP size under sequence parallelism, else 1."""

    # -- heads, dtypes, device -------------------------------------------------------------------
    @property
    @abstractmethod
    def num_key_heads(self) -> int: """All key heads, before the TP split."""

    @property
    @abstractmethod
    def num_value_heads(self) -> int: """All value heads, before the TP split."""

    @property
    @abstractmethod
    def local_heads(self) -> tuple[int, int]: """``(key heads, value heads)`` of this TP rank."""

    @property
    @abstractmethod
    def head_dims(self) -> tuple[int, int]: """``(D_k, D_v)``."""

    @property
    @abstractmethod
    def activation_dtype(self): ...

    @property
    @abstractmethod
    def device(self): ...

    @property
    @abstractmethod
    def qk_l2norm(self) -> bool: ...

    # -- parameters ------------------------------------------------------------------------------
    @property
    @abstractmethod
    def A_log(self): """``[Hv_local]``."""  # noqa: N802 - Megatron's name

    @property
    @abstractmethod
    def dt_bias(self): """``[Hv_local]``."""

    @property
    @abstractmethod
    def conv_weight(self): """``[C_local, W]``."""

    @property
    @abstractmethod
    def conv_bias(self): """``[C_local]`` or None."""

    @abstractmethod
    def tp_partial_grad_params(self) -> list: """``[(name, param)]`` replicated over TP with per-rank partial gradients."""

    @abstractmethod
    def finalize_sums_over_tp(self, param) -> bool: """Whether Megatron's ``finalize_model_grads`` sums it over TP."""

    # -- submodules --------------------------------------------------------------------------------
    @abstractmethod
    def in_proj(self, hidden_states): """``[S, B, H]`` -> ``[S', B, q|k|v|z|beta|alpha]``."""

    @abstractmethod
    def gated_norm(self, core_out, gate): """``o, z [T, Hv, Dv]`` -> ``out_norm(o) * act(z)`` as ``[T*Hv, Dv]``."""

    @abstractmethod
    def plain_rms_gated_norm(self): """``(weight [Dv], eps, None)`` where a fused kernel may run, else ``(None, None, why)``."""

    @property
    @abstractmethod
    def out_norm_hooked(self) -> bool: ...

    @abstractmethod
    def gated_norm_weight(self): ...

    @abstractmethod
    def out_proj(self, x): """``[S', B, Hv*Dv]`` -> ``(out [S, B, H], bias)``."""

    @property
    @abstractmethod
    def recompute_norm_out(self) -> bool: ...

    @abstractmethod
    def new_norm_out_checkpoint(self): ...

    @abstractmethod
    def register_norm_out_recompute(self, out) -> None: ...


class ReleaseAdapter(ABC):
    """Everything gdn-cp reads from one megatron-core release (and its Megatron-LM scripts).

    A subclass sets the class attributes below and implements the abstract methods; instantiating one
    that leaves a class attribute unset raises TypeError naming it. :class:`~gdn_cp.pins.table.Pin` holds
    one instance; :func:`gdn_cp.pins.lookup.running_release` finds the running release's.
    """

    VERSION: ClassVar[str]
    """The release's version string (``megatron/core/package_info.py``)."""
    STOCK_MODE: ClassVar[str]
    """The ``linear_cp_mode`` of a config without the patch's field."""
    STOCK_BACKEND: ClassVar[str]
    """The ``linear_cp_backend`` of a config without the patch's field."""
    LayerAdapter: ClassVar[type]
    """The release's :class:`LayerAdapter` subclass."""
    TE_RMSNORM: ClassVar[tuple[str, str]]
    """``(module, qualname)`` of TransformerEngine's RMSNorm, as the release builds it."""
    HYBRID_GDN: ClassVar[str]
    """The hybrid layer pattern's symbol of a GDN layer."""
    HYBRID_PER_DOCUMENT: ClassVar[dict]
    """``{symbol: name}``: hybrid layers that expect every document cut in 2*cp parts on its own."""
    BATCH_SEQUENCE_KEYS: ClassVar[tuple[str, ...]]
    """The ``[1, T]`` tensors of a flattened Megatron-LM batch that are cut."""
    BATCH_PAD_VALUES: ClassVar[dict]
    """What a pad row holds in each of :attr:`BATCH_SEQUENCE_KEYS`."""
    QUANTIZED_ROW_MULTIPLE: ClassVar[dict]
    """``{"fp8": n, "mxfp8": n, "fp4": n}``: rows a quantized GEMM's token count is padded to."""
    ALLGATHER_REFUSES_VARIABLE_SEQ_LENGTHS: ClassVar[bool]
    """Whether the release's config refuses ``variable_seq_lengths`` with the ``allgather`` dispatcher."""

    _CLASS_ATTRIBUTES = ("VERSION", "STOCK_MODE", "STOCK_BACKEND", "LayerAdapter", "TE_RMSNORM", "HYBRID_GDN",
                         "HYBRID_PER_DOCUMENT", "BATCH_SEQUENCE_KEYS", "BATCH_PAD_VALUES", "QUANTIZED_ROW_MULTIPLE",
                         "ALLGATHER_REFUSES_VARIABLE_SEQ_LENGTHS")

    def __init__(self):
        missing = [name for name in self._CLASS_ATTRIBUTES if not hasattr(type(self), name)]
        if missing:
            raise TypeError(f"{type(self).__qualname__} does not set {', '.join(missing)}: a release adapter sets "
                            "every class attribute of gdn_cp.pins.adapter.ReleaseAdapter (subclass the previous "
                            "release's adapter to inherit them)")
        if not (isinstance(self.LayerAdapter, type) and issubclass(self.LayerAdapter, LayerAdapter)):
            raise TypeError(f"{type(self).__qualname__}.LayerAdapter is {self.LayerAdapter!r}, not a subclass of "
                            "gdn_cp.pins.adapter.LayerAdapter")

    def __repr__(self) -> str:
        return f"<{type(self).__module__}.{type(self).__qualname__} megatron-core {self.VERSION}>"

    def layer_adapter(self, layer) -> LayerAdapter:
        """This release's view of ``layer`` (a ``GatedDeltaNet``)."""
        return self.LayerAdapter(layer, self)

    # -- config time -------------------------------------------------------------------------------
    @abstractmethod
    def read_config(self, config) -> ConfigFields:
        """A ``TransformerConfig``'s fields as they are (unchecked); absent ones take the release's defaults."""

    @abstractmethod
    def set_linear_cp_mode(self, config, mode: str) -> None:
        """Store the resolved mode on the config."""

    # -- a micro-batch -------------------------------------------------------------------------------
    @abstractmethod
    def read_packed_seq_params(self, params) -> PackedSeqFields:
        """A micro-batch's ``PackedSeqParams`` fields (None: SBHD input, no dynamic CP)."""

    # -- Megatron-LM's scripts -------------------------------------------------------------------------
    @abstractmethod
    def megatron_lm_thd_split(self, *, sft: bool, inter_document_masking: bool,
                              hybrid_context_parallel: bool) -> Optional[str]:
        """The THD cut Megatron-LM's ``get_batch`` makes for these flags, or None (no packed rows)."""

    @abstractmethod
    def gpt_layer_pattern(self, args: Any) -> Optional[list]:
        """pretrain_gpt.py's per-layer pattern (1: GDN, 0: attention), or None when it cannot be known."""

    @abstractmethod
    def megatron_lm_args(self) -> Optional[Any]:
        """The args of the Megatron-LM run in this process, or None."""

    # -- TransformerEngine's RMSNorm (the fused gated norm) ----------------------------------------------
    @abstractmethod
    def fused_rms_norm_problem(self, norm, dim: int) -> Optional[str]:
        """None when a fused ``RMSNorm * silu(z)`` kernel may replace ``norm``, else why not."""

    @abstractmethod
    def fused_rms_norm_weight(self, norm):
        """The weight that kernel multiplies by (read on every forward)."""

    @abstractmethod
    def fused_rms_norm_eps(self, norm) -> float:
        """The ``eps`` of ``norm``."""
