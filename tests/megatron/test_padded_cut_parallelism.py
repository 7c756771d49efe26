"""The padded per-document cut of ``--dataloader-inter-document-masking`` rows beside pipeline, expert,
multi-token prediction and FP8 / FP4 settings (:mod:`gdn_cp.megatron.padded_cut`), as the patched
``validate_args`` hook decides it: what it lifts (two pipeline stages with shape exchange, MoE without
router features that count every token, MTP, FP8 / FP4 with their token multiple) and what it refuses,
each naming the flags and the reason. Megatron-LM's own parser and ``validate_args`` on every row of the
training benchmark: tests/megatron/test_megatron_lm_launcher.py; the cut under a pipeline schedule and with
MTP's roll on gloo ranks: tests/megatron/test_e2e_parallel.py."""

from __future__ import annotations

import types

import pytest

from gdn_cp.layout import PER_DOCUMENT, WHOLE_ROW
from gdn_cp.megatron.document_padding import padded_cut_request
from gdn_cp.megatron.padded_cut import padded_rows_multiple, quantized_row_multiple
from gdn_cp.megatron.thd_split import configure_megatron_lm_args, per_document_layers

WHERE = ("--dataloader-inter-document-masking at --context-parallel-size 2 pads every document to a multiple of "
         "2*cp and cuts it in 2*cp parts (")


def _args(**kw):
    """Megatron-LM's args after its own validate_args, with --dataloader-inter-document-masking
    --calculate-per-token-loss at CP=2 on the hybrid pattern of the training benchmark's parallel rows."""
    base = dict(sft=False, eod_mask_loss=False, calculate_per_token_loss=True, dataloader_inter_document_masking=True,
                hybrid_context_parallel=False, linear_cp_thd_split=None, context_parallel_size=2, swiglu=True,
                squared_relu=False, quick_geglu=False, hybrid_layer_pattern="GEG*E-", experimental_attention_variant=None,
                linear_attention_freq=None, num_layers=6, spec=None, pipeline_model_parallel_size=1,
                virtual_pipeline_model_parallel_size=None, variable_seq_lengths=False, num_experts=None,
                moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None, moe_router_enable_expert_bias=False,
                moe_expert_capacity_factor=None, moe_router_load_balancing_type="aux_loss",
                moe_token_dispatcher_type="allgather", mtp_num_layers=None, fp8=None, fp8_recipe="delayed", fp4=None,
                fp4_recipe="nvfp4", sequence_parallel=False, tensor_model_parallel_size=1)
    base.update(kw)
    return types.SimpleNamespace(**base)


MOE = dict(num_experts=4, moe_token_dispatcher_type="alltoall")


@pytest.mark.parametrize("name,kw,shapes", [
    ("pipeline, 2 stages", dict(pipeline_model_parallel_size=2), True),
    ("MoE, default router (no aux loss)", MOE, False),
    ("MoE with the allgather dispatcher, no pipeline", dict(MOE, moe_token_dispatcher_type="allgather"), False),
    ("MoE and pipeline, alltoall dispatcher", dict(MOE, pipeline_model_parallel_size=2), True),
    ("MTP", dict(mtp_num_layers=1), False),
    ("FP8", dict(fp8="hybrid"), False),
    ("FP4", dict(fp4="e2m1"), False),
    ("everything", dict(MOE, pipeline_model_parallel_size=2, mtp_num_layers=1, fp8="hybrid"), True),
])
def test_lifted_combinations_get_the_padded_cut(name, kw, shapes):
    """Each combination the padded cut trains exactly gets it, and pipeline stages exchange shapes."""
    args = _args(**kw)
    assert configure_megatron_lm_args(args) == PER_DOCUMENT and args.linear_cp_thd_split == PER_DOCUMENT, name
    assert args.variable_seq_lengths is shapes, name
    # Megatron's TransformerConfig refuses variable_seq_lengths with the allgather dispatcher (its default) in any
    # model: a dense model (which dispatches nothing) gets alltoall with it; a MoE model keeps what it asked for
    asked = kw.get("moe_token_dispatcher_type", "allgather")
    assert args.moe_token_dispatcher_type == ("alltoall" if shapes and "num_experts" not in kw else asked), name


@pytest.mark.parametrize("kw,flags,reason", [
    (dict(pipeline_model_parallel_size=3), "--pipeline-model-parallel-size 3",
     "hands every stage but the first and the last"),
    (dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
     "--pipeline-model-parallel-size 2 with 2 virtual stages per rank", "(virtual stages included)"),
    (dict(MOE, moe_aux_loss_coeff=0.01), "--moe-aux-loss-coeff 0.01",
     "the load-balancing loss averages the routing over every token, pads included"),
    (dict(MOE, moe_aux_loss_coeff=[0.0, 1e-3], moe_router_load_balancing_type=["seq_aux_loss", "global_aux_loss"]),
     "--moe-aux-loss-coeff 0.0 0.001", "load-balancing loss"),
    (dict(MOE, moe_z_loss_coeff=1e-3), "--moe-z-loss-coeff 0.001", "the z-loss averages over every token"),
    (dict(MOE, moe_router_enable_expert_bias=True), "--moe-router-enable-expert-bias", "token counts that include"),
    (dict(MOE, moe_expert_capacity_factor=1.0), "--moe-expert-capacity-factor 1.0", "pads take expert capacity"),
    (dict(MOE, moe_router_load_balancing_type="sinkhorn"), "--moe-router-load-balancing-type sinkhorn",
     "sinkhorn routing normalizes over every token"),
    (dict(MOE, pipeline_model_parallel_size=2, moe_token_dispatcher_type="allgather"),
     "--moe-token-dispatcher-type allgather with --pipeline-model-parallel-size 2", "use --moe-token-dispatcher-type "
     "alltoall"),
])
def test_refused_combinations_name_the_flags_and_the_reason(kw, flags, reason):
    with pytest.raises(ValueError) as ei:
        configure_megatron_lm_args(_args(**kw))
    msg = str(ei.value)
    assert msg.startswith(WHERE) and f"which cannot run with {flags}: " in msg and reason in msg, msg
    assert f"Drop {flags}, or use --context-parallel-size 1" in msg, msg
    # the same flags with a model that keeps the whole-row cut (GDN and MoE layers only, no MTP): no padding, no
    # refusal; and at CP=1 nothing is cut
    assert configure_megatron_lm_args(_args(**{**kw, "hybrid_layer_pattern": "GEG-E-"})) == WHOLE_ROW
    assert configure_megatron_lm_args(_args(**{**kw, "context_parallel_size": 1})) == WHOLE_ROW


