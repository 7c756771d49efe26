"""Packed micro-batches as Megatron-LM delivers them, cut over CP ranks by Megatron's own code.

Megatron-LM's ``pretrain_gpt.py`` (tag ``core_v0.19.0``; megatron-core 0.19.2's ``utils.py`` is the
same) gets a micro-batch in three steps, which :func:`get_batch_like_pretrain_gpt` and
:func:`packed_seq_params_like_pretrain_gpt` repeat with megatron-core's own functions:

1. ``flatten_batch_for_packed_sequences``: per-sample ``cu_seqlens [mbs, S+1]`` (right-padded with
   copies of S by the data loader) merged into one row ``[1, n+1]``, the tokens into ``[1, mbs*S]``;
2. ``get_batch_on_this_cp_rank(batch, is_hybrid_cp, cp_group, hybrid_cp_group_func,
   use_per_sequence_balancing)``, whose strategy follows the data-loader flags (:data:`STRATEGIES`);
3. ``forward_step``: ``PackedSeqParams(qkv_format="thd")`` from the squeezed boundaries
   (``cu_seqlens_padded`` preferred for ``cu_seqlens_q/kv``), ``local_cp_size``, ``cp_group`` =
   the hybrid group, ``tokens_per_sample`` = S; none without ``cu_seqlens`` (SBHD).

The strategies (:data:`STRATEGIES`) and what a rank holds afterwards:

* ``sbhd`` (no packing flags): ``cu_seqlens`` None, every sample cut zigzag as a whole (2*cp
  parts, parts r and 2*cp-1-r);
* ``per_document`` (``--sft``): every document cut zigzag on its own, by TransformerEngine's
  ``thd_get_partitioned_indices`` (each document length a multiple of 2*cp);
* ``whole_row`` (``--dataloader-inter-document-masking``): the whole packed row cut zigzag as if
  it were one sequence (only the row must divide by 2*cp), the document boundaries unchanged;
* ``padded`` (``--dataloader-inter-document-masking`` with Megatron-LM's args asking for the
  per-document cut, as the patched ``validate_args`` does for models with attention layers): every
  document padded at its end to a multiple of 2*cp, then cut per document
  (:mod:`gdn_cp.megatron.document_padding`); Megatron-LM's global args are set for the call
  (:func:`megatron_lm_args`);
* ``hybrid`` (``--hybrid-context-parallel``): each sample carries ``local_cp_size``; 1: not cut
  (``PackedSeqParams(local_cp_size=1, cp_group=None)``), k > 1: the whole row cut over the
  hybrid group of k ranks that ``hybrid_cp_group_func(group_size=k)`` returns.

TransformerEngine is not installed on the test machines, so ``tex.thd_get_partitioned_indices``
(which the per-document strategy calls) is re-derived here in plain torch
(:func:`thd_get_partitioned_indices`) and installed as a stand-in ``tex`` in megatron's utils by
:func:`install_te_partition_stand_in` (test processes only; never where TransformerEngine is
present). Megatron is imported lazily, inside the functions.
"""

from __future__ import annotations

import contextlib
import copy
import random
import sys
import types
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from gdn_cp.checks import as_int
from gdn_cp.layout.packings import cumsum0

__all__ = [
    "BATCH_KEYS",
    "PADDED_CUT_ARGS",
    "STRATEGIES",
    "Cut",
    "cut_for_rank",
    "get_batch_like_pretrain_gpt",
    "install_te_partition_stand_in",
    "megatron_lm_args",
    "packed_batch",
    "packed_seq_params_like_pretrain_gpt",
    "random_lengths",
    "thd_get_partitioned_indices",
]

STRATEGIES = ("sbhd", "per_document", "whole_row", "padded", "hybrid")
# The keys pretrain_gpt.get_batch returns (its BATCH_KEYS), and what the data loader may set.
BATCH_KEYS = ("attention_mask", "cu_seqlens", "cu_seqlens_padded", "hybrid_cp_group", "labels", "local_cp_size",
              "loss_mask", "max_seqlen", "position_ids", "tokens")


