"""How the patched GatedDeltaNet knows Megatron's THD cut (per document or whole row), and hybrid
CP's "no CP for this sub-sample" (``local_cp_size=1`` without a group).

The patched ``get_batch_on_this_cp_rank`` records its cut on the batch's ``cu_seqlens`` storage
(:mod:`gdn_cp.megatron.thd_split`); ``TransformerConfig.linear_cp_thd_split`` says it where no
record exists; the two never disagree silently. The end-to-end tests with Megatron's own splitter
and models are in ``test_e2e_models.py``; these test the layer and the rules alone.
"""

from __future__ import annotations

import types
from functools import partial

import pytest
import torch

from gdn_cp.layout import PER_DOCUMENT, WHOLE_ROW
from gdn_cp.megatron import thd_split
from gdn_cp.pins import load_adapter
from gdn_cp.megatron.thd_split import configure_megatron_lm_args, record_split, recorded_split, resolve_thd_split
from gdn_cp_testing.megatron.parity import MODES, parity_case
from gdn_cp.ops.accuracy import CP_VS_CP1_MAX_REL as TOL

FP64 = TOL[torch.float64]


# ----------------------------------------------------------------------------------------------
# the rules, no ranks
# ----------------------------------------------------------------------------------------------
def test_record_follows_views_and_dies_with_the_tensor():
    cu = torch.tensor([[0, 3, 8]], dtype=torch.int32)  # Megatron's batch keeps cu_seqlens as (1, N)
    record_split({"cu_seqlens": cu, "cu_seqlens_padded": None, "tokens": torch.zeros(1, 4)}, WHOLE_ROW)
    assert recorded_split(cu.squeeze(0)) == WHOLE_ROW  # what forward_step puts into PackedSeqParams
    assert recorded_split(cu[0, 1:]) == WHOLE_ROW
    assert recorded_split(cu.clone()) is None  # a copy is not what the splitter cut
    assert recorded_split([0, 3, 8]) is None
    n = len(thd_split._RECORDS)
    del cu
    assert len(thd_split._RECORDS) == n - 1  # no leak: the record dies with the boundaries


UNSET = ("TransformerConfig.linear_cp_thd_split is None and these packed (THD) rows carry no record of Megatron's "
         "get_batch_on_this_cp_rank")


def test_resolution_order_and_contradiction():
    cu = torch.tensor([0, 8, 16])
    resolve = partial(resolve_thd_split, cu_seqlens=cu, cp=2)
    with pytest.raises(ValueError) as ei:  # no record, no setting, no hybrid CP: never guessed
        resolve(None, hybrid_context_parallel=False)
    msg = str(ei.value)
    assert msg.startswith(UNSET) and "over the 2 CP ranks is unknown" in msg, msg
    for part in ("Set linear_cp_thd_split to 'per_document' if every document was cut into 2*cp parts on its own "
                 "(Megatron-LM --sft", "'whole_row' if each packed row was cut into 2*cp parts as one sequence "
                 "(Megatron-LM --dataloader-inter-document-masking without --sft",
                 "or cut the rows with megatron.core.utils.get_batch_on_this_cp_rank, which records its cut"):
        assert part in msg, (part, msg)
    assert resolve_thd_split(None, hybrid_context_parallel=False, cu_seqlens=cu, cp=1) == (
        PER_DOCUMENT, "linear_cp_thd_split=None at CP=1: nothing is cut")  # CP=1 cuts nothing: no cut needed
    split, why = resolve(None, hybrid_context_parallel=True)  # Megatron's hybrid-CP splitter cuts rows whole
    assert split == WHOLE_ROW and "hybrid_context_parallel=True" in why, why
    assert resolve(WHOLE_ROW, hybrid_context_parallel=False)[0] == WHOLE_ROW
    assert resolve(PER_DOCUMENT, hybrid_context_parallel=True)[0] == PER_DOCUMENT  # the setting comes first
    record_split({"cu_seqlens": cu}, WHOLE_ROW)
    split, why = resolve(None, hybrid_context_parallel=False)
    assert split == WHOLE_ROW and "get_batch_on_this_cp_rank" in why
    assert resolve(WHOLE_ROW, hybrid_context_parallel=False)[0] == WHOLE_ROW
    with pytest.raises(ValueError, match=r"linear_cp_thd_split='per_document', but Megatron's get_batch_on_this_cp_rank "
                                         r"cut these rows 'whole_row'"):
        resolve(PER_DOCUMENT, hybrid_context_parallel=False)


