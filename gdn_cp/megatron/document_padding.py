"""Packed pretraining rows (Megatron-LM ``--dataloader-inter-document-masking``) cut per document at
CP > 1: every document padded at its end to a multiple of 2*cp, then cut in 2*cp parts.

Stock Megatron-LM cuts such rows whole (``get_batch_on_this_cp_rank(..., use_per_sequence_balancing=
True)``), which gated delta net layers run exactly (the ``whole_row`` cut) but TransformerEngine's
THD attention under CP does not: it expects every document in 2*cp parts. The patched
``get_batch_on_this_cp_rank`` hands such a batch to :func:`cut_packed_rows` first; when Megatron-LM's
``validate_args`` chose the per-document cut (``args.linear_cp_thd_split == "per_document"``: the
model has attention or Mamba layers, or the user asked for it), :func:`pad_and_cut` makes it:

* every document's length rounded up to a multiple of 2*cp with pad rows at its end (fewer than
  2*cp per document), the last document further when each rank's rows must be a multiple of the TP
  size (sequence parallelism) or of the token multiple of FP8 / FP4 GEMMs (16 or 32:
  :mod:`gdn_cp.megatron.padded_cut`); :mod:`gdn_cp.layout.padding`;
* pad rows: token 0, label 0, loss mask 0, position id 0; the real rows keep theirs;
* ``cu_seqlens`` stays the documents' (logical) boundaries, ``cu_seqlens_padded`` becomes the padded
  ones and ``max_seqlen`` the longest padded document; Megatron-LM's ``forward_step`` gives
  ``PackedSeqParams`` the padded boundaries as ``cu_seqlens_q`` and ``cu_seqlens_q_padded`` (they are
  then equal, so TransformerEngine sees no padding between sequences: each padded document is one
  causal sequence whose pads come after every real row, so no real row attends to a pad);
* every padded document cut in 2*cp parts, rank r holding parts r and 2*cp-1-r (the rows of
  :func:`megatron.core.utils._get_batch_on_this_cp_rank_per_document_balancing`), and the cut
  recorded as ``per_document`` for the gated delta net layers (:func:`gdn_cp.megatron.thd_split.record_split`).

Every CP rank pads the same row the same way, so every rank gets the same number of rows; that
number changes from micro-batch to micro-batch. Why Megatron-LM's args and not a gdn-cp setting:
the scripts call ``get_batch_on_this_cp_rank`` with fixed arguments, and the only place that knows
the model's layers is ``validate_args``, which records its decision in ``args.linear_cp_thd_split``
(an args field that Megatron-LM prints, saves in checkpoints and copies into
``TransformerConfig.linear_cp_thd_split``, against which every GDN layer checks the recorded cut).
Reading that one field, where Megatron-LM's ``get_batch`` reads its own data flags, leaves no second
copy of the decision that could disagree with the args. Without Megatron-LM's args (megatron-core
used on its own) nothing changes; call :func:`pad_and_cut` yourself.

One device->host read of ``cu_seqlens`` and one host->device copy of the rank's row index per
micro-batch, in the data path (before the model runs).
"""

from __future__ import annotations

from typing import Any, Optional

from ..layout import PAD_SOURCE, PER_DOCUMENT, pad_documents, padded_rank_sources, padded_row_multiple
from ..layout.boundaries import check_cp, validate_cu_seqlens
from ..pins import running_release
from .padded_cut import padded_rows_multiple
from .thd_split import THD_SPLIT_FIELD, record_split

__all__ = ["cut_packed_rows", "pad_and_cut", "padded_cut_request", "record_split"]

def padded_cut_request(args: Any) -> Optional[int]:
    """How many rows each rank's part must be a multiple of (the TP size under sequence
    parallelism, times the token multiple of FP8 / FP4 GEMMs: :func:`gdn_cp.megatron.padded_cut.
    padded_rows_multiple`; else 1) when Megatron-LM's ``args`` ask ``get_batch_on_this_cp_rank`` for the padded
    per-document cut of ``--dataloader-inter-document-masking`` rows, else None: that is
    ``args.linear_cp_thd_split == 'per_document'`` (set by the patched ``validate_args``, see
    :func:`gdn_cp.megatron.thd_split.configure_megatron_lm_args`) with the flag, without ``--sft``
    and without hybrid CP (those cut their own way)."""
    if args is None or getattr(args, THD_SPLIT_FIELD, None) != PER_DOCUMENT:
        return None
    if not getattr(args, "dataloader_inter_document_masking", False) or getattr(args, "sft", False):
        return None
    if getattr(args, "hybrid_context_parallel", False):
        return None
    return padded_rows_multiple(args)


