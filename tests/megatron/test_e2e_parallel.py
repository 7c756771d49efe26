"""CP beside pipeline parallelism and multi-token prediction, end to end on 4 gloo CPU ranks (fp64, the
session's pool), with every point-to-point transfer staged through the host as on ranks that share one GPU
(:mod:`gdn_cp_testing.megatron.host_p2p` with ``stage_all=True``):

* the host-staged ``isend`` / ``irecv`` / ``send`` / ``recv`` / ``batch_isend_irecv`` deliver what the
  originals deliver, in Megatron's patterns (a ring of ``P2POp`` into a leaf that requires grad, as the
  pipeline receives activations; pairs in even / odd order);
* **pipeline parallelism**: three optimizer steps of megatron-core's own pipeline schedule (1F1B through
  ``get_forward_backward_func``, its P2P communicator, DDP, ``finalize_model_grads``, its optimizer) at
  PP=2 x CP=2 in every mode and PP=2 x CP=1 equal PP=1 x CP=1's loss, gradient norm and final parameters:
  the hybrid ``G-*-`` model (GDN + MLP on stage 0, the re-derived TE THD attention + MLP on stage 1) on
  ``--dataloader-inter-document-masking`` rows padded and cut per document (each stage cuts its own part
  of the batch, as Megatron-LM's ``get_batch`` does: tokens on the first stage, labels on the last; the
  padded rows change length from micro-batch to micro-batch, so the stages exchange shapes:
  ``variable_seq_lengths``), and the GDN-only GPT model on the whole-row cut;
* **experts**: a hybrid ``GE*-`` model (Megatron's MoE of local experts, router top-2, alltoall dispatcher) at
  EP=2 x CP=2 / 4 and PP=2 x EP=2 x CP=2 on padded rows equals EP=1 x CP=1; with a router load-balancing loss
  it does not on padded rows (the pads are counted: what gdn-cp refuses) and does on rows that need no pads;
* **MTP's roll** (``multi_token_prediction.roll_tensor``, Megatron's own, with packed sequences): on the
  padded per-document cut at CP=2 and CP=4 every real row gets the label and loss mask it gets at CP=1
  and every pad row loss mask 0, and on stock's whole-row cut it does not (why a model with MTP layers gets
  the padded cut: :func:`gdn_cp.megatron.padded_cut.mtp_needs_per_document`).
"""

from __future__ import annotations

import contextlib
from functools import partial

import pytest
import torch

from gdn_cp.ops.accuracy import CP_VS_CP1_MAX_REL

pytestmark = pytest.mark.megatron

WORLD = 4
TOL = CP_VS_CP1_MAX_REL[torch.float64]
SEED = 5
S = 48
STEPS = 3
MICRO_BATCHES = 2
HEADS = dict(linear_num_key_heads=2, linear_num_value_heads=6)