@pytest.mark.parametrize("sft,idm,hcp,want", [
    (False, False, False, None), (True, False, False, PER_DOCUMENT), (False, True, False, WHOLE_ROW),
    (True, True, False, PER_DOCUMENT), (False, False, True, WHOLE_ROW), (True, False, True, WHOLE_ROW),
])
def test_megatron_lm_flags_decide_the_split(sft, idm, hcp, want):
    """pretrain_gpt.py (core_v0.19.x): use_per_sequence_balancing = inter-document masking and not
    sft; hybrid CP cuts each sub-sample whole; --sft alone cuts per document."""
    assert load_adapter().megatron_lm_thd_split(sft=sft, inter_document_masking=idm, hybrid_context_parallel=hcp) == want
    args = types.SimpleNamespace(sft=sft, dataloader_inter_document_masking=idm, hybrid_context_parallel=hcp,
                                 linear_cp_thd_split=None)
    assert configure_megatron_lm_args(args) == want and args.linear_cp_thd_split == want
    if want is not None:  # the same value given explicitly is fine; the other one is refused
        args.linear_cp_thd_split = want
        assert configure_megatron_lm_args(args) == want
        args.linear_cp_thd_split = WHOLE_ROW if want == PER_DOCUMENT else PER_DOCUMENT
        with pytest.raises(ValueError, match="--linear-cp-thd-split .* contradicts"):
            configure_megatron_lm_args(args)
    else:  # no packed rows from Megatron-LM's get_batch: an explicit value is the user's own
        args.linear_cp_thd_split = WHOLE_ROW
        assert configure_megatron_lm_args(args) == WHOLE_ROW


def _lm_args(**kw):
    """Megatron-LM's args as the patched validate_args hands them over (the fields the hook reads)."""
    base = dict(sft=False, eod_mask_loss=False, calculate_per_token_loss=False,
                dataloader_inter_document_masking=False, hybrid_context_parallel=False,
                linear_cp_thd_split=None, context_parallel_size=1, swiglu=True, squared_relu=False, quick_geglu=False,
                hybrid_layer_pattern=None, experimental_attention_variant=None, linear_attention_freq=None,
                num_layers=4, spec=None)
    base.update(kw)
    return types.SimpleNamespace(**base)


@pytest.mark.parametrize("kw,act", [
    (dict(hybrid_layer_pattern="G-G-*-"), "gelu"),
    (dict(hybrid_layer_pattern="*-|G-/G-", squared_relu=True), "squared_relu"),
    (dict(experimental_attention_variant="gated_delta_net", linear_attention_freq=4), "gelu"),
    (dict(experimental_attention_variant="gated_delta_net", linear_attention_freq=4, quick_geglu=True), "quick_gelu"),
])
def test_megatron_lm_refuses_gdn_without_swiglu(kw, act):
    """GDN computes SiLU; without --swiglu Megatron-LM gives the model another activation_func."""
    with pytest.raises(ValueError) as ei:
        configure_megatron_lm_args(_lm_args(swiglu=False, **kw))
    msg = str(ei.value)
    gdn = (f"--hybrid-layer-pattern {kw['hybrid_layer_pattern']!r} has gated delta net layers ('G')"
           if "hybrid_layer_pattern" in kw else "--experimental-attention-variant gated_delta_net builds gated delta net layers")
    assert msg.startswith(gdn + ", which compute SiLU"), msg
    assert f"without --swiglu Megatron-LM gives the model activation_func={act}; add --swiglu" in msg, msg
    assert configure_megatron_lm_args(_lm_args(swiglu=True, **{k: v for k, v in kw.items() if k == "hybrid_layer_pattern"
                                                                or "linear" in k or "variant" in k})) is None
    # no GDN layer: gdn-cp has nothing to say about the activation
    assert configure_megatron_lm_args(_lm_args(swiglu=False, hybrid_layer_pattern="*-M-")) is None
    assert configure_megatron_lm_args(_lm_args(swiglu=False)) is None


