"""How Megatron cut a packed (THD) micro-batch over the CP ranks: per document or as one whole row.

Megatron has two THD cuts, and ``PackedSeqParams`` carries the same document boundaries for both
(see :data:`gdn_cp.layout.PER_DOCUMENT` and :data:`gdn_cp.layout.WHOLE_ROW`):

* per document: ``megatron.core.utils.get_batch_on_this_cp_rank`` without per-sequence balancing
  (Megatron-LM ``--sft``); every document is cut into 2*cp parts on its own; also, with the patch,
  ``--dataloader-inter-document-masking`` rows at CP > 1 in a model with attention layers, each
  document first padded to a multiple of 2*cp (:mod:`gdn_cp.megatron.document_padding`);
* whole row: ``get_batch_on_this_cp_rank(..., use_per_sequence_balancing=True)`` (Megatron-LM
  ``--dataloader-inter-document-masking`` without ``--sft``) and hybrid CP (``--hybrid-context-parallel``,
  a sub-sample over ``local_cp_size > 1`` ranks): the whole row is cut as if it were one sequence.

A GDN layer that took one cut for the other would compute a wrong model without any error whenever
the document lengths happen to divide by 2*cp, so the cut is never guessed. It is known from, in
this order:

1. a record made by Megatron's own splitter: the patched ``get_batch_on_this_cp_rank`` calls
   :func:`record_split` in the branch that cut the rows; the record is kept on the storage of the
   batch's ``cu_seqlens`` / ``cu_seqlens_padded`` tensors, so the views Megatron-LM's ``forward_step``
   puts into ``PackedSeqParams`` (``cu_seqlens.squeeze(0)``) carry it, it costs no device sync to
   read, and it dies with the tensors;
2. ``TransformerConfig.linear_cp_thd_split`` (added by the patch; Megatron-LM ``--linear-cp-thd-split``):
   for rows cut by the user's own code, and for pipeline stages that never see the splitter
   (Megatron-LM's ``get_batch`` returns the boundaries of middle stages before it cuts anything).
   Megatron-LM's patched ``validate_args`` sets it from the flags that choose the cut
   (:func:`configure_megatron_lm_args`);
3. otherwise, with ``config.hybrid_context_parallel``, ``whole_row``: Megatron's hybrid-CP splitter
   always cuts each sub-sample over its ``local_cp_size`` ranks as one whole row (per-sequence
   balancing; ``local_cp_size=1`` cuts nothing);
4. otherwise a ValueError naming ``linear_cp_thd_split`` and its values, before any collective:
   the cut is never guessed. At CP=1 nothing is cut, so no cut is needed.

A record and an explicit setting that disagree stop the layer call with a ValueError before any
collective.

Megatron-LM's patched ``validate_args`` calls :func:`configure_megatron_lm_args`, which also stops
flag combinations that would train another model than CP=1 without an error (a GDN model without
``--swiglu``: GDN computes SiLU; per-rank loss averages with uneven loss masks) and chooses the cut
of ``--dataloader-inter-document-masking`` rows at CP > 1: ``whole_row`` (stock: the packed row in
2*cp parts, no padding) for models of GDN, MLP and MoE layers, ``per_document`` (every document
padded to a multiple of 2*cp and cut in 2*cp parts: :mod:`gdn_cp.megatron.document_padding`) when
the model has layers that expect it (attention, Mamba; :func:`per_document_layers`) or when asked
(``--linear-cp-thd-split per_document``). Torch is imported lazily; Megatron is never imported here.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

from ..checks import as_int
from ..layout.boundaries import PER_DOCUMENT, WHOLE_ROW, check_thd_split
from ..modes.settings import THD_SPLIT_FIELD, Settings, check_thd_split_setting
from ..pins import running_release
from .packed_pipeline import configure_packed_pipeline
from .padded_cut import enable_variable_seq_lengths, mtp_needs_per_document, padded_cut_refusals


__all__ = [
    "THD_SPLIT_FIELD",
    "check_thd_split_setting",
    "check_megatron_lm_model",
    "configure_megatron_lm_args",
    "per_document_layers",
    "record_split",
    "recorded_split",
    "resolve_thd_split",
]

_RECORDS: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()  # tensor storage -> split
_BATCH_KEYS = ("cu_seqlens", "cu_seqlens_padded")


def record_split(batch: dict, split: str) -> None:
    """Remember that ``batch``'s rows were cut by ``split`` (called by the patched
    ``megatron.core.utils.get_batch_on_this_cp_rank``, in the branch that made the cut).

    Every tensor under ``cu_seqlens`` / ``cu_seqlens_padded`` gets the record on its storage;
    views of it (what ``PackedSeqParams`` receives) share it. Host metadata only: no device work.

    Args:
        batch (dict): the micro-batch, with ``cu_seqlens`` / ``cu_seqlens_padded`` ``[1, n+1]`` int32 tensors.
        split (str): ``per_document`` or ``whole_row`` (ValueError otherwise).
    """
    import torch

    check_thd_split(split)  # a record is a split, never None
    for key in _BATCH_KEYS:
        value = batch.get(key) if isinstance(batch, dict) else None
        if isinstance(value, torch.Tensor):
            _RECORDS[value.untyped_storage()] = split


def recorded_split(cu_seqlens: Any) -> Optional[str]:
    """The split recorded for the storage of ``cu_seqlens`` (a tensor), or None."""
    import torch

    if not isinstance(cu_seqlens, torch.Tensor):
        return None
    return _RECORDS.get(cu_seqlens.untyped_storage())


def resolve_thd_split(setting: Optional[str], *, hybrid_context_parallel: bool, cu_seqlens: Any, cp: int) -> tuple[str, str]:
    """``(split, where it comes from)`` for one THD layer call (see the module docstring for the
    order). ``setting``: the config's ``linear_cp_thd_split``; ``cu_seqlens``: the boundaries tensor
    the layer plans with; ``cp``: the size of the CP group the rows were cut over. ValueError,
    before any collective, when a record contradicts ``setting`` (a checked ``Settings.thd_split``),
    and at ``cp > 1`` when neither a record nor ``setting`` nor hybrid CP says how the rows were cut."""
    recorded = recorded_split(cu_seqlens)
    if recorded is not None:
        if setting is not None and setting != recorded:
            raise ValueError(
                f"TransformerConfig.{THD_SPLIT_FIELD}={setting!r}, but Megatron's get_batch_on_this_cp_rank cut "
                f"these rows {recorded!r} (recorded on the micro-batch's cu_seqlens); set {THD_SPLIT_FIELD}="
                f"{recorded!r} or leave it None (Megatron-LM: drop --linear-cp-thd-split)"
            )
        return recorded, "recorded by megatron.core.utils.get_batch_on_this_cp_rank"
    if setting is not None:
        return setting, f"TransformerConfig.{THD_SPLIT_FIELD}={setting!r}"
    if hybrid_context_parallel:
        return WHOLE_ROW, (f"{THD_SPLIT_FIELD}=None with hybrid_context_parallel=True (Megatron's hybrid-CP "
                           "splitter cuts every sub-sample as one whole row)")
    if cp == 1:
        return PER_DOCUMENT, f"{THD_SPLIT_FIELD}=None at CP=1: nothing is cut"
    raise ValueError(
        f"TransformerConfig.{THD_SPLIT_FIELD} is None and these packed (THD) rows carry no record of "
        f"Megatron's get_batch_on_this_cp_rank, so how they were cut over the {cp} CP ranks is unknown (gdn-cp "
        f"does not guess: the wrong cut computes a wrong model without an error). Set {THD_SPLIT_FIELD} to "
        f"{PER_DOCUMENT!r} if every document was cut into 2*cp parts on its own (Megatron-LM --sft; "
        f"TransformerEngine's thd_get_partitioned_indices), or {WHOLE_ROW!r} if each packed row was cut into "
        f"2*cp parts as one sequence (Megatron-LM --dataloader-inter-document-masking without --sft; "
        f"get_batch_on_this_cp_rank(..., use_per_sequence_balancing=True)); or cut the rows with "
        f"megatron.core.utils.get_batch_on_this_cp_rank, which records its cut"
    )


def per_document_layers(args: Any) -> Optional[str]:
    """What in the Megatron-LM model of ``args`` expects every packed document cut into 2*cp parts
    on its own, as a phrase naming the flags that say so: attention layers and Mamba
    (:func:`_per_document_mixers`) and multi-token prediction layers
    (:func:`gdn_cp.megatron.padded_cut.mtp_needs_per_document`); None for a model of gated delta
    net, MLP and MoE layers alone."""
    found = [phrase for phrase in (_per_document_mixers(args), mtp_needs_per_document(args)) if phrase]
    return "; ".join(found) if found else None


def _per_document_mixers(args: Any) -> Optional[str]:
    """What in the Megatron-LM model of ``args`` expects every packed document cut into 2*cp parts
    on its own (attention layers, Mamba), as a phrase naming the flags that say so; None for a
    model of gated delta net, MLP and MoE layers alone.

    ``pretrain_hybrid.py`` (``--hybrid-layer-pattern``): the pattern's symbols (``*`` attention,
    ``D`` DSA, ``+`` MLA, ``M`` Mamba). ``pretrain_gpt.py``: every layer is attention, unless
    ``--experimental-attention-variant gated_delta_net`` with a ``--linear-attention-freq`` that
    leaves no standard-attention layer (e.g. an int above ``--num-layers``, or a list of 1s;
    MTP layers take the last layer's spec); a custom ``--spec`` is not looked into (taken as
    attention)."""
    pattern = getattr(args, "hybrid_layer_pattern", None)
    if pattern is not None:
        found = [f"{sym!r} {name}" for sym, name in running_release().HYBRID_PER_DOCUMENT.items() if sym in pattern]
        return f"--hybrid-layer-pattern {pattern!r}: {', '.join(found)}" if found else None
    if getattr(args, "spec", None):
        return "--spec " + " ".join(map(str, args.spec)) + " (a custom layer spec: its layers are not known here)"
    variant = getattr(args, "experimental_attention_variant", None)
    if variant != "gated_delta_net":
        kind = "DSA attention" if variant == "dsa" else "attention"
        return f"pretrain_gpt.py without --experimental-attention-variant gated_delta_net: every layer is {kind}"
    layers = running_release().gpt_layer_pattern(args)
    freq = getattr(args, "linear_attention_freq", None)
    if layers is None:
        return f"--linear-attention-freq {freq!r}: which layers are attention is not known here"
    attention = [i + 1 for i, kind in enumerate(layers) if kind == 0]
    if not attention:
        return None
    return (f"--experimental-attention-variant gated_delta_net with --linear-attention-freq {freq!r}: standard "
            f"attention at layer{'s' if len(attention) > 1 else ''} {', '.join(map(str, attention))}")


def _has_gdn_layers(args: Any) -> Optional[str]:
    """The flags that put gated delta net layers into the Megatron-LM model of ``args``, or None."""
    pattern = getattr(args, "hybrid_layer_pattern", None)
    if pattern is not None:
        gdn = running_release().HYBRID_GDN
        return f"--hybrid-layer-pattern {pattern!r} has gated delta net layers ({gdn!r})" if gdn in pattern else None
    if getattr(args, "experimental_attention_variant", None) == "gated_delta_net":
        return "--experimental-attention-variant gated_delta_net builds gated delta net layers"
    return None


def check_megatron_lm_model(args: Any) -> None:
    """ValueError for Megatron-LM flags that would train another model than the one asked for,
    without an error (called by :func:`configure_megatron_lm_args`, before anything is built):

    * gated delta net layers without ``--swiglu``: Megatron-LM then gives the model
      ``activation_func=gelu`` (or squared ReLU / quick GELU), while GDN computes SiLU;
    * ``--dataloader-inter-document-masking`` with ``--hybrid-context-parallel`` at
      ``--context-parallel-size`` > 1 in a model with layers that expect the per-document cut
      (:func:`per_document_layers`): Megatron-LM's ``get_batch`` then cuts each packed row whole,
      while TransformerEngine's THD attention under CP expects every document cut in 2*cp parts
      (measured on one H200, TE 2.20.2, 6 iterations, without hybrid CP: loss 3.2-3.5% off CP=1 for
      ``G-G-*-`` and ``*-*-``). Without hybrid CP such rows are padded and cut per document instead
      (:func:`configure_megatron_lm_args`).
    * ``--sft`` or ``--eod-mask-loss`` at ``--context-parallel-size`` > 1 without
      ``--calculate-per-token-loss``, in a model with GDN layers: Megatron-LM's schedule then divides
      each CP rank's loss by that rank's own count of loss tokens, which differ between ranks when the
      loss mask does, so the gradient weights the ranks unequally (stock megatron-core alike).
      Measured on one H200 (``G-G-*-``, ``--sft``, 20 iterations): loss within 1.5e-4 of CP=1, grad
      norm 10% (CP=2) and 14% (CP=4) off, stock at CP=2 off by the same.
    """
    gdn = _has_gdn_layers(args)
    if gdn is not None and not getattr(args, "swiglu", False):
        act = ("squared_relu" if getattr(args, "squared_relu", False)
               else "quick_gelu" if getattr(args, "quick_geglu", False) else "gelu")
        raise ValueError(
            f"{gdn}, which compute SiLU (their conv and output gate), but without --swiglu Megatron-LM gives the "
            f"model activation_func={act}; add --swiglu (it sets activation_func=F.silu for the whole model: the "
            "MLPs become SwiGLU, as in Qwen3-Next)"
        )
    cp = as_int(getattr(args, "context_parallel_size", 1))
    masks = [flag for flag, field in (("--sft", "sft"), ("--eod-mask-loss", "eod_mask_loss")) if getattr(args, field, False)]
    per_rank_average = not getattr(args, "calculate_per_token_loss", False)
    if gdn is not None and masks and cp is not None and cp > 1 and per_rank_average:
        raise ValueError(
            f"{' '.join(masks)} at --context-parallel-size {cp} without --calculate-per-token-loss: Megatron-LM then "
            "divides each CP rank's loss by that rank's own count of loss tokens, and with this loss mask the counts "
            "differ between ranks, so the gradient weights the ranks unequally and CP > 1 would train another model "
            "than CP=1 without an error (the loss it prints still matches). Add --calculate-per-token-loss (to the "
            "CP=1 run too: it averages over every token of the step), or --context-parallel-size 1"
        )
    hybrid_idm = (bool(getattr(args, "dataloader_inter_document_masking", False)) and not getattr(args, "sft", False)
                  and getattr(args, "hybrid_context_parallel", False))
    layers = per_document_layers(args) if hybrid_idm and cp is not None and cp > 1 else None
    if layers is not None:
        raise ValueError(
            f"--dataloader-inter-document-masking with --hybrid-context-parallel at --context-parallel-size {cp}: "
            "Megatron-LM's get_batch then cuts each packed row into 2*cp parts as one sequence, but this model has "
            f"layers that expect every document cut into 2*cp parts on its own ({layers}; TransformerEngine's THD "
            "attention and Mamba cut per document under CP), so CP > 1 would train another model than CP=1 without "
            "an error. Drop --hybrid-context-parallel (the rows are then padded and cut per document), use a model "
            "of gated delta net and MLP layers only, or --context-parallel-size 1"
        )


def _check_padded_cut(args: Any, cp: int, why: str) -> None:
    """ValueError for the flags the padded per-document cut of ``--dataloader-inter-document-masking``
    rows cannot train CP=1's model with (``why``: what chose that cut)."""
    where = f"--dataloader-inter-document-masking at --context-parallel-size {cp} pads every document to a multiple " \
            f"of 2*cp and cuts it in 2*cp parts ({why})"
    if not getattr(args, "calculate_per_token_loss", False):
        raise ValueError(
            f"{where}, without --calculate-per-token-loss: the pad rows (loss mask 0) fall unevenly on the CP ranks "
            "and Megatron-LM then divides each CP rank's loss by that rank's own count of loss tokens, so the gradient "
            "would weight the ranks unequally and CP > 1 would train another model than CP=1. Add "
            "--calculate-per-token-loss (to the CP=1 run too: it averages over every token of the step)"
        )
    for flags, reason in padded_cut_refusals(args):
        raise ValueError(f"{where}, which cannot run with {flags}: {reason}. Drop {flags}, or use "
                         "--context-parallel-size 1")


