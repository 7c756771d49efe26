"""A CPU stand-in for TransformerEngine's THD attention under context parallelism, for test models.

TransformerEngine is never installed on the CPU machines, and Megatron's local ``DotProductAttention``
takes no packed (THD) rows, so a test model with attention layers needs a core attention of its own.
:class:`ThdCpAttention` computes what Megatron's ``TEDotProductAttention`` asks TransformerEngine for
on packed rows, as TransformerEngine defines it:

* the documents are ``PackedSeqParams.cu_seqlens_q_padded`` (else ``cu_seqlens_q``), global offsets
  over the whole packed row; attention is causal within each document and never crosses one;
* under CP (``pg_collection.cp`` of ``cp`` ranks) a rank's rows are the per-document zigzag cut of
  those boundaries (parts r and 2*cp-1-r of every document, document after document: what
  ``thd_get_partitioned_indices`` gives and TE's CP attention assumes); every document length must
  divide by 2*cp (ValueError otherwise, as TE refuses it);
* keys and values are all-gathered over the CP group (backward: reduce-scatter), each local query
  attends to every earlier key of its document; no dropout, no bias, ``softmax_scale`` or
  1/sqrt(head dim); grouped query heads are repeated.

Rows cut another way (Megatron's whole-row cut, stock ``--dataloader-inter-document-masking``) are
read as this cut all the same, as TransformerEngine reads them: a wrong model without an error when
the lengths happen to divide. Plain torch, any dtype; for tests (fp64), not for speed.
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["ThdCpAttention", "attention_layer_spec"]


def _zigzag_rows(cu: np.ndarray, cp: int, rank: int) -> np.ndarray:
    from gdn_cp.layout.spans import expand_spans, zigzag_rank_spans

    spans = zigzag_rank_spans(cu, cp, rank)
    return expand_spans(spans.start, spans.length).numpy()


class ThdCpAttention(torch.nn.Module):
    """Core attention with the constructor and forward Megatron's ``SelfAttention`` uses
    (``core_attention`` of ``SelfAttentionSubmodules``); THD only (``packed_seq_params`` with
    ``qkv_format='thd'``): query ``[t, heads, d]``, key / value ``[t, groups, d]`` -> ``[t, heads * d]``."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, cp_comm_type=None, softmax_scale=None,
                 pg_collection=None, **_unused):
        super().__init__()
        self.config = config
        self.softmax_scale = softmax_scale
        self.cp_group = getattr(pg_collection, "cp", None)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        from gdn_cp.comm import all_gather_rows

        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ValueError("ThdCpAttention takes packed (THD) rows only: pass PackedSeqParams(qkv_format='thd')")
        if getattr(packed_seq_params, "cp_group", None) is not None:
            raise ValueError("ThdCpAttention has no dynamic CP: PackedSeqParams.cp_group must be None")
        cu_t = packed_seq_params.cu_seqlens_q_padded
        cu_t = packed_seq_params.cu_seqlens_q if cu_t is None else cu_t
        cu = cu_t.detach().to("cpu", torch.int64).numpy()
        cp = 1 if self.cp_group is None else self.cp_group.size()
        rank = 0 if cp == 1 else self.cp_group.rank()
        lengths = np.diff(cu)
        if cp > 1 and (lengths % (2 * cp)).any():
            i = int(np.argmax(lengths % (2 * cp) != 0))
            raise ValueError(f"ThdCpAttention: document {i} has length {int(lengths[i])}, not divisible by 2*cp={2 * cp} "
                             "(TransformerEngine's THD attention under CP cuts every document in 2*cp parts)")
        if cp == 1:
            mine, everyone = np.arange(int(cu[-1])), np.arange(int(cu[-1]))
            keys, values = key, value
        else:
            mine = _zigzag_rows(cu, cp, rank)
            everyone = np.concatenate([_zigzag_rows(cu, cp, r) for r in range(cp)])
            keys, values = all_gather_rows(key, self.cp_group), all_gather_rows(value, self.cp_group)
        if len(mine) != query.shape[0] or len(everyone) != keys.shape[0]:
            raise ValueError(f"ThdCpAttention: {query.shape[0]} local rows, but the boundaries {cu.tolist()} give "
                             f"{len(mine)} to this rank of {cp}")
        heads, groups = query.shape[1], keys.shape[1]
        keys = keys.repeat_interleave(heads // groups, dim=1)
        values = values.repeat_interleave(heads // groups, dim=1)
        doc_q = torch.from_numpy(np.searchsorted(cu, mine, side="right") - 1)
        doc_k = torch.from_numpy(np.searchsorted(cu, everyone, side="right") - 1)
        pos_q, pos_k = torch.from_numpy(mine), torch.from_numpy(everyone)
        allowed = (doc_q[:, None] == doc_k[None, :]) & (pos_k[None, :] <= pos_q[:, None])  # [t_local, t]
        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(query.shape[-1])
        scores = torch.einsum("qhd,khd->hqk", query, keys) * scale
        scores = scores.masked_fill(~allowed.to(scores.device)[None], float("-inf"))
        out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), values)
        return out.reshape(out.shape[0], -1)


def attention_layer_spec():
    """A TransformerLayer ModuleSpec of Megatron's local modules with :class:`ThdCpAttention` as the
    core attention: local RMSNorm -> SelfAttention (ColumnParallelLinear qkv, causal, RowParallelLinear
    out) -> residual."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    norm = LocalSpecProvider().layer_norm(rms_norm=True, for_qk=False, has_residual=True)
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=norm,
        self_attention=ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                                  submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear,
                                                                     core_attention=ThdCpAttention,
                                                                     linear_proj=RowParallelLinear)),
        self_attn_bda=get_bias_dropout_add,
    ))