def cut_packed_rows(batch: dict, cp_group) -> Optional[dict]:
    """The patched ``get_batch_on_this_cp_rank``'s call with ``use_per_sequence_balancing=True``:
    ``batch`` padded and cut per document in place (:func:`pad_and_cut`) and returned when it has
    ``cu_seqlens``, Megatron-LM's args ask for the cut (:func:`padded_cut_request`) and the CP group
    has more than one rank; else None, with ``batch`` untouched (Megatron cuts the row whole, as
    stock).

    Args:
        batch (dict): the flattened micro-batch: ``cu_seqlens [1, n+1]`` int32, ``tokens`` / ``labels`` /
            ``loss_mask`` / ``position_ids [1, T]`` (the running release's keys and pad values:
            :func:`gdn_cp.pins.running_release`, found now).
        cp_group: the CP process group.

    Returns:
        Optional[dict]: ``batch`` with this rank's padded per-document rows (``[1, T_padded/cp]`` each, and
        ``cu_seqlens_padded [1, n+1]``), or None.
    """
    if batch.get("cu_seqlens") is None:
        return None
    local_multiple = padded_cut_request(running_release().megatron_lm_args())
    if local_multiple is None:
        return None
    from ..comm import group_rank, group_size

    cp = group_size(cp_group)
    if cp == 1:
        return None
    return pad_and_cut(batch, cp, group_rank(cp_group), local_multiple=local_multiple)


def _sequence_length(batch: dict, keys) -> int:
    found = {k: tuple(batch[k].shape) for k in keys if batch.get(k) is not None}
    shapes = set(found.values())
    if len(shapes) != 1 or len(next(iter(shapes))) != 2 or next(iter(shapes))[0] != 1:
        raise ValueError(f"pad_and_cut needs the flattened batch's {', '.join(keys)} as [1, T] tensors of one "
                         f"T (megatron.core.utils.flatten_batch_for_packed_sequences makes them), got shapes {found}")
    return next(iter(shapes))[1]


def pad_and_cut(batch: dict, cp: int, rank: int, *, local_multiple: int = 1) -> dict:
    """Pad every document of a flattened packed batch to a multiple of 2*cp and keep CP rank
    ``rank``'s per-document zigzag rows (module docstring); ``batch`` is changed in place and
    returned.

    ``batch``: what ``flatten_batch_for_packed_sequences`` returns: ``cu_seqlens [1, n+1]`` (int32, the
    documents of a ``[1, T]`` row), ``tokens`` / ``labels`` / ``loss_mask`` / ``position_ids [1, T]``
    (any of them None: a pipeline stage without it), ``max_seqlen [1]``, ``attention_mask`` None,
    ``cu_seqlens_padded`` None or equal to ``cu_seqlens``. ``local_multiple``: each rank's row count is
    made a multiple of it (the TP size under sequence parallelism). ValueError naming the key and
    the fix for any other batch."""
    import torch

    check_cp(cp, rank)
    cu_tensor = batch.get("cu_seqlens")
    if not isinstance(cu_tensor, torch.Tensor) or cu_tensor.dim() != 2 or cu_tensor.shape[0] != 1:
        raise ValueError(f"pad_and_cut needs batch['cu_seqlens'] as a [1, n+1] tensor (flattened), got "
                         f"{tuple(cu_tensor.shape) if isinstance(cu_tensor, torch.Tensor) else type(cu_tensor).__name__}")
    if batch.get("attention_mask") is not None:
        raise ValueError("pad_and_cut got a batch with an attention_mask, which it cannot pad; packed rows mask "
                         "attention through cu_seqlens (Megatron-LM: --no-create-attention-mask-in-dataloader)")
    release = running_release()  # the running megatron-core's batch keys and pad values, found now
    total = _sequence_length(batch, release.BATCH_SEQUENCE_KEYS)
    cu = validate_cu_seqlens(cu_tensor[0], 1, t_global=total)  # the micro-batch's one device->host read
    given = batch.get("cu_seqlens_padded")
    if given is not None and validate_cu_seqlens(given.reshape(-1), 1, name="cu_seqlens_padded") != cu:
        raise ValueError("pad_and_cut got a batch whose cu_seqlens_padded differs from its cu_seqlens: its rows "
                         "are padded already; cut them per document as they are (Megatron: --sft) instead")
    padded = pad_documents(cu, cp, padded_row_multiple(cp, local_multiple))
    source = padded_rank_sources(cu, padded, cp, rank)
    device = cu_tensor.device
    index = source.clamp(min=0).to(device, non_blocking=True)
    pad = (source == PAD_SOURCE).to(device, non_blocking=True)
    for key in release.BATCH_SEQUENCE_KEYS:
        value = batch.get(key)
        if value is not None:
            batch[key] = value.index_select(1, index).masked_fill_(pad.unsqueeze(0), release.BATCH_PAD_VALUES[key])
    batch["cu_seqlens_padded"] = padded.on(device, torch.int32).view(1, -1).clone()
    longest = int((padded.numpy()[1:] - padded.numpy()[:-1]).max(initial=0))
    if batch.get("max_seqlen") is not None:
        batch["max_seqlen"] = torch.full_like(batch["max_seqlen"], longest)
    record_split(batch, PER_DOCUMENT)
    return batch