# ------------------------------------------------------------------------------------------
# host-staged point-to-point
# ------------------------------------------------------------------------------------------
def _p2p_cases(ctx) -> dict:
    import torch.distributed as dist

    from gdn_cp_testing.megatron import host_p2p

    rank, world = ctx.rank, ctx.world_size
    out = {}
    for staged in (False, True):
        uninstall = host_p2p.install(stage_all=True) if staged else (lambda: None)
        try:
            send = torch.arange(5, dtype=torch.float64) + 10 * rank
            # as Megatron's pipeline receives activations: into a leaf tensor that requires grad
            recv = torch.full((5,), -1.0, dtype=torch.float64, requires_grad=True)
            ops = [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
            for req in dist.batch_isend_irecv(ops):
                req.wait()
            ring = recv.detach().tolist()
            pair = torch.zeros(3, dtype=torch.int64)
            if rank % 2 == 0:
                dist.isend(torch.tensor([rank, 7, 8]), dst=rank + 1).wait()
                req = dist.irecv(pair, src=rank + 1)
            else:
                req = dist.irecv(pair, src=rank - 1)
                req.wait()
                dist.send(pair * 2, dst=rank - 1)
            if rank % 2 == 0:
                req.wait()
            out[staged] = {"ring": ring, "pair": pair.tolist(), "replaced": dist.isend is host_p2p._REPLACEMENTS["isend"]}
        finally:
            uninstall()
    out["restored"] = not host_p2p.installed()
    return out


def test_host_staged_p2p_delivers_what_gloo_delivers(rank_pool):
    results = rank_pool(WORLD).run(_p2p_cases, timeout_s=120)
    for rank, res in enumerate(results):
        left = (rank - 1) % WORLD
        assert res[False]["ring"] == res[True]["ring"] == [10.0 * left + i for i in range(5)], (rank, res)
        even = rank - rank % 2
        want = [even, 7, 8] if rank % 2 else [2 * even, 14, 16]
        assert res[False]["pair"] == res[True]["pair"] == want, (rank, res)
        assert res[True]["replaced"] and not res[False]["replaced"] and res["restored"], (rank, res)


# ------------------------------------------------------------------------------------------
# pipeline parallelism through megatron-core's schedule
# ------------------------------------------------------------------------------------------
def _micro_batch(step: int, mb: int, strategy: str) -> dict:
    """``per_document`` (Megatron-LM --sft): documents that divide by 2*cp (cp <= 4); otherwise
    (--dataloader-inter-document-masking) documents of any length. (No SBHD rows: the CPU stand-in of TE's
    attention takes packed rows only.)"""
    from gdn_cp_testing.megatron.batches import packed_batch, random_lengths
    from gdn_cp_testing.megatron.model import VOCAB_SIZE

    seed = 10 * step + mb
    docs = [random_lengths(S, 3, seed + 1, 8 if strategy == "per_document" else 1)]
    return packed_batch(docs, S, vocab_size=VOCAB_SIZE, seed=seed)


def _stage_cuts(strategy: str, cp_group, first: bool, last: bool, step: int) -> list:
    """This stage's micro-batches of ``step``, as Megatron-LM's get_batch gives them to a pipeline stage: the
    first stage has no labels / loss mask, the last no tokens / positions; each cuts its part itself."""
    from gdn_cp_testing.megatron.batches import Cut, get_batch_like_pretrain_gpt, packed_seq_params_like_pretrain_gpt

    out = []
    for mb in range(MICRO_BATCHES):
        batch = _micro_batch(step, mb, strategy)
        if not first:
            batch["tokens"] = batch["position_ids"] = None
        if not last:
            batch["labels"] = batch["loss_mask"] = None
        cut = get_batch_like_pretrain_gpt(batch, cp_group=cp_group, inter_document_masking=True,
                                          padded=strategy == "padded", sft=strategy == "per_document")
        out.append(Cut(cut, packed_seq_params_like_pretrain_gpt(cut, S), None, cp_group))
    return out


PP_RUNS = {  # name -> (kind, strategy, [(pp, cp, mode) or (pp, cp, mode, ep)]); the first run is the reference
    "hybrid_attn_padded": ("hybrid_attn", "padded", [(1, 1, "headwise"), (2, 1, "headwise"), (2, 2, "chunkwise"),
                                                     (2, 2, "headwise"), (2, 2, "all_gather")]),
    "gpt_whole_row": ("gpt", "whole_row", [(1, 1, "headwise"), (2, 2, "chunkwise")]),
    # experts on padded rows: Megatron's router without the features that count every token (its default)
    "hybrid_moe_padded": ("hybrid_moe", "padded", [(1, 1, "headwise", 1), (1, 1, "headwise", 2),
                                                   (1, 2, "chunkwise", 2), (1, 2, "all_gather", 2),
                                                   (1, 4, "chunkwise", 2), (2, 2, "chunkwise", 2)]),
    # ... and with a load-balancing loss, which counts the pads: what gdn-cp refuses (must differ from CP=1)
    "hybrid_moe_padded_aux": ("hybrid_moe", "padded", [(1, 1, "headwise", 1), (1, 2, "chunkwise", 2)]),
    # the same loss on rows that need no pads (documents dividing by 2*cp, cut per document): equals CP=1
    "hybrid_moe_aux": ("hybrid_moe", "per_document", [(1, 1, "headwise", 1), (1, 2, "chunkwise", 2)]),
}
CONFIG = {"hybrid_moe_padded_aux": dict(moe_aux_loss_coeff=0.1), "hybrid_moe_aux": dict(moe_aux_loss_coeff=0.1)}


def _pp_train_cases(ctx, name: str, only=None) -> dict:
    """Every run of ``PP_RUNS[name]`` on the whole world: ``{(pp, cp, mode): train_steps result with params
    named as the whole model names them}`` (or the error)."""
    from gdn_cp_testing.megatron import host_p2p
    from gdn_cp_testing.megatron.batches import install_te_partition_stand_in
    from gdn_cp_testing.megatron.layer import rank_groups
    from gdn_cp_testing.megatron.model import (build_model, copy_stage_params, global_layer_name, model_config)
    from gdn_cp_testing.megatron.training import megatron_parallel_state, train_steps

    install_te_partition_stand_in()
    kind, strategy, runs = PP_RUNS[name]
    runs = [r for r in runs if only is None or r in only]
    heads = HEADS if kind.startswith("hybrid") else {}
    heads = {**heads, **CONFIG.get(name, {})}
    whole = build_model(kind, model_config(kind, 1, "headwise", **heads), rank_groups()["self"], seed=SEED)
    uninstall = host_p2p.install(stage_all=True)  # the schedule's P2P through the host, as on one GPU
    out = {}
    try:
        for run in runs:
            pp, cp, mode, ep = (*run, 1)[:4]
            with megatron_parallel_state(cp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep) as ps:
                first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
                # what the patched validate_args sets for padded rows under PP (gdn_cp.megatron.padded_cut)
                shapes = dict(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall") \
                    if pp > 1 and strategy == "padded" else {}
                config = model_config(kind, cp, mode, calculate_per_token_loss=True, pipeline_model_parallel_size=pp,
                                      expert_model_parallel_size=ep, pipeline_dtype=torch.float64, **shapes, **heads)
                offset = ps.get_pipeline_model_parallel_rank() * (config.num_layers // pp)
                experts = (config.num_moe_experts or 0) // ep * ps.get_expert_model_parallel_rank()

                def build(pg, config=config, first=first, last=last, offset=offset, experts=experts):
                    stage = build_model(kind, config, pg_collection=pg, seed=SEED, pre_process=first, post_process=last)
                    copy_stage_params(stage, whole, offset, experts)
                    return stage

                try:
                    got = train_steps(build, partial(_stage_cuts, strategy, ps.get_context_parallel_group(), first, last),
                                      STEPS, seq_length=S)
                    got["params"] = {global_layer_name(n, offset, experts): p for n, p in got["params"].items()}
                    out[run] = got
                except Exception as e:  # noqa: BLE001 - reported by the parent
                    import traceback

                    out[run] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
                    print(f"rank {ctx.rank} {run}: {out[run]}", flush=True)
    finally:
        uninstall()
    return out


@pytest.mark.parametrize("name", sorted(n for n in PP_RUNS if n != "hybrid_moe_padded_aux"))
def test_pipeline_parallel_training_equals_cp1(patched_megatron, rank_pool, name):
    """3 Adam steps of 2 micro-batches through megatron-core's pipeline schedule: the loss of every step,
    the final parameters of every stage (each against the same parameter of the PP=1 x CP=1 model) and the
    gradient norm (fp32 in megatron) equal the reference's."""
    from gdn_cp_testing.compare import training_diff

    results = rank_pool(WORLD).run(_pp_train_cases, name, timeout_s=400)
    kind, strategy, runs = PP_RUNS[name]
    bad = []
    for rank, per_run in enumerate(results):
        ref = per_run[runs[0]]
        assert isinstance(ref, dict), f"rank {rank} reference: {ref}"
        assert ref["moved"] > 1e-3, ref["moved"]
        for run in runs[1:]:
            got = per_run[run]
            if not isinstance(got, dict):
                bad.append(f"rank {rank} {name} {run}: {got}")
                continue
            # a stage (PP) or expert-parallel rank holds part of the model's parameters: its names a subset of
            # the reference's; that the parts together hold every parameter is checked below
            d = training_diff(got, ref, part=True)
            loss, norm, params = d["loss"], d["grad_norm"], d["params"]
            if not (loss <= TOL and params <= TOL and norm <= 1e-6 and d["names_ok"]):
                bad.append(f"rank {rank} {name} {run}: loss {loss:.3g}, params {params:.3g}, "
                           f"grad norm {norm:.3g} (losses {got['loss']} vs {ref['loss']})")
    assert not bad, "\n".join(bad)
    for run in runs[1:]:  # each stage (and expert-parallel rank) holds its own part, and together every parameter
        if run[0] > 1 or (run + (1,))[3] > 1:
            names = set().union(*(set(r[run]["params"]) for r in results))
            assert names == set(results[0][runs[0]]["params"]), (run, names)


# ------------------------------------------------------------------------------------------
# multi-token prediction's roll on the padded cut
# ------------------------------------------------------------------------------------------
def _mtp_roll_cases(ctx) -> dict:
    """Megatron's roll_tensor (packed sequences) of the labels and the loss mask, per CP size and cut:
    ``{(cp, cut): (rows, rolled labels, rolled mask)}`` of this rank's group, and CP=1's."""
    from megatron.core.transformer.multi_token_prediction import roll_tensor

    from gdn_cp_testing.megatron import host_p2p
    from gdn_cp_testing.megatron.batches import cut_for_rank, install_te_partition_stand_in, packed_batch
    from gdn_cp_testing.megatron.layer import rank_groups
    from gdn_cp_testing.megatron.model import VOCAB_SIZE

    install_te_partition_stand_in()
    make = partial(packed_batch, [[17, 9, 22]], S, vocab_size=VOCAB_SIZE, seed=3)
    uninstall = host_p2p.install(stage_all=True)  # roll_tensor's isend / irecv through the host, as on one GPU
    out = {}
    try:
        for cp, strategy in ((1, "whole_row"), (2, "padded"), (4, "padded"), (2, "whole_row"), (4, "whole_row")):
            group = rank_groups()["self"] if cp == 1 else ctx.group(cp)
            cut = cut_for_rank(make(), strategy, cp_group=group, seq_length=S)
            labels, _ = roll_tensor(cut.batch["labels"], shifts=-1, dims=-1, cp_group=group,
                                    packed_seq_params=cut.packed_seq_params)
            mask, _ = roll_tensor(cut.batch["loss_mask"], shifts=-1, dims=-1, cp_group=group,
                                  packed_seq_params=cut.packed_seq_params)
            out[(cp, strategy)] = (cut.rows.reshape(-1), labels.reshape(-1), mask.reshape(-1))
    finally:
        uninstall()
    return out


def test_mtp_roll_on_the_padded_cut_equals_cp1(patched_megatron, rank_pool):
    """At every real row the label and loss mask MTP trains on are CP=1's (a document's last real row: CP=1's
    masked zero, here its pad's label with mask 0); pad rows carry mask 0. On the whole-row cut the same roll
    gives other targets: MTP needs the per-document cut."""
    results = rank_pool(WORLD).run(_mtp_roll_cases, timeout_s=120)
    for rank, res in enumerate(results):
        _, want_labels, want_mask = res[(1, "whole_row")]
        want = {}
        for row, (label, m) in enumerate(zip(want_labels.tolist(), want_mask.tolist())):
            want[row] = (label if m else None, m)  # a masked target's label does not matter
        for cp in (2, 4):
            rows, labels, mask = res[(cp, "padded")]
            for row, label, m in zip(rows.tolist(), labels.tolist(), mask.tolist()):
                if row < 0:
                    assert m == 0, (rank, cp, "a pad row in MTP's loss")
                else:
                    assert (label if m else None, m) == want[row], (rank, cp, row, label, m, want[row])
    wrong = 0
    for res in results:
        for cp in (2, 4):
            rows, labels, mask = res[(cp, "whole_row")]
            wrong += sum((label if m else None, m) != want[row]
                         for row, label, m in zip(rows.tolist(), labels.tolist(), mask.tolist()))
    assert wrong > 0  # stock's whole-row cut gives MTP other targets
    print(f"MTP roll on the whole-row cut: {wrong} rows with another target than CP=1's")


def test_a_router_loss_counts_the_pads(patched_megatron, rank_pool):
    """Why the padded cut refuses pad-counting router features: with a load-balancing loss (Megatron-LM
    ``--moe-aux-loss-coeff``) the router averages over the pads too, and EP=2 x CP=2 on padded rows trains
    another model than CP=1; the same run without the loss (``hybrid_moe_padded``), and the same loss on rows
    that need no pads (``hybrid_moe_aux``), equal CP=1 (test_pipeline_parallel_training_equals_cp1)."""
    results = rank_pool(WORLD).run(_pp_train_cases, "hybrid_moe_padded_aux", timeout_s=400)
    _, _, runs = PP_RUNS["hybrid_moe_padded_aux"]
    for rank, per_run in enumerate(results):
        ref, got = per_run[runs[0]], per_run[runs[1]]
        assert isinstance(ref, dict) and isinstance(got, dict), (rank, ref, got)
        params = max(abs(float((p - ref["params"][n]).abs().max())) for n, p in got["params"].items())
        assert params > 1e-6, (rank, params)  # far above the 1e-10 the runs without it match within
    print(f"router load-balancing loss on padded rows: parameters {params:.3g} off CP=1 after {STEPS} steps")


# ------------------------------------------------------------------------------------------
# packed micro-batches of two samples through pipeline stages (issue 46)
# ------------------------------------------------------------------------------------------
PACKED_PP_DATA = {  # name -> (model kind, --dataloader-inter-document-masking)
    "gpt_sbhd": ("gpt", False),  # no packing flag: SBHD micro-batches
    "gpt_idm": ("gpt", True),  # GDN + MLP layers: the whole-row cut at CP > 1
    "hybrid_attn_idm": ("hybrid_attn", True),  # with attention: the padded per-document cut at CP > 1
}
# (pp, cp, micro-batch size, per-token loss): PP=1 x CP=1 (the reference of each micro-batch size and loss), PP=2
# at CP=1 and 2, each with micro-batch 1 and 2, per-token loss on and, at micro-batch 2, off. (CP=2 against CP=1
# without pipeline stages: tests/megatron/test_e2e_models.py.)
PACKED_PP_CELLS = [(pp, cp, mbs, ptl) for pp, cp in ((1, 1), (2, 1), (2, 2)) for mbs, ptl in ((1, True), (2, True),
                                                                                            (2, False))]
PACKED_PP_STEPS = 1  # the shape of what a stage receives is wrong from the first step on, or never


def _flags_of_cell(name: str, pp: int, cp: int, mbs: int, ptl: bool):
    """What the patched ``validate_args`` makes of a cell's Megatron-LM flags: ``(config fields, strategy)``
    as the run then gets them (``core_transformer_config_from_args`` copies the args' fields), or the refusal's
    message."""
    from gdn_cp.megatron.thd_split import configure_megatron_lm_args
    from gdn_cp_testing.megatron.model import megatron_lm_args_for

    kind, idm = PACKED_PP_DATA[name]
    args = megatron_lm_args_for(kind, pipeline_model_parallel_size=pp, context_parallel_size=cp, micro_batch_size=mbs,
                                calculate_per_token_loss=ptl, dataloader_inter_document_masking=idm)
    try:
        split = configure_megatron_lm_args(args)
    except ValueError as e:
        return str(e)
    strategy = "sbhd" if split is None else "padded" if (cp > 1 and split == "per_document") else "whole_row"
    fields = dict(variable_seq_lengths=args.variable_seq_lengths, moe_token_dispatcher_type=args.moe_token_dispatcher_type,
                  linear_cp_thd_split=split, calculate_per_token_loss=ptl)
    return fields, strategy


def _packed_stage_cuts(strategy: str, mbs: int, ptl: bool, cp_group, first: bool, last: bool, step: int) -> list:
    """This stage's micro-batches of ``mbs`` samples (documents of any length; SBHD for ``sbhd``), cut as
    Megatron-LM's get_batch cuts them for a pipeline stage; without per-token loss every token counts (a run
    without --eod-mask-loss: the CP ranks then count the same tokens)."""
    from gdn_cp_testing.megatron.batches import Cut, get_batch_like_pretrain_gpt, packed_batch, packed_seq_params_like_pretrain_gpt
    from gdn_cp_testing.megatron.batches import random_lengths
    from gdn_cp_testing.megatron.model import VOCAB_SIZE

    out = []
    for mb in range(MICRO_BATCHES):
        seed = 100 * step + 10 * mb
        docs = None if strategy == "sbhd" else [random_lengths(S, 3, seed + s + 1) for s in range(mbs)]
        batch = packed_batch(docs, S, vocab_size=VOCAB_SIZE, seed=seed, mbs=mbs)
        if not ptl:
            batch["loss_mask"] = torch.ones_like(batch["loss_mask"])
        if not first:
            batch["tokens"] = batch["position_ids"] = None
        if not last:
            batch["labels"] = batch["loss_mask"] = None
        cut = get_batch_like_pretrain_gpt(batch, cp_group=cp_group, inter_document_masking=strategy != "sbhd",
                                          padded=strategy == "padded")
        out.append(Cut(cut, packed_seq_params_like_pretrain_gpt(cut, S), None, cp_group))
    return out


def _packed_pp_cases(ctx) -> dict:
    """Every cell of :data:`PACKED_PP_CELLS` for every model of :data:`PACKED_PP_DATA`, on the whole world:
    ``{(name, pp, cp, mbs, ptl): train_steps result (params named as the whole model names them) or the hook's
    refusal ("refused: ...")}``; a run's error is raised (naming the cell): the other stage would wait for it."""
    from gdn_cp_testing.megatron import host_p2p
    from gdn_cp_testing.megatron.batches import install_te_partition_stand_in
    from gdn_cp_testing.megatron.layer import gdn_cp_forward, rank_groups
    from gdn_cp_testing.megatron.model import build_model, copy_stage_params, global_layer_name, model_config
    from gdn_cp_testing.megatron.training import megatron_parallel_state, train_steps

    install_te_partition_stand_in()
    uninstall = host_p2p.install(stage_all=True)  # the schedule's P2P through the host, as on one GPU
    out = {}
    try:
        for name, (kind, _) in PACKED_PP_DATA.items():
            heads = HEADS if kind.startswith("hybrid") else {}
            whole = build_model(kind, model_config(kind, 1, "headwise", **heads), rank_groups()["self"], seed=SEED)
            for pp, cp, mbs, ptl in PACKED_PP_CELLS:
                key = (name, pp, cp, mbs, ptl)
                hook = _flags_of_cell(name, pp, cp, mbs, ptl)
                if isinstance(hook, str):
                    out[key] = f"refused: {hook}"
                    continue
                fields, strategy = hook
                with megatron_parallel_state(cp, pipeline_model_parallel_size=pp) as ps:
                    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
                    config = model_config(kind, cp, "chunkwise", pipeline_model_parallel_size=pp,
                                          pipeline_dtype=torch.float64, **fields, **heads)
                    offset = ps.get_pipeline_model_parallel_rank() * (config.num_layers // pp)

                    def build(pg, config=config, first=first, last=last, offset=offset):
                        stage = build_model(kind, config, pg_collection=pg, seed=SEED, pre_process=first,
                                            post_process=last)
                        copy_stage_params(stage, whole, offset)
                        return stage

                    cuts = partial(_packed_stage_cuts, strategy, mbs, ptl, ps.get_context_parallel_group(), first, last)
                    # fp64 SBHD through gdn-cp's path at CP=1 too (stock computes its deterministic core in fp32)
                    sbhd = gdn_cp_forward() if strategy == "sbhd" else contextlib.nullcontext()
                    try:  # an error in one stage leaves the other waiting: the pool stops every rank
                        with sbhd:
                            got = train_steps(build, cuts, PACKED_PP_STEPS, seq_length=S, micro_batch_size=mbs,
                                              per_token_loss=ptl)
                    except Exception as e:
                        raise RuntimeError(f"{name} pp {pp} cp {cp} mbs {mbs} ptl {ptl}: {type(e).__name__}: {e}") from e
                    got["params"] = {global_layer_name(n, offset): p for n, p in got["params"].items()}
                    got["variable_seq_lengths"] = fields["variable_seq_lengths"]
                    out[key] = got
    finally:
        uninstall()
    return out


def test_packed_micro_batches_through_pipeline_stages_equal_pp1(patched_megatron, rank_pool):
    """Megatron-LM's flags PP 1/2 x CP 1/2 x micro-batch 1/2 x per-token loss on/off (:data:`PACKED_PP_CELLS`),
    with and without --dataloader-inter-document-masking, as the patched validate_args leaves them: every cell
    trains PP=1 x CP=1's model (loss, gradient norm and parameters after an Adam step of 2 micro-batches), or is
    refused by the hook with the flag that fixes it. Issue 46: PP=2 x CP=1 with inter-document masking and micro-batch 2 was
    accepted, then stopped in the second stage's first GatedDeltaNet ("packed (THD) input needs batch 1": the
    stage received the packed row folded into [S, 2, H])."""
    from gdn_cp.ops.accuracy import max_rel

    results = rank_pool(WORLD).run(_packed_pp_cases, timeout_s=500)
    bad, refused = [], set()
    for rank, res in enumerate(results):
        for (name, pp, cp, mbs, ptl), got in res.items():
            ref = res[(name, 1, 1, mbs, ptl)]
            assert isinstance(ref, dict), f"rank {rank} reference {name} mbs {mbs} ptl {ptl}: {ref}"
            if isinstance(got, str):
                if got.startswith("refused: "):
                    refused.add((name, pp, cp, mbs, ptl))
                    assert "--calculate-per-token-loss" in got, got
                continue
            if (pp, cp) == (1, 1):
                continue
            loss = max(abs(a - b) / abs(b) for a, b in zip(got["loss"], ref["loss"]))
            norm = max(abs(a - b) / abs(b) for a, b in zip(got["grad_norm"], ref["grad_norm"]))
            params = max(max_rel(p, ref["params"][n]) for n, p in got["params"].items())
            if not (loss <= TOL and params <= TOL and norm <= 1e-6):
                bad.append(f"rank {rank} {name} pp {pp} cp {cp} mbs {mbs} ptl {ptl}: loss {loss:.3g}, params "
                           f"{params:.3g}, grad norm {norm:.3g}")
            # the stages exchange shapes exactly where the packed rows of a micro-batch are not [S/cp, mbs, H]
            want = pp > 1 and name != "gpt_sbhd" and (mbs > 1 or (cp > 1 and name == "hybrid_attn_idm"))
            if got["variable_seq_lengths"] != want:
                bad.append(f"{name} pp {pp} cp {cp} mbs {mbs}: variable_seq_lengths={got['variable_seq_lengths']}")
    assert not bad, "\n".join(bad)
    # refused only where the padded cut lacks per-token loss (gdn_cp.megatron.thd_split._check_padded_cut)
    assert refused == {("hybrid_attn_idm", 2, 2, 2, False)}, sorted(refused)