def configure_megatron_lm_args(args: Any) -> Optional[str]:
    """The patched ``megatron.training.arguments.validate_args`` hook: refuses the flag combinations
    of :func:`check_megatron_lm_model`, then sets ``args.linear_cp_thd_split`` to the THD cut packed
    rows get (so every pipeline stage's GDN layers know it) and returns it:

    * ``--sft``: ``per_document`` (Megatron-LM's per-document cut); hybrid CP: ``whole_row``;
    * ``--dataloader-inter-document-masking`` without ``--sft``: ``whole_row`` (stock's cut), except at
      ``--context-parallel-size`` > 1 when the model has layers that expect the per-document cut
      (:func:`per_document_layers`) or ``--linear-cp-thd-split per_document`` asks for it: then
      ``per_document``, which tells the patched ``get_batch_on_this_cp_rank`` to pad every document
      to a multiple of 2*cp and cut it per document (:mod:`gdn_cp.megatron.document_padding`);
      that cut needs ``--calculate-per-token-loss``, refuses what it cannot train exactly (more than
      two pipeline stages or virtual stages, MoE router features that count every token: each with
      the reason, :func:`gdn_cp.megatron.padded_cut.padded_cut_refusals`) and, with pipeline
      parallelism, sets ``args.variable_seq_lengths`` (the padded rows change length);
    * with pipeline parallelism and micro-batches of more than one sample, ``args.variable_seq_lengths`` for any
      packed rows (:mod:`gdn_cp.megatron.packed_pipeline`: Megatron-LM packs the samples into one row).

    ValueError when ``--linear-cp-thd-split`` contradicts the cut (``whole_row`` for a model with
    attention layers at CP > 1 included). First of all, ``--linear-cp-mode`` and ``--linear-cp-backend``
    are checked against gdn-cp's registries, with the config's messages (the patched fields are plain
    strings: the patch names no mode and no backend, so argparse takes any).

    Args:
        args: Megatron-LM's parsed arguments (read with ``getattr``; ``linear_cp_thd_split`` and, where
            needed, ``variable_seq_lengths`` / ``moe_token_dispatcher_type`` are set on it). The release's
            cut per flags is read from the running release (:func:`gdn_cp.pins.running_release`, found now).

    Returns:
        Optional[str]: the THD cut packed rows get (``per_document`` / ``whole_row``), or None (no packed rows).
    """
    Settings(mode=getattr(args, "linear_cp_mode", "auto"), backend=getattr(args, "linear_cp_backend", "auto"))
    check_megatron_lm_model(args)
    given = check_thd_split_setting(getattr(args, THD_SPLIT_FIELD, None), "--linear-cp-thd-split")
    flags = {
        "sft": bool(getattr(args, "sft", False)),
        "inter_document_masking": bool(getattr(args, "dataloader_inter_document_masking", False)),
        "hybrid_context_parallel": bool(getattr(args, "hybrid_context_parallel", False)),
    }
    made = running_release().megatron_lm_thd_split(**flags)
    if made is None:
        return given
    configure_packed_pipeline(args)  # stages passing packed rows of several samples exchange their shapes
    cp = as_int(getattr(args, "context_parallel_size", 1)) or 1
    packed_pretraining = flags["inter_document_masking"] and not flags["sft"] and not flags["hybrid_context_parallel"]
    if packed_pretraining and cp > 1:
        layers = per_document_layers(args)
        if layers is not None and given == WHOLE_ROW:
            raise ValueError(
                f"--linear-cp-thd-split {WHOLE_ROW} with --dataloader-inter-document-masking at --context-parallel-size "
                f"{cp}: this model has layers that expect every document cut into 2*cp parts on its own ({layers}; "
                "TransformerEngine's THD attention and Mamba cut per document under CP), so the whole-row cut would "
                "train another model than CP=1 without an error; drop --linear-cp-thd-split (the rows are then padded "
                "and cut per document)"
            )
        if layers is not None or given == PER_DOCUMENT:
            made = PER_DOCUMENT
            _check_padded_cut(args, cp, f"the model's {layers}" if layers else "--linear-cp-thd-split per_document")
            enable_variable_seq_lengths(args)  # pipeline stages exchange the padded rows' changing shapes
    if given is not None and given != made:
        names = {"sft": "--sft", "inter_document_masking": "--dataloader-inter-document-masking",
                 "hybrid_context_parallel": "--hybrid-context-parallel"}
        on = " ".join(names[k] for k, v in flags.items() if v)
        raise ValueError(
            f"--linear-cp-thd-split {given} contradicts {on}: with these flags Megatron-LM's get_batch cuts packed "
            f"rows {made!r}{' (at --context-parallel-size 1 nothing is cut or padded)' if cp == 1 else ''}; drop "
            "--linear-cp-thd-split (it is set from them) or change the data flags"
        )
    setattr(args, THD_SPLIT_FIELD, made)
    return made