@pytest.mark.parametrize("kw,layers", [
    (dict(hybrid_layer_pattern="G-G-*-"), "--hybrid-layer-pattern 'G-G-*-': '*' attention"),
    (dict(hybrid_layer_pattern="*-*-"), "'*' attention"),
    (dict(hybrid_layer_pattern="G-G-/*-"), "'*' attention"),  # an MTP layer of attention
    (dict(hybrid_layer_pattern="GDG+"), "'D' DSA attention, '+' MLA attention"),
    (dict(hybrid_layer_pattern="G-M-"), "'M' Mamba"),
    (dict(), "pretrain_gpt.py without --experimental-attention-variant gated_delta_net: every layer is attention"),
    (dict(experimental_attention_variant="dsa"), "every layer is DSA attention"),
    (dict(experimental_attention_variant="gated_delta_net", linear_attention_freq=4),
     "--experimental-attention-variant gated_delta_net with --linear-attention-freq 4: standard attention at layer 4"),
    (dict(experimental_attention_variant="gated_delta_net", linear_attention_freq=2, num_layers=6),
     "standard attention at layers 2, 4, 6"),
    (dict(experimental_attention_variant="gated_delta_net", linear_attention_freq=[1, 0, 1, 1]),
     "standard attention at layer 2"),
    (dict(experimental_attention_variant="gated_delta_net"), "--linear-attention-freq None: which layers are attention"),
    (dict(experimental_attention_variant="gated_delta_net", linear_attention_freq=8, spec=["my.module", "my_spec"]),
     "--spec my.module my_spec (a custom layer spec: its layers are not known here)"),
])
def test_attention_layers_get_the_padded_per_document_cut(kw, layers):
    """--dataloader-inter-document-masking without --sft: stock Megatron-LM cuts whole rows, which
    attention (and Mamba) under CP do not take; with the patch such rows are padded and cut per
    document at CP > 1 (per_document), which needs --calculate-per-token-loss (the pads fall unevenly
    on the ranks) and refuses what it cannot train exactly, each naming the flag and the reason."""
    idm = dict(dataloader_inter_document_masking=True, context_parallel_size=2, **kw)
    args = _lm_args(calculate_per_token_loss=True, **idm)
    assert configure_megatron_lm_args(args) == PER_DOCUMENT and args.linear_cp_thd_split == PER_DOCUMENT
    assert configure_megatron_lm_args(_lm_args(calculate_per_token_loss=True, linear_cp_thd_split=PER_DOCUMENT,
                                               **idm)) == PER_DOCUMENT
    where = ("--dataloader-inter-document-masking at --context-parallel-size 2 pads every document to a multiple of "
             "2*cp and cuts it in 2*cp parts (the model's ")
    with pytest.raises(ValueError) as ei:
        configure_megatron_lm_args(_lm_args(**idm))
    msg = str(ei.value)
    assert msg.startswith(where) and layers in msg.split("(the model's ", 1)[1].split("), without")[0], msg
    assert "without --calculate-per-token-loss: the pad rows (loss mask 0) fall unevenly" in msg, msg
    with pytest.raises(ValueError, match=r"--linear-cp-thd-split whole_row with --dataloader-inter-document-masking "
                                         r"at --context-parallel-size 2: this model has layers that expect"):
        configure_megatron_lm_args(_lm_args(calculate_per_token_loss=True, linear_cp_thd_split=WHOLE_ROW, **idm))
    # with pipeline, expert, MTP and FP8 settings: tests/megatron/test_padded_cut_parallelism.py
    # hybrid CP cuts sub-samples whole: still refused with these layers
    with pytest.raises(ValueError) as ei:
        configure_megatron_lm_args(_lm_args(calculate_per_token_loss=True, hybrid_context_parallel=True, **idm))
    assert str(ei.value).startswith("--dataloader-inter-document-masking with --hybrid-context-parallel at "
                                    "--context-parallel-size 2: "), str(ei.value)
    # --sft cuts per document as before; CP=1 cuts nothing (whole_row: the row stays as it is)
    assert configure_megatron_lm_args(_lm_args(dataloader_inter_document_masking=True, sft=True,
                                               calculate_per_token_loss=True, context_parallel_size=2,
                                               **kw)) == PER_DOCUMENT
    assert configure_megatron_lm_args(_lm_args(dataloader_inter_document_masking=True, **kw)) == WHOLE_ROW


