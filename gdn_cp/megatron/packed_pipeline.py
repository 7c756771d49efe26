"""Pipeline stages with packed micro-batches of more than one sample (Megatron-LM core_v0.19.x).

With ``--sft`` or ``--dataloader-inter-document-masking``, Megatron-LM's ``get_batch`` (``pretrain_gpt.py`` /
``pretrain_hybrid.py``) flattens a micro-batch of ``mbs`` samples into one packed row
(``megatron.core.utils.flatten_batch_for_packed_sequences``: tokens ``[1, mbs*S]``, one ``cu_seqlens``), so every
layer of the first stage gets hidden states ``[mbs*S/cp, 1, H]``: packed (THD) input has batch 1. The pipeline
schedule, unless ``config.variable_seq_lengths``, receives activations into buffers of the fixed shape
``[S/cp, mbs, H]`` (``schedules.get_tensor_shapes`` from ``args.seq_length`` and ``args.micro_batch_size``): the
same number of elements, so the transfer goes through, and the next stage gets the packed row folded into
``mbs`` columns beside ``PackedSeqParams(qkv_format='thd')``. Its first GatedDeltaNet then stops with "packed
(THD) input needs batch 1" (stock megatron-core asserts the same), minutes into the job. At CP > 1 the padded
per-document cut already made the stages exchange shapes (:mod:`gdn_cp.megatron.padded_cut`); at CP=1, and
on the whole-row cut at any CP, nothing did.

:func:`configure_packed_pipeline` (called by the patched ``validate_args`` through
:func:`gdn_cp.megatron.thd_split.configure_megatron_lm_args`) sets ``args.variable_seq_lengths`` for such runs,
so each transfer carries its real shape (one small extra message per transfer), and refuses, before anything
is built, the one combination that cannot exchange shapes: Megatron's ``allgather`` token dispatcher in a
model with experts. Reads ``args`` with ``getattr`` only; imports neither torch nor Megatron.
"""

from __future__ import annotations

import logging
from typing import Any

from ..checks import as_int
from .padded_cut import enable_variable_seq_lengths

__all__ = ["configure_packed_pipeline", "packed_micro_batch_flags"]

logger = logging.getLogger(__name__)


def _int(args: Any, name: str, default: int = 1) -> int:
    value = as_int(getattr(args, name, None))
    return default if value is None else value


def packed_micro_batch_flags(args: Any) -> str | None:
    """The flags of ``args`` under which pipeline stages pass packed rows of more than one sample (two or more
    stages, ``--sft`` or ``--dataloader-inter-document-masking``, a training or evaluation micro-batch of two or
    more samples), as a phrase; None otherwise."""
    pp = _int(args, "pipeline_model_parallel_size")
    data = [flag for flag, field in (("--sft", "sft"), ("--dataloader-inter-document-masking",
                                                        "dataloader_inter_document_masking")) if getattr(args, field, False)]
    sizes = [(flag, _int(args, field)) for flag, field in (("--micro-batch-size", "micro_batch_size"),
                                                           ("--eval-micro-batch-size", "eval_micro_batch_size"))]
    sizes = [f"{flag} {n}" for flag, n in sizes if n > 1]
    if pp <= 1 or not data or not sizes:
        return None
    return f"--pipeline-model-parallel-size {pp} with {' '.join(data)} and {', '.join(sizes)}"


def configure_packed_pipeline(args: Any) -> bool:
    """Set ``args.variable_seq_lengths`` where pipeline stages pass packed rows of more than one sample
    (:func:`packed_micro_batch_flags`; the module docstring says why); returns whether it did.

    ValueError, before anything is built, for a model with experts (``--num-experts``) on Megatron's
    ``allgather`` token dispatcher, which megatron-core refuses with variable sequence lengths."""
    flags = packed_micro_batch_flags(args)
    if flags is None:
        return False
    if getattr(args, "num_experts", None) is not None and getattr(args, "moe_token_dispatcher_type", None) == "allgather":
        raise ValueError(
            f"{flags} with --moe-token-dispatcher-type allgather: Megatron-LM's get_batch packs the samples of a "
            "micro-batch into one row, so the pipeline stages must exchange the activations' real shape "
            "(variable_seq_lengths), which megatron-core's allgather token dispatcher does not support; use "
            "--moe-token-dispatcher-type alltoall, or --micro-batch-size 1 (and --eval-micro-batch-size 1)"
        )
    enable_variable_seq_lengths(args)
    logger.info("%s: Megatron-LM packs each micro-batch into one row of micro-batch x seq-length tokens, so the "
                "pipeline stages exchange activation shapes (variable_seq_lengths=True)", flags)
    return True