# ------------------------------------------------------------------------------------------
# TransformerEngine's per-document split, in torch
# ------------------------------------------------------------------------------------------
def thd_get_partitioned_indices(cu_seqlens: torch.Tensor, total_tokens: int, world_size: int,
                                rank: int) -> torch.Tensor:
    """The indices ``[total_tokens / world_size]`` (int32, on ``cu_seqlens``' device) of the tokens
    of a packed row that CP rank ``rank`` holds, as ``transformer_engine_torch.
    thd_get_partitioned_indices`` returns them: every sequence of ``cu_seqlens [n+1]`` is cut into
    2*world_size equal parts and the rank holds parts ``rank`` and ``2*world_size-1-rank``,
    sequence after sequence (empty sequences hold nothing).

    TE's kernel asserts each length divisible by 2*world_size and assumes ``cu_seqlens[-1] ==
    total_tokens`` (it gives out-of-range indices otherwise); here both raise ValueError.
    """
    if as_int(world_size) is None or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive int")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r} must be in [0, world_size={world_size})")
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens must be 1-D [0, ..., total], got {cu_seqlens.tolist()}")
    lengths = cu[1:] - cu[:-1]
    if bool((lengths < 0).any()):
        raise ValueError(f"cu_seqlens must not decrease, got {cu.tolist()}")
    if int(cu[-1]) != total_tokens:
        raise ValueError(f"cu_seqlens[-1]={int(cu[-1])} must equal total_tokens={total_tokens}")
    bad = (lengths % (2 * world_size)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"sequence {bad[0]} has length {int(lengths[bad[0]])}, not divisible by "
                         f"2*world_size={2 * world_size}")
    local_cu = cu // world_size  # where each sequence starts among this rank's tokens
    token = torch.arange(total_tokens // world_size, dtype=torch.int64)
    seq = torch.searchsorted(local_cu, token, right=True) - 1  # last sequence starting at or before
    local_len = (lengths // world_size)[seq]
    offset = token - local_cu[seq]  # position among the rank's tokens of that sequence
    first = offset < local_len // 2
    part = torch.where(first, torch.full_like(token, rank), torch.full_like(token, 2 * world_size - 1 - rank))
    within = torch.where(first, offset, offset - local_len // 2)
    index = cu[:-1][seq] + part * (local_len // 2) + within
    return index.to(device=cu_seqlens.device, dtype=torch.int32)


def install_te_partition_stand_in() -> None:
    """Make megatron-core's per-document split callable without TransformerEngine: its
    ``megatron.core.utils.tex`` (None without TE) becomes a namespace with
    :func:`thd_get_partitioned_indices`. Test processes only. Where TransformerEngine is present
    its own ``tex`` stays."""
    import megatron.core.utils as mutils

    if mutils.tex is None:
        mutils.tex = types.SimpleNamespace(thd_get_partitioned_indices=thd_get_partitioned_indices)


# ------------------------------------------------------------------------------------------
# micro-batches as the data loader delivers them
# ------------------------------------------------------------------------------------------
def random_lengths(total: int, count: int, seed: int, unit: int = 1) -> list[int]:
    """``count`` positive lengths, multiples of ``unit``, summing to ``total`` (a multiple of
    ``unit``, at least ``count * unit``), drawn from ``seed``."""
    units = total // unit
    if total % unit or units < count:
        raise ValueError(f"cannot cut {total} into {count} positive multiples of {unit}")
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, units), count - 1))
    return [(b - a) * unit for a, b in zip([0] + cuts, cuts + [units])]


def _padded_cu(lengths: Sequence[int], seq_length: int) -> torch.Tensor:
    """``[S+1]`` int32: the boundaries, right-padded with copies of S as Megatron's GPT and SFT
    datasets pad them (so that samples with different document counts collate)."""
    cu = cumsum0(lengths)
    if cu[-1] != seq_length:
        raise ValueError(f"document lengths {list(lengths)} sum to {cu[-1]}, not seq_length={seq_length}")
    out = torch.full((seq_length + 1,), seq_length, dtype=torch.int32)
    out[: len(cu)] = torch.tensor(cu, dtype=torch.int32)
    return out


def packed_batch(documents: Optional[Sequence[Sequence[int]]], seq_length: int, *, vocab_size: int, seed: int,
                 mbs: int = 1, with_padded: bool = False, local_cp_size: Optional[int] = None) -> dict:
    """A micro-batch as ``get_batch_on_this_tp_rank`` hands it to ``get_batch`` (before flattening):
    ``tokens`` / ``labels`` / ``position_ids [mbs, S]`` int64, ``loss_mask [mbs, S]`` float (about
    10% zeros), ``attention_mask`` None, and for packed samples ``cu_seqlens [mbs, S+1]`` int32
    (padded with S, as Megatron's GPT and SFT datasets pad it) and ``max_seqlen [mbs]``, position
    ids restarting at every document. Drawn from ``seed``.

    ``documents``: per sample, its document lengths (summing to S); None for unpacked (SBHD)
    samples. ``with_padded``: ``cu_seqlens_padded`` too, a copy of ``cu_seqlens`` (as Megatron's
    own hybrid-CP batch test builds it; forward_step then takes the boundaries from it).
    ``local_cp_size``: a hybrid-CP sample's ``[1]`` int32 entry.
    """
    gen = torch.Generator().manual_seed(seed)
    batch = {key: None for key in BATCH_KEYS}
    batch["tokens"] = torch.randint(0, vocab_size, (mbs, seq_length), generator=gen)
    batch["labels"] = torch.randint(0, vocab_size, (mbs, seq_length), generator=gen)
    batch["loss_mask"] = (torch.rand(mbs, seq_length, generator=gen) > 0.1).to(torch.float32)
    batch["position_ids"] = torch.arange(seq_length).repeat(mbs, 1)
    if documents is not None:
        if len(documents) != mbs:
            raise ValueError(f"documents has {len(documents)} samples, mbs={mbs}")
        batch["cu_seqlens"] = torch.stack([_padded_cu(docs, seq_length) for docs in documents])
        if with_padded:
            batch["cu_seqlens_padded"] = batch["cu_seqlens"].clone()
        batch["max_seqlen"] = torch.tensor([max(docs) for docs in documents], dtype=torch.int32)
        for s, docs in enumerate(documents):
            batch["position_ids"][s] = torch.cat([torch.arange(n) for n in docs])
    if local_cp_size is not None:
        batch["local_cp_size"] = torch.tensor([local_cp_size], dtype=torch.int32)
    return batch


# ------------------------------------------------------------------------------------------
# Megatron-LM's get_batch and forward_step, on a batch this process already has
# ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def megatron_lm_args(**fields):
    """Inside: Megatron-LM's global args (``megatron.training.global_vars.set_args``, what
    ``get_args()`` returns) are a namespace of ``fields``; the previous args are restored on exit.
    Test processes only. ``megatron.training`` needs Python >= 3.12 (``typing.override``); on older
    Pythons ``typing`` gets ``typing_extensions``' identical run-time decorator first."""
    if sys.version_info < (3, 12) and not hasattr(__import__("typing"), "override"):
        import typing

        import typing_extensions

        typing.override = typing_extensions.override
    import megatron.training.global_vars as global_vars

    saved = global_vars._GLOBAL_ARGS
    global_vars.set_args(types.SimpleNamespace(**fields))
    try:
        yield
    finally:
        global_vars.set_args(saved)


PADDED_CUT_ARGS = dict(linear_cp_thd_split="per_document", dataloader_inter_document_masking=True, sft=False,
                       hybrid_context_parallel=False, sequence_parallel=False, tensor_model_parallel_size=1)
"""Megatron-LM's args (the fields the data path reads) for ``--dataloader-inter-document-masking`` in a
model with attention layers at CP > 1, as the patched ``validate_args`` leaves them."""


def get_batch_like_pretrain_gpt(batch: dict, *, cp_group, sft: bool = False, inter_document_masking: bool = False,
                                hybrid_context_parallel: bool = False,
                                hybrid_cp_group_func: Optional[Callable] = None, padded: bool = False) -> dict:
    """What ``pretrain_gpt.get_batch`` (core_v0.19.0) does to a batch after the TP broadcast:
    ``flatten_batch_for_packed_sequences``, then ``get_batch_on_this_cp_rank`` with the
    strategy its flags select (``use_per_sequence_balancing = inter_document_masking and not
    sft``). ``padded``: Megatron-LM's args ask for the padded per-document cut
    (:data:`PADDED_CUT_ARGS`). ``batch`` is changed in place and returned."""
    from megatron.core.utils import flatten_batch_for_packed_sequences, get_batch_on_this_cp_rank

    batch = flatten_batch_for_packed_sequences(batch)
    with megatron_lm_args(**PADDED_CUT_ARGS) if padded else contextlib.nullcontext():
        return get_batch_on_this_cp_rank(
            batch, is_hybrid_cp=hybrid_context_parallel, cp_group=cp_group, hybrid_cp_group_func=hybrid_cp_group_func,
            use_per_sequence_balancing=inter_document_masking and not sft,
        )


def packed_seq_params_like_pretrain_gpt(batch: dict, seq_length: int):
    """``pretrain_gpt.forward_step``'s PackedSeqParams (core_v0.19.0) for a batch from
    :func:`get_batch_like_pretrain_gpt`; None without ``cu_seqlens``. The boundaries are the
    batch's own tensors, squeezed (views: they share the batch tensors' storage)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_seqlens = batch.get("cu_seqlens")
    if cu_seqlens is None:
        return None
    cu_seqlens = cu_seqlens.squeeze(0)
    cu_seqlens_padded = batch.get("cu_seqlens_padded")
    if cu_seqlens_padded is not None:
        cu_seqlens_padded = cu_seqlens_padded.squeeze(0)
    cu_for_params = cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens
    max_seqlen = int(batch["max_seqlen"].item())
    local_cp_size = batch.get("local_cp_size")
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_for_params, cu_seqlens_kv=cu_for_params,
        cu_seqlens_q_padded=cu_seqlens_padded, cu_seqlens_kv_padded=cu_seqlens_padded,
        max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen,
        local_cp_size=int(local_cp_size.item()) if local_cp_size is not None else None,
        cp_group=batch.get("hybrid_cp_group"), tokens_per_sample=seq_length,
    )


@dataclass
class Cut:
    """One rank's part of a micro-batch: the batch (Megatron's cut), its PackedSeqParams (as
    forward_step builds them), ``rows`` (int64, the shape of the rank's ``tokens``): the position
    of each of the rank's tokens in the uncut batch flattened (``tokens.reshape(-1)``), -1 for a
    pad row (strategy ``padded``), and ``group``: the ranks this micro-batch is split over (None:
    not split)."""

    batch: dict
    packed_seq_params: object
    rows: torch.Tensor
    group: object


def cut_for_rank(batch: dict, strategy: str, *, cp_group, seq_length: int,
                 hybrid_cp_group_func: Optional[Callable] = None) -> Cut:
    """Cut ``batch`` (from :func:`packed_batch`) for this rank with Megatron's own functions in
    ``strategy`` (:data:`STRATEGIES`), and build its PackedSeqParams as forward_step does.

    ``rows`` come from the very same cut applied to a copy whose tokens are their own global
    positions plus one (a pad row's token is 0). ``cp_group`` of size 1 (a CP=1 baseline): nothing
    is cut."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r}: use one of {STRATEGIES}")
    flags = dict(sft=strategy == "per_document", inter_document_masking=strategy in ("whole_row", "padded"),
                 hybrid_context_parallel=strategy == "hybrid", hybrid_cp_group_func=hybrid_cp_group_func,
                 padded=strategy == "padded")
    index_batch = copy.deepcopy(batch)
    mbs, s = batch["tokens"].shape
    index_batch["tokens"] = torch.arange(1, mbs * s + 1, device=batch["tokens"].device).view(mbs, s)
    cut = get_batch_like_pretrain_gpt(batch, cp_group=cp_group, **flags)
    rows = get_batch_like_pretrain_gpt(index_batch, cp_group=cp_group, **flags)["tokens"] - 1
    group = cut.get("hybrid_cp_group")
    if strategy != "hybrid" and cp_group.size() > 1:
        group = cp_group
    return Cut(cut, packed_seq_params_like_pretrain_gpt(cut, seq_length), rows, group)