@pytest.mark.parametrize("kw", [
    dict(hybrid_layer_pattern="G-G-"), dict(hybrid_layer_pattern="GEG-|G-"),
    dict(experimental_attention_variant="gated_delta_net", linear_attention_freq=8),  # 8 > --num-layers 4
    dict(experimental_attention_variant="gated_delta_net", linear_attention_freq=[1, 1, 1, 1]),
])
def test_gdn_only_models_keep_the_whole_row_cut(kw):
    """GDN, MLP and MoE layers run the whole-row cut exactly: no padding, unless asked for with
    --linear-cp-thd-split per_document (then the padded cut, with its rules). With MTP layers (which
    expect the per-document cut) such a model gets the padded cut:
    tests/megatron/test_padded_cut_parallelism.py."""
    for cp in (2, 4):
        args = _lm_args(dataloader_inter_document_masking=True, context_parallel_size=cp, **kw)
        assert configure_megatron_lm_args(args) == WHOLE_ROW and args.linear_cp_thd_split == WHOLE_ROW
        asked = dict(dataloader_inter_document_masking=True, context_parallel_size=cp, linear_cp_thd_split=PER_DOCUMENT,
                     **kw)
        assert configure_megatron_lm_args(_lm_args(calculate_per_token_loss=True, **asked)) == PER_DOCUMENT
        with pytest.raises(ValueError, match=r"\(--linear-cp-thd-split per_document\), without "
                                             r"--calculate-per-token-loss"):
            configure_megatron_lm_args(_lm_args(**asked))


def test_config_refuses_an_unknown_split(patched_megatron):
    from gdn_cp_testing.megatron.layer import make_config

    assert make_config(2, "chunkwise", linear_cp_thd_split=WHOLE_ROW).linear_cp_thd_split == WHOLE_ROW
    assert make_config(2, "chunkwise").linear_cp_thd_split is None
    with pytest.raises(ValueError, match="TransformerConfig.linear_cp_thd_split='rows' is not a THD split"):
        make_config(2, "chunkwise", linear_cp_thd_split="rows")


# ----------------------------------------------------------------------------------------------
# the layer on gloo ranks
# ----------------------------------------------------------------------------------------------
def _whole_row_cases(ctx):
    """The whole-row case told by the config field, by a record of the splitter (no field), not
    told at all (a ValueError naming the field), and told per document (odd documents: a ValueError
    naming the field and the whole-row fix)."""
    from gdn_cp.megatron.thd_split import record_split as record

    import gdn_cp_testing.megatron.parity as mp

    out = {"config": parity_case(ctx.rank, ctx.world_size, "thd_whole_row", torch.float64, MODES,
                                 cfg=dict(linear_cp_thd_split=WHOLE_ROW))}
    saved = mp.thd_params

    def recorded_params(cu_pad, cu_act, **kw):
        psp = saved(cu_pad, cu_act, **kw)
        record({"cu_seqlens_padded": psp.cu_seqlens_q_padded.unsqueeze(0)}, WHOLE_ROW)  # a view: same storage
        return psp

    mp.thd_params = recorded_params
    try:
        out["record"] = parity_case(ctx.rank, ctx.world_size, "thd_whole_row", torch.float64, MODES)
    finally:
        mp.thd_params = saved
    for name, cfg in (("untold", None), ("per_document", dict(linear_cp_thd_split=PER_DOCUMENT))):
        try:
            parity_case(ctx.rank, ctx.world_size, "thd_whole_row", torch.float64, ("chunkwise",), cfg=cfg)
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    return out


