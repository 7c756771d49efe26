"""Pipeline stages passing packed rows of several samples (:mod:`gdn_cp.megatron.packed_pipeline`), as the
patched ``validate_args`` hook decides it: Megatron-LM packs a micro-batch of ``--micro-batch-size`` samples into
one row under ``--sft`` / ``--dataloader-inter-document-masking``, so with two or more stages they must exchange
the activations' shapes (``variable_seq_lengths``), at every CP size; MoE's ``allgather`` dispatcher, which cannot,
is refused naming the flags and the fix. The same flags trained through megatron-core's pipeline schedule on gloo
ranks: tests/megatron/test_e2e_parallel.py (``test_packed_micro_batches_through_pipeline_stages_equal_pp1``)."""

from __future__ import annotations

import types

import pytest

from gdn_cp.layout import PER_DOCUMENT, WHOLE_ROW
from gdn_cp.megatron.packed_pipeline import packed_micro_batch_flags
from gdn_cp.megatron.thd_split import configure_megatron_lm_args


def _args(**kw):
    """Megatron-LM's args after its own validate_args: pretrain_hybrid.py, a ``G-*-`` model, two stages,
    --dataloader-inter-document-masking --calculate-per-token-loss at CP=1, micro-batch 2 (issue 46's run)."""
    base = dict(sft=False, eod_mask_loss=False, calculate_per_token_loss=True, dataloader_inter_document_masking=True,
                hybrid_context_parallel=False, linear_cp_thd_split=None, context_parallel_size=1, swiglu=True,
                hybrid_layer_pattern="G-*-", experimental_attention_variant=None, spec=None,
                pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=None, micro_batch_size=2,
                eval_micro_batch_size=2, variable_seq_lengths=False, num_experts=None,
                moe_token_dispatcher_type="allgather", mtp_num_layers=None, fp8=None, fp4=None, sequence_parallel=False,
                tensor_model_parallel_size=1)
    base.update(kw)
    return types.SimpleNamespace(**base)


@pytest.mark.parametrize("name,kw,split", [
    ("issue 46: PP=2 x CP=1, inter-document masking, micro-batch 2", {}, WHOLE_ROW),
    ("the same without per-token loss", dict(calculate_per_token_loss=False), WHOLE_ROW),
    ("a model without attention at CP=2 (the whole-row cut)", dict(context_parallel_size=2, hybrid_layer_pattern="G-G-"),
     WHOLE_ROW),
    ("--sft", dict(sft=True, dataloader_inter_document_masking=False), PER_DOCUMENT),
    ("evaluation micro-batch 2 only", dict(micro_batch_size=1), WHOLE_ROW),
    ("--sft on 4 stages", dict(sft=True, dataloader_inter_document_masking=False, pipeline_model_parallel_size=4),
     PER_DOCUMENT),
    ("MoE with the alltoall dispatcher", dict(num_experts=4, moe_token_dispatcher_type="alltoall",
                                              hybrid_layer_pattern="GE*-"), WHOLE_ROW),
])
def test_stages_exchange_shapes_of_packed_rows_of_several_samples(name, kw, split):
    args = _args(**kw)
    assert configure_megatron_lm_args(args) == split, name
    assert args.variable_seq_lengths is True, name
    # megatron-core refuses variable_seq_lengths with the allgather dispatcher even in a model without experts
    assert args.moe_token_dispatcher_type == "alltoall", name


@pytest.mark.parametrize("name,kw", [
    ("micro-batch 1", dict(micro_batch_size=1, eval_micro_batch_size=1)),
    ("one stage", dict(pipeline_model_parallel_size=1)),
    ("no packing flag (SBHD: the stages' fixed shape is right)", dict(dataloader_inter_document_masking=False)),
])
def test_fixed_shapes_where_they_are_right(name, kw):
    args = _args(**kw)
    configure_megatron_lm_args(args)
    assert args.variable_seq_lengths is False and args.moe_token_dispatcher_type == "allgather", name
    assert packed_micro_batch_flags(args) is None, name


def test_the_allgather_dispatcher_with_experts_is_refused_before_anything_is_built():
    args = _args(num_experts=4, hybrid_layer_pattern="GE*-")
    with pytest.raises(ValueError) as err:
        configure_megatron_lm_args(args)
    msg = str(err.value)
    for words in ("--pipeline-model-parallel-size 2", "--dataloader-inter-document-masking", "--micro-batch-size 2",
                  "--moe-token-dispatcher-type allgather", "use --moe-token-dispatcher-type alltoall",
                  "--micro-batch-size 1"):
        assert words in msg, (words, msg)
    assert args.variable_seq_lengths is False


def test_flags_phrase_names_what_was_given():
    assert packed_micro_batch_flags(_args(sft=True, micro_batch_size=1, eval_micro_batch_size=4)) == (
        "--pipeline-model-parallel-size 2 with --sft --dataloader-inter-document-masking and --eval-micro-batch-size 4")