def test_mtp_gives_a_gdn_only_model_the_padded_cut():
    """Megatron's MTP rolls labels per document of the per-document cut under CP (roll_tensor with packed
    sequences): a model of GDN, MLP and MoE layers keeps the whole-row cut without MTP, and gets the padded
    per-document cut with it, so MTP's roll sees the layout it expects."""
    assert per_document_layers(_args(hybrid_layer_pattern="GEG-E-")) is None
    phrase = per_document_layers(_args(hybrid_layer_pattern="GEG-E-/G-", mtp_num_layers=1))
    assert phrase.startswith("--mtp-num-layers 1: multi-token prediction rolls labels inside each document"), phrase
    both = per_document_layers(_args(mtp_num_layers=1))
    assert both.startswith("--hybrid-layer-pattern 'GEG*E-': '*' attention; --mtp-num-layers 1"), both
    args = _args(hybrid_layer_pattern="GEG-E-/G-", mtp_num_layers=1)
    assert configure_megatron_lm_args(args) == PER_DOCUMENT
    with pytest.raises(ValueError, match=r"--linear-cp-thd-split whole_row with --dataloader-inter-document-masking .*"
                                         r"--mtp-num-layers 1"):
        configure_megatron_lm_args(_args(hybrid_layer_pattern="GEG-E-/G-", mtp_num_layers=1,
                                         linear_cp_thd_split=WHOLE_ROW))
    # hybrid CP cuts every sub-sample whole: refused with MTP as with attention layers
    with pytest.raises(ValueError, match=r"--hybrid-context-parallel at --context-parallel-size 2: .*--mtp-num-layers 1"):
        configure_megatron_lm_args(_args(hybrid_layer_pattern="GEG-E-/G-", mtp_num_layers=1, hybrid_context_parallel=True))


@pytest.mark.parametrize("kw,multiple", [
    (dict(), 1), (dict(fp8="hybrid"), 16), (dict(fp8="e4m3", fp8_recipe="tensorwise"), 16),
    (dict(fp8="hybrid", fp8_recipe="mxfp8"), 32), (dict(fp8="hybrid", fp8_recipe="blockwise"), 16),
    (dict(fp4="e2m1"), 32), (dict(sequence_parallel=True, tensor_model_parallel_size=2), 2),
    (dict(fp8="hybrid", sequence_parallel=True, tensor_model_parallel_size=2), 32),
    (dict(fp8="hybrid", sequence_parallel=False, tensor_model_parallel_size=2), 16),
])
def test_rows_per_rank_multiple_of_the_quantized_gemms(kw, multiple):
    """Megatron pads quantized GEMMs' token counts to get_fp8_align_size (16, mxfp8 32) / get_fp4_align_size (32):
    the padded cut gives every rank a multiple of it (times TP under sequence parallelism, whose ranks hold 1/TP of
    the rows each)."""
    args = _args(**kw)
    assert padded_rows_multiple(args) == multiple
    assert quantized_row_multiple(args) == multiple // (2 if kw.get("sequence_parallel") else 1)
    configure_megatron_lm_args(args)
    assert padded_cut_request(args) == multiple  # what get_batch_on_this_cp_rank's padding asks for


@pytest.mark.parametrize("cp,multiple", [(2, 16), (4, 16), (2, 32), (4, 32)])
def test_fp8_padded_rows_divide(cp, multiple):
    """pad_and_cut with the FP8 multiple: every rank's rows divide by it, every real token is on exactly one
    rank, and only the row's last document grows (its pads stay at its end; which rank holds which row of a
    padded document: tests/megatron/test_document_padding.py)."""
    import torch

    from gdn_cp.megatron.document_padding import pad_and_cut

    lengths = [17, 9, 22, 1, 31]
    cu = torch.tensor([[0, *torch.tensor(lengths).cumsum(0).tolist()]], dtype=torch.int32)
    t = int(cu[0, -1])
    seen = []
    for rank in range(cp):
        def cut(**kw):
            return pad_and_cut({"cu_seqlens": cu.clone(), "tokens": torch.arange(1, t + 1).view(1, t),
                                "max_seqlen": torch.tensor([31])}, cp, rank, **kw)

        plain, fp8 = cut(), cut(local_multiple=multiple)
        assert fp8["tokens"].shape[1] % multiple == 0 and plain["tokens"].shape[1] % multiple != 0, (cp, rank)
        seen += fp8["tokens"][fp8["tokens"] > 0].tolist()
        padded, before = fp8["cu_seqlens_padded"][0].tolist(), plain["cu_seqlens_padded"][0].tolist()
        assert padded[:-1] == before[:-1] and padded[-1] > before[-1] and padded[-1] % (cp * multiple) == 0
        assert int(fp8["max_seqlen"]) == max(b - a for a, b in zip(padded[:-1], padded[1:]))
    assert sorted(seen) == list(range(1, t + 1))