@pytest.mark.megatron
def test_whole_row_thd_equals_cp1(patched_megatron, rank_pool):
    """At CP=2 (CP=4, through Megatron's own splitter and models: test_e2e_models.py)."""
    for rank, res in enumerate(rank_pool(2).run(_whole_row_cases)):
        for how in ("config", "record"):
            for mode, errs in res[how].items():
                over = {k: v for k, v in errs.items() if not v <= FP64}
                assert not over, (rank, how, mode, over)
        assert UNSET in res["untold"], res["untold"]
        msg = res["per_document"]
        assert "linear_cp_thd_split='whole_row'" in msg and "not divisible by 2*cp" in msg, msg
        assert "per_document split: TransformerConfig.linear_cp_thd_split='per_document'" in msg, msg


def _unset_split_cases(ctx):
    """THD rows cut per document at CP=world, every mode, ``linear_cp_thd_split`` unset and no
    record: each rank's error and the collectives run before it."""
    from gdn_cp_testing.megatron.layer import build_gdn, make_config, rank_groups, thd_params
    from gdn_cp_testing.packings import thd_case

    cu_pad, cu_act = thd_case(ctx.world_size)
    out = {}
    for mode in MODES:
        module = build_gdn(make_config(ctx.world_size, mode, torch.float64), rank_groups()["world"])
        x = torch.zeros(cu_pad[-1] // ctx.world_size, 1, module.config.hidden_size, dtype=torch.float64)
        before = ctx.collective_count()
        try:
            module(x, None, packed_seq_params=thd_params(cu_pad, cu_act))
            out[mode] = ("no error", ctx.collective_count() - before)
        except ValueError as e:
            out[mode] = (str(e), ctx.collective_count() - before)
    return out


@pytest.mark.megatron
def test_unset_split_is_refused_on_every_rank_before_any_collective(patched_megatron, rank_pool):
    for world in (2, 4):
        for rank, res in enumerate(rank_pool(world).run(_unset_split_cases, timeout_s=120)):
            assert set(res) == set(MODES)
            for mode, (msg, collectives) in res.items():
                assert msg.startswith(UNSET) and f"over the {world} CP ranks is unknown" in msg, (world, rank, mode, msg)
                assert collectives == 0, (world, rank, mode, collectives)


def _hybrid_cp_no_group(ctx):
    """Hybrid CP's sub-sample on one rank: PackedSeqParams(local_cp_size=1, cp_group=None) inside a
    static CP group of the whole world: the no-CP path (each rank its own full sub-sample)."""
    import torch.distributed as dist

    from gdn_cp_testing.megatron.layer import build_gdn, make_config, rank_groups, run_layer, thd_params
    from gdn_cp.ops.accuracy import max_rel
    from gdn_cp_testing.inputs import hidden_inputs

    groups = rank_groups()
    cu = [0, 5, 5, 12]  # odd lengths: nothing is cut
    x, dout = hidden_inputs(12, 1, torch.float64, 300 + ctx.rank, 32, "cpu")
    base = build_gdn(make_config(1, "headwise", torch.float64), groups["self"])
    want = run_layer(base, x, dout, thd_params(cu))
    out = {}
    for mode in MODES:
        module = build_gdn(make_config(ctx.world_size, mode, torch.float64), groups["world"])
        got = run_layer(module, x, dout, thd_params(cu, local_cp_size=1))
        out[mode] = max([max_rel(got[0], want[0]), max_rel(got[1], want[1])]
                        + [max_rel(got[2][n], want[2][n]) for n in want[2]])
    dist.barrier()
    return out


@pytest.mark.megatron
def test_hybrid_cp_local_cp_size_one_without_group_is_no_cp(patched_megatron, rank_pool):
    for res in rank_pool(2).run(_hybrid_cp_no_group):
        assert all(v <= FP64 for v in res.values()), res


def _megatron_splitter_records(ctx):
    """megatron.core.utils.get_batch_on_this_cp_rank (patched) records the cut of the branch it
    took, on the tensors forward_step turns into PackedSeqParams (squeeze(0) views)."""
    import torch.distributed as dist
    from megatron.core.utils import get_batch_on_this_cp_rank

    import megatron.core.utils as mutils

    out = {}
    missing = object()
    saved = getattr(mutils, "tex", missing)
    # the per-document branch calls TransformerEngine's index split: any rows will do here
    mutils.tex = types.SimpleNamespace(thd_get_partitioned_indices=lambda cu, t, ws, r: torch.arange(t // ws))
    try:
        for use_per_sequence, cu in ((True, [0, 3, 16]), (False, [0, 4, 16])):
            batch = {"tokens": torch.arange(16).reshape(1, 16), "cu_seqlens": torch.tensor([cu], dtype=torch.int32),
                     "cu_seqlens_padded": None, "max_seqlen": None, "local_cp_size": None}
            batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=dist.group.WORLD,
                                              use_per_sequence_balancing=use_per_sequence)
            out[use_per_sequence] = (recorded_split(batch["cu_seqlens"].squeeze(0)), batch["tokens"].shape[1])
    finally:
        if saved is missing:
            del mutils.tex
        else:
            mutils.tex = saved
    return out


@pytest.mark.megatron
def test_megatron_splitter_records_its_split(patched_megatron, rank_pool):
    for res in rank_pool(2).run(_megatron_splitter_records):
        assert res[True] == (WHOLE_ROW, 8) and res[False] == (PER_DOCUMENT, 8), res


@pytest.mark.parametrize("flags", [dict(sft=True), dict(eod_mask_loss=True), dict(sft=True, eod_mask_loss=True)])
def test_megatron_lm_refuses_per_rank_loss_averaging_with_uneven_masks(flags):
    """Seen on one H200 (Megatron-LM core_v0.19.0, TE 2.20.2): ``--sft`` at CP=2/4 without
    --calculate-per-token-loss printed CP=1's loss (within 1.5e-4) with a grad norm 10-14% off, and stock
    megatron-core the same: each CP rank divides its loss by its own token count."""
    named = " ".join(f for f, k in (("--sft", "sft"), ("--eod-mask-loss", "eod_mask_loss")) if flags.get(k))
    for model in (dict(hybrid_layer_pattern="G-G-*-"), dict(experimental_attention_variant="gated_delta_net",
                                                            linear_attention_freq=4)):
        with pytest.raises(ValueError) as ei:
            configure_megatron_lm_args(_lm_args(context_parallel_size=2, **model, **flags))
        msg = str(ei.value)
        assert msg.startswith(f"{named} at --context-parallel-size 2 without --calculate-per-token-loss:"), msg
        assert "Add --calculate-per-token-loss (to the CP=1 run too" in msg, msg
        configure_megatron_lm_args(_lm_args(context_parallel_size=2, calculate_per_token_loss=True, **model, **flags))
        configure_megatron_lm_args(_lm_args(context_parallel_size=1, **model, **flags))  # CP=1: one rank, one count
    # a model without GDN layers: not gdn-cp's to refuse
    configure_megatron_lm_args(_lm_args(context_parallel_size=2, hybrid_layer_pattern="*-*-", **flags))
