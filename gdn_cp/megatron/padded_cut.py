"""What the padded per-document cut of ``--dataloader-inter-document-masking`` rows needs from the other
parallelisms and precisions of a Megatron-LM run (pipeline, experts, multi-token prediction, FP8 / FP4).

The cut itself (every document padded at its end to a multiple of 2*cp, then cut in 2*cp parts) is
:mod:`gdn_cp.megatron.document_padding`; :func:`gdn_cp.megatron.thd_split.configure_megatron_lm_args`
(the patched ``validate_args``) decides when it applies and calls this module for the rest, on Megatron-LM's
``args``, before anything is built:

* **pipeline parallelism**: the padded row's length changes from micro-batch to micro-batch, so the stages
  must exchange activation shapes with every transfer: :func:`enable_variable_seq_lengths` sets Megatron's
  own ``variable_seq_lengths`` (``validate_args`` sets it False before the hook). With two stages both
  stages call ``get_batch_on_this_cp_rank`` on the same rows and make the same cut. More stages (or
  virtual stages) are refused: Megatron-LM core_v0.19.0's ``get_batch`` hands a middle stage the
  documents' boundaries before any cut (``pretrain_gpt.py`` / ``pretrain_hybrid.py``: it returns right
  after ``flatten_batch_for_packed_sequences``), so its layers would see boundaries without the pads that
  the activations it receives carry (and without ``--sft`` those scripts build no dataset on a middle
  stage at all, while ``get_batch`` reads one there);
* **MoE**: each token is routed on its own, so pad rows change nothing for the real rows, except through the
  router features that look at every token of the micro-batch: load-balancing losses, the z-loss, the
  expert bias, capacity (token dropping) and sinkhorn routing count the pads (Megatron's router takes a
  ``padding_mask`` for that, but Megatron-LM's ``forward_step`` passes none). Those are refused with the
  padded cut (:func:`pad_sensitive_router_flags`); with pipeline parallelism the ``allgather`` token
  dispatcher is refused too (Megatron refuses it with variable sequence lengths);
* **multi-token prediction**: Megatron's MTP rolls labels and loss mask one token left inside each
  document of ``PackedSeqParams.cu_seqlens_q`` and, under CP, expects every document cut per document
  (``roll_tensor`` with packed sequences). With the padded boundaries a document's last real token gets
  its pad's label with loss mask 0, as it gets a masked zero at CP=1: the same targets. So MTP needs the
  per-document cut (:func:`mtp_needs_per_document`): a model whose layers alone would keep the whole-row
  cut gets the padded one when it has MTP layers;
* **FP8 / FP4**: Megatron pads token counts of quantized GEMMs to ``get_fp8_align_size`` (16; 32 for
  ``mxfp8``) and ``get_fp4_align_size`` (32); the padded cut makes each rank's rows a multiple of it
  (:func:`quantized_row_multiple`, times the TP size under sequence parallelism:
  :func:`padded_rows_multiple`), by padding the row's last document further.

Reads ``args`` with ``getattr`` only, and the release's numbers from its adapter (:mod:`gdn_cp.pins`);
imports neither torch nor Megatron.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from ..checks import as_int
from ..pins import running_release


__all__ = [
    "enable_variable_seq_lengths",
    "mtp_needs_per_document",
    "pad_sensitive_router_flags",
    "padded_cut_refusals",
    "padded_rows_multiple",
    "quantized_row_multiple",
]


def _int(args: Any, name: str, default: int = 1) -> int:
    value = as_int(getattr(args, name, None))
    return default if value is None else value


def quantized_row_multiple(args: Any) -> int:
    """How many rows a rank's token count must be a multiple of for ``args``' FP8 / FP4 GEMMs (1 without
    ``--fp8-format`` / ``--fp4-format``)."""
    rows = running_release().QUANTIZED_ROW_MULTIPLE
    multiple = 1
    if getattr(args, "fp8", None):
        multiple = rows["mxfp8"] if getattr(args, "fp8_recipe", None) == "mxfp8" else rows["fp8"]
    if getattr(args, "fp4", None):
        multiple = math.lcm(multiple, rows["fp4"])
    return multiple


def padded_rows_multiple(args: Any) -> int:
    """What each CP rank's part of a padded row must be a multiple of: :func:`quantized_row_multiple`, times
    the TP size under sequence parallelism (each TP rank then holds 1/TP of the rank's rows)."""
    tp = _int(args, "tensor_model_parallel_size") if getattr(args, "sequence_parallel", False) else 1
    return max(tp, 1) * quantized_row_multiple(args)


def _coeffs(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def pad_sensitive_router_flags(args: Any) -> list[tuple[str, str]]:
    """``[(flag, why)]``: the MoE router features of ``args`` that look at every token of a micro-batch, so
    would count pad rows (none without ``--num-experts``)."""
    if getattr(args, "num_experts", None) is None:
        return []
    found = []
    aux = _coeffs(getattr(args, "moe_aux_loss_coeff", None))
    if any(float(c) > 0 for c in aux):
        found.append((f"--moe-aux-loss-coeff {' '.join(map(str, aux))}",
                      "the load-balancing loss averages the routing over every token, pads included"))
    z = getattr(args, "moe_z_loss_coeff", None)
    if z is not None and float(z) > 0:
        found.append((f"--moe-z-loss-coeff {z}", "the z-loss averages over every token, pads included"))
    if getattr(args, "moe_router_enable_expert_bias", False):
        found.append(("--moe-router-enable-expert-bias", "the expert bias is updated from token counts that "
                      "include the pads"))
    if getattr(args, "moe_expert_capacity_factor", None) is not None:
        found.append((f"--moe-expert-capacity-factor {args.moe_expert_capacity_factor}",
                      "pads take expert capacity, so other real tokens are dropped than at CP=1"))
    kinds = _coeffs(getattr(args, "moe_router_load_balancing_type", None))
    for kind in ("sinkhorn", "quantile_balancing"):
        if kind in kinds:
            found.append((f"--moe-router-load-balancing-type {kind}", f"{kind} routing normalizes over every "
                          "token of the micro-batch, pads included"))
    return found


def mtp_needs_per_document(args: Any) -> Optional[str]:
    """A phrase naming ``--mtp-num-layers`` when ``args`` has multi-token prediction layers (they expect
    every packed document cut per document under CP), else None."""
    n = as_int(getattr(args, "mtp_num_layers", None))
    if not n:
        return None
    return (f"--mtp-num-layers {n}: multi-token prediction rolls labels inside each document and, under CP, "
            "expects every document cut per document")


def padded_cut_refusals(args: Any) -> list[tuple[str, str]]:
    """``[(flags, reason)]``: what in ``args`` the padded per-document cut cannot train CP=1's model with
    (the module docstring); empty when it can."""
    out = []
    pp = _int(args, "pipeline_model_parallel_size")
    vpp = as_int(getattr(args, "virtual_pipeline_model_parallel_size", None))
    if pp > 2 or (pp > 1 and vpp is not None and vpp > 1):
        flags = f"--pipeline-model-parallel-size {pp}" + (f" with {vpp} virtual stages per rank" if vpp and vpp > 1 else "")
        out.append((flags, "Megatron-LM's get_batch hands every stage but the first and the last (virtual stages "
                    "included) the documents' boundaries before any cut, so those stages would not see the pads "
                    "their activations carry (and pretrain_gpt.py / pretrain_hybrid.py build no dataset there "
                    "without --sft); pipeline parallelism of 2 stages without virtual stages works"))
    router = pad_sensitive_router_flags(args)
    if router:
        out.append((", ".join(f for f, _ in router),
                    "Megatron's MoE router would count the pad rows (" + "; ".join(w for _, w in router) +
                    "), and Megatron-LM's forward_step passes it no padding mask; without these router features "
                    "each token is routed on its own and the pads change nothing for the real tokens"))
    dispatcher = getattr(args, "moe_token_dispatcher_type", None)
    if pp > 1 and getattr(args, "num_experts", None) is not None and dispatcher == "allgather":
        out.append(("--moe-token-dispatcher-type allgather with --pipeline-model-parallel-size "
                    f"{pp}", "the padded rows change length from micro-batch to micro-batch, so the stages exchange "
                    "shapes (variable_seq_lengths), which Megatron's allgather dispatcher does not support; use "
                    "--moe-token-dispatcher-type alltoall"))
    return out


def enable_variable_seq_lengths(args: Any) -> bool:
    """Set Megatron's ``args.variable_seq_lengths`` when ``args`` has pipeline stages (the padded rows change
    length between micro-batches, so the stages must exchange shapes); returns whether it did.

    megatron-core 0.19's ``TransformerConfig`` refuses ``variable_seq_lengths`` with the ``allgather`` token
    dispatcher, its default, in every model, MoE or not: a model without experts (no ``--num-experts``), which
    dispatches nothing, gets ``args.moe_token_dispatcher_type = "alltoall"`` with it (a model with experts and
    ``allgather`` is refused before: :func:`padded_cut_refusals`)."""
    if _int(args, "pipeline_model_parallel_size") <= 1:
        return False
    args.variable_seq_lengths = True
    if (running_release().ALLGATHER_REFUSES_VARIABLE_SEQ_LENGTHS and getattr(args, "num_experts", None) is None
            and getattr(args, "moe_token_dispatcher_type", None) == "allgather"):
        args.moe_token_dispatcher_type = "alltoall"
    return True
