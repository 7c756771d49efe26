"""End to end, the path a Megatron-LM user runs: megatron-core 0.19.2's ``GPTModel`` and
``HybridModel`` with GDN layers (local modules, ``gdn_cp_testing.megatron.model``), every
micro-batch cut by Megatron's own ``get_batch_on_this_cp_rank`` in each strategy its data-loader
flags select, ``PackedSeqParams`` built as ``pretrain_gpt.forward_step`` builds them
(``gdn_cp_testing.megatron.batches``), at CP=2 and CP=4 in every ``linear_cp_mode``, on 4 gloo CPU
ranks (the session's pool), fp64, deterministic mode (gdn-cp's reference backend).

Compared with CP=1 on the same weights and micro-batch (max_rel <= 1e-10): every token's loss
(the model's own per-token cross entropy) and every parameter's gradient (summed over the ranks
the micro-batch was split over, as Megatron's DP-CP all-reduce sums it). Then a few optimizer
steps through megatron-core's DDP, schedule, ``finalize_model_grads`` and optimizer: the loss
trajectory and the final parameters equal CP=1's.

Strategies (``--sft`` -> per document; ``--dataloader-inter-document-masking`` -> whole row,
documents of any length, and ``padded``: the same rows with Megatron-LM's args asking for the
per-document cut, as the patched ``validate_args`` does for models with attention layers: every
document padded at its end to a multiple of 2*cp, then cut per document, pads out of the loss;
``--hybrid-context-parallel`` -> per sample ``local_cp_size`` 1, 2, 4; no packing flag -> SBHD).
Padded rows are compared at their real tokens; their pad rows must carry loss mask 0 and label 0.
Modes: headwise, chunkwise with its swap at hidden_states (what
``auto`` picks for these shapes) and forced at the core, all_gather. The hybrid model has 2 key /
6 value heads: headwise is illegal at CP=4 there and must be refused with a ValueError.

The mutation checks: whole-row rows whose documents all divide by 2*cp, read as per-document rows
(PackedSeqParams from copies of the boundaries, ``linear_cp_thd_split='per_document'``: the wrong
setting), pass every check of the layer and give a wrong model; padded rows with their pads left in
the loss, or with the pads put before each document instead of after it; the comparison must see
each of them.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from functools import partial

import pytest
import torch

from gdn_cp_testing.megatron.batches import thd_get_partitioned_indices
from gdn_cp_testing.packings import zigzag_rows
from gdn_cp.ops.accuracy import CP_VS_CP1_MAX_REL, STOCK_CORE_VS_FP64_MAX_REL

pytestmark = pytest.mark.megatron

WORLD = 4
TOL = CP_VS_CP1_MAX_REL[torch.float64]
SEED = 5
S = 48  # tokens per sample: divisible by 2*cp at cp 2 and 4
MODES = ("headwise", "chunkwise", "chunkwise@core", "all_gather")
HEADS = {"gpt": {}, "hybrid": dict(linear_num_key_heads=2, linear_num_value_heads=6)}
HEADS["hybrid_attn"] = HEADS["hybrid"]
ILLEGAL = {("hybrid", 4, "headwise"), ("hybrid_attn", 4, "headwise")}  # heads % (TP*CP) != 0


# ------------------------------------------------------------------------------------------
# 0. TransformerEngine's per-document split, re-derived
# ------------------------------------------------------------------------------------------
def _per_token_split(cu: list[int], world: int, rank: int) -> list[int]:
    """Independent definition: walk every token of every sequence and keep those in this rank's
    two parts, in the order sequence, part (first ``rank``, then ``2*world-1-rank``), token."""
    out = []
    for a, b in zip(cu[:-1], cu[1:]):
        part = (b - a) // (2 * world)
        for p in (rank, 2 * world - 1 - rank):
            out += [t for t in range(a, b) if (t - a) // part == p] if part else []
    return out


@pytest.mark.parametrize("cu", [[0, 8], [0, 4, 4, 20, 24, 48], [0, 16, 16, 16, 32], [0, 24, 48, 56]])
def test_thd_get_partitioned_indices_is_tes_split(cu):
    for world in (1, 2, 4):
        if any((b - a) % (2 * world) for a, b in zip(cu[:-1], cu[1:])):
            continue
        parts = []
        for rank in range(world):
            got = thd_get_partitioned_indices(torch.tensor(cu, dtype=torch.int32), cu[-1], world, rank)
            assert got.dtype == torch.int32 and got.shape == (cu[-1] // world,)
            assert got.tolist() == _per_token_split(cu, world, rank), (cu, world, rank)
            assert got.tolist() == zigzag_rows(cu, world, rank).tolist()
            parts += got.tolist()
        assert sorted(parts) == list(range(cu[-1]))  # every token on exactly one rank


def test_thd_get_partitioned_indices_refuses_what_te_cannot_split():
    cu = torch.tensor([0, 6, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match="sequence 0 has length 6, not divisible by 2\\*world_size=4"):
        thd_get_partitioned_indices(cu, 16, 2, 0)
    with pytest.raises(ValueError, match="total_tokens=20"):
        thd_get_partitioned_indices(torch.tensor([0, 8, 16], dtype=torch.int32), 20, 2, 1)
    with pytest.raises(ValueError, match="rank=2"):
        thd_get_partitioned_indices(torch.tensor([0, 8], dtype=torch.int32), 8, 2, 2)


# ------------------------------------------------------------------------------------------
# the per-rank cases (run in every rank of the pool)
# ------------------------------------------------------------------------------------------
def _batches(cp: int, pair: int) -> dict:
    """``{name: (strategy, builder, seq_length)}``: this CP group's micro-batches (the two CP=2 groups get
    different ones). Whole-row rows: documents of any length on CP=2 group 0, and all divisible
    by 2*cp elsewhere (the rows a per-document reading would take without an error). Padded rows:
    documents of any length."""
    from gdn_cp_testing.megatron.batches import packed_batch, random_lengths
    from gdn_cp_testing.megatron.model import VOCAB_SIZE

    unit = 2 * cp
    mbs = 1 if (cp == 2 and pair == 0) else 2
    seed = 100 * cp + 10 * pair
    make = partial(packed_batch, seq_length=S, vocab_size=VOCAB_SIZE, mbs=mbs)
    whole_row = ([[17, 9, 22]] if (cp == 2 and pair == 0)
                 else [random_lengths(S, 3, seed + 3 + s, unit) for s in range(mbs)])
    return {
        "sbhd": ("sbhd", partial(make, None, seed=seed + 1), S),
        "per_document": ("per_document", partial(
            make, [random_lengths(S, 4, seed + 2 + s, unit) for s in range(mbs)], seed=seed + 2, with_padded=pair == 1),
            S),
        "whole_row": ("whole_row", partial(make, whole_row, seed=seed + 3), S),
        "padded": ("padded", partial(make, [[17, 9, 22]] if (cp == 2 and pair == 0)
                                     else [random_lengths(S, 4, seed + 4 + s, 1) for s in range(mbs)],
                                     seed=seed + 4), S),
    }


def _compare(got, want, cut) -> dict:
    """Errors of one rank's ``(per-token losses, {name: grad})`` against CP=1's: the losses at the
    rank's real rows, the gradients summed over the micro-batch's group; ``pads``: 0 when every pad
    row (``cut.rows`` -1) has loss mask 0 and label 0, else inf."""
    from gdn_cp_testing.megatron.model import sum_grads
    from gdn_cp.ops.accuracy import max_rel

    loss, grads = got
    want_loss, want_grads = want
    if set(grads) != set(want_grads):
        raise ValueError(f"parameters differ: CP has {sorted(grads)}, CP=1 has {sorted(want_grads)}")
    sum_grads(grads, cut.group)
    real = cut.rows >= 0
    errs = {"loss": max_rel(loss[real], want_loss.reshape(-1)[cut.rows[real]])}
    pad = ~real
    out_of_loss = bool((cut.batch["loss_mask"][pad] == 0).all() and (cut.batch["labels"][pad] == 0).all())
    errs["pads"] = 0.0 if out_of_loss else math.inf
    errs.update({f"grad:{n}": max_rel(grads[n], g) for n, g in want_grads.items()})  # None: inf
    return errs


def _swap_setting(mode: str):
    """``(linear_cp_mode, context)``: ``chunkwise@core`` forces the chunkwise swap at the core."""
    from gdn_cp_testing.probes import env_setting

    if mode != "chunkwise@core":
        return mode, nullcontext()
    return "chunkwise", env_setting("GDN_CP_CHUNKWISE_SWAP", "core")


def _cp1_answer(model, batch, strategy: str, seq_length: int):
    """The CP=1 answer on the whole micro-batch, cut (i.e. not cut) by Megatron's function at CP=1
    as ``get_batch`` does; fp64 SBHD runs gdn-cp's path (stock computes its deterministic core in
    fp32). A failure is returned as its message (the cases of that batch then report it)."""
    from gdn_cp_testing.megatron.batches import cut_for_rank
    from gdn_cp_testing.megatron.layer import gdn_cp_forward, rank_groups
    from gdn_cp_testing.megatron.model import run_model

    try:
        cut = cut_for_rank(batch, strategy, cp_group=rank_groups()["self"], seq_length=seq_length)
        with gdn_cp_forward() if strategy == "sbhd" else nullcontext():
            return run_model(model, cut.batch, cut.packed_seq_params)
    except Exception as e:  # noqa: BLE001 - reported per case by the parent
        return f"the CP=1 answer failed: {type(e).__name__}: {e}"


def _run_modes(kind, group, static_cfg, batches, want, cut_kwargs) -> dict:
    """Every mode: build the model at static CP group ``group`` (a refused config is recorded), cut
    and run every batch, compare with ``want``. Returns ``{mode: {"refused": message} | {"swap":
    points, name: errors or "Error: message"}}`` (errors carry ``psp``: (local_cp_size, cp_group
    is None) of the PackedSeqParams the model got)."""
    from gdn_cp_testing.megatron.batches import cut_for_rank
    from gdn_cp_testing.megatron.model import build_model, model_config, run_model
    from gdn_cp_testing.probes import swap_points

    out = {}
    for mode in MODES:
        linear_cp_mode, swap = _swap_setting(mode)
        try:
            config = model_config(kind, group.size(), linear_cp_mode, **HEADS[kind], **static_cfg)
        except ValueError as e:
            out[mode] = {"refused": str(e)}
            continue
        model = build_model(kind, config, group, seed=SEED)
        result = {}
        with swap, swap_points() as points:
            for name, (strategy, make, seq_length) in batches.items():
                if isinstance(want[name], str):
                    result[name] = want[name]
                    continue
                try:
                    cut = cut_for_rank(make(), strategy, seq_length=seq_length, **cut_kwargs)
                    result[name] = _compare(run_model(model, cut.batch, cut.packed_seq_params), want[name], cut)
                    psp = cut.packed_seq_params
                    result[name]["psp"] = None if psp is None else (psp.local_cp_size, psp.cp_group is None)
                except Exception as e:  # noqa: BLE001 - reported per case by the parent
                    result[name] = f"{type(e).__name__}: {e}"
        result["swap"] = sorted(set().union(*points.values()))
        out[mode] = result
    return out


def _strategy_cases(ctx, kind: str, cp: int) -> dict:
    """SBHD, per-document, whole-row and padded micro-batches at static CP=cp, every mode."""
    from gdn_cp_testing.megatron.batches import install_te_partition_stand_in
    from gdn_cp_testing.megatron.layer import rank_groups
    from gdn_cp_testing.megatron.model import build_model, model_config

    install_te_partition_stand_in()
    group = ctx.group(cp)
    alone = rank_groups()["self"]
    batches = _batches(cp, ctx.rank // cp)
    base = build_model(kind, model_config(kind, 1, "headwise", **HEADS[kind]), alone, seed=SEED)
    want = {name: _cp1_answer(base, make(), strategy, n) for name, (strategy, make, n) in batches.items()}
    return _run_modes(kind, group, {}, batches, want, dict(cp_group=group))


def _hybrid_batches(ctx) -> dict:
    """``--hybrid-context-parallel`` sub-samples (whole rows, documents of any length, the
    ``cu_seqlens_padded`` copy Megatron's own hybrid-CP batch test adds): ``local_cp_size`` 1 (a
    sample per rank), 2 (a sample per pair of ranks), 4 (one sample over the world)."""
    from gdn_cp_testing.megatron.batches import packed_batch, random_lengths
    from gdn_cp_testing.megatron.model import VOCAB_SIZE

    out = {}
    for k, length in ((1, 24), (2, 32), (4, 48)):
        owner = ctx.rank // k  # which sample of this size this rank works on
        seed = 1000 + 10 * k + owner
        docs = random_lengths(length, 3, seed, 1)
        out[f"local_cp_size={k}"] = (length, partial(packed_batch, [docs], length, vocab_size=VOCAB_SIZE, seed=seed,
                                                     with_padded=k > 1, local_cp_size=k))
    return out


def _hybrid_cp_cases(ctx, kind: str) -> dict:
    """Hybrid CP: static CP group = the world (``context_parallel_size=4``,
    ``hybrid_context_parallel=True``), each sub-sample split over its own group, every mode."""
    from gdn_cp_testing.megatron.batches import install_te_partition_stand_in
    from gdn_cp_testing.megatron.layer import rank_groups
    from gdn_cp_testing.megatron.model import build_model, model_config

    install_te_partition_stand_in()
    alone = rank_groups()["self"]
    hybrid = _hybrid_batches(ctx)
    base = build_model(kind, model_config(kind, 1, "headwise", **HEADS[kind]), alone, seed=SEED)
    want, batches = {}, {}
    for name, (length, make) in hybrid.items():
        plain = make()
        plain["local_cp_size"] = None  # the same sample without hybrid CP
        want[name] = _cp1_answer(base, plain, "whole_row", length)
        batches[name] = ("hybrid", make, length)
    static = dict(hybrid_context_parallel=True, max_seqlen_per_dp_cp_rank=S)
    kwargs = dict(cp_group=ctx.group(WORLD), hybrid_cp_group_func=lambda group_size: ctx.group(group_size))
    return _run_modes(kind, ctx.group(WORLD), static, batches, want, kwargs)


# ------------------------------------------------------------------------------------------
# 1. every strategy x CP size x mode, both models
# ------------------------------------------------------------------------------------------
def _check(results: list, kind: str, cp: int, names: list[str]) -> list[str]:
    """Problems found in every rank's ``_run_modes`` result (empty: all good)."""
    bad = []
    for rank, per_mode in enumerate(results):
        assert set(per_mode) == set(MODES), per_mode.keys()
        for mode, result in per_mode.items():
            if (kind, cp, mode.split("@")[0]) in ILLEGAL:
                if "refused" not in result or "linear_num_key_heads=2" not in result["refused"]:
                    bad.append(f"rank {rank} {kind} cp={cp} {mode}: heads 2/6 at CP={cp} were not refused: {result}")
                continue
            if "refused" in result:
                bad.append(f"rank {rank} {kind} cp={cp} {mode}: refused: {result['refused']}")
                continue
            want_swap = {"chunkwise": ["hidden"], "chunkwise@core": ["core"]}.get(mode, [])
            ran = any(isinstance(result.get(name), dict) for name in names)
            if ran and result["swap"] != want_swap:
                bad.append(f"rank {rank} {kind} cp={cp} {mode}: chunkwise swap points {result['swap']}, "
                           f"expected {want_swap}")
            for name in names:
                errs = result.get(name)
                if not isinstance(errs, dict):
                    bad.append(f"rank {rank} {kind} cp={cp} {mode} {name}: {errs}")
                    continue
                over = {k: v for k, v in errs.items() if k != "psp" and not v <= TOL}
                if over:
                    worst = max(over, key=lambda k: over[k] if not math.isnan(over[k]) else math.inf)
                    bad.append(f"rank {rank} {kind} cp={cp} {mode} {name}: {len(over)} over {TOL}, worst "
                               f"{worst}={over[worst]:.3g} (loss {errs['loss']:.3g})")
    return bad


@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
def test_model_equals_cp1_in_every_strategy_and_mode(patched_megatron, rank_pool, kind):
    pool = rank_pool(WORLD)
    bad = []
    for cp in (2, 4):
        results = pool.run(_strategy_cases, kind, cp, timeout_s=240)
        bad += _check(results, kind, cp, ["sbhd", "per_document", "whole_row", "padded"])
        padded = [v for r in results for res in r.values() if isinstance(res.get("padded"), dict)
                  for k, v in res["padded"].items() if k not in ("psp", "pads")]
        print(f"{kind} cp={cp} padded rows: max_rel over every loss and gradient {max(padded, default=math.nan):.3g}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
def test_hybrid_context_parallel_equals_cp1(patched_megatron, rank_pool, kind):
    """Sub-samples with local_cp_size 1 (PackedSeqParams(local_cp_size=1, cp_group=None): no CP,
    as TransformerEngine treats it), 2 and 4, in every mode."""
    results = rank_pool(WORLD).run(_hybrid_cp_cases, kind, timeout_s=240)
    names = ["local_cp_size=1", "local_cp_size=2", "local_cp_size=4"]
    bad = _check(results, kind, WORLD, names)
    for per_mode in results:
        for result in per_mode.values():
            for name in names:
                if isinstance(result.get(name), dict):
                    k = int(name.split("=")[1])
                    assert result[name]["psp"] == (k, k == 1), (name, result[name]["psp"])
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------------------------------
# 1b. a model with attention layers (the CPU stand-in of TE's THD attention under CP)
# ------------------------------------------------------------------------------------------
def _attention_cases(ctx, cp: int) -> dict:
    """HybridModel ``G-*-`` (``hybrid_attn``: GDN, MLP, attention, MLP) at static CP=cp, every mode, on
    padded rows (documents of odd lengths: the patched cut for --dataloader-inter-document-masking),
    per-document rows (--sft) and, as the negative control, stock's whole-row cut of rows whose
    documents all divide by 2*cp (which the attention reads as a per-document cut, as TE does)."""
    from gdn_cp_testing.megatron.batches import install_te_partition_stand_in, packed_batch, random_lengths
    from gdn_cp_testing.megatron.layer import rank_groups
    from gdn_cp_testing.megatron.model import VOCAB_SIZE, build_model, model_config

    install_te_partition_stand_in()
    group, pair = ctx.group(cp), ctx.rank // cp
    seed = 300 + 100 * cp + 10 * pair
    make = partial(packed_batch, seq_length=S, vocab_size=VOCAB_SIZE, mbs=2)
    batches = {
        "padded": ("padded", partial(make, [[17, 9, 22], random_lengths(S, 5, seed, 1)], seed=seed), S),
        "per_document": ("per_document", partial(make, [random_lengths(S, 3, seed + s, 2 * cp) for s in range(2)],
                                                 seed=seed + 1), S),
        "whole_row_read_per_document": ("whole_row", partial(make, [random_lengths(S, 3, seed + 2 + s, 2 * cp)
                                                                    for s in range(2)], seed=seed + 2), S),
    }
    base = build_model("hybrid_attn", model_config("hybrid_attn", 1, "headwise", **HEADS["hybrid_attn"]),
                       rank_groups()["self"], seed=SEED)
    want = {name: _cp1_answer(base, make(), strategy, n) for name, (strategy, make, n) in batches.items()}
    return _run_modes("hybrid_attn", group, {}, batches, want, dict(cp_group=group))


def test_attention_model_on_padded_rows_equals_cp1(patched_megatron, rank_pool):
    """With attention layers the padded per-document cut (and --sft's cut) trains CP=1's model in every
    mode; stock's whole-row cut does not (the negative control: rows whose documents all divide by 2*cp,
    so that nothing stops it)."""
    pool = rank_pool(WORLD)
    bad, control = [], []
    for cp in (2, 4):
        results = pool.run(_attention_cases, cp, timeout_s=240)
        bad += _check(results, "hybrid_attn", cp, ["padded", "per_document"])
        for rank, per_mode in enumerate(results):
            for mode, result in per_mode.items():
                got = result.get("whole_row_read_per_document")
                if isinstance(got, dict):
                    control.append(got["loss"])
                    if not got["loss"] > 1e-2:
                        bad.append(f"rank {rank} cp={cp} {mode}: stock's whole-row cut was not seen: {got}")
        padded = [v for r in results for res in r.values() if isinstance(res.get("padded"), dict)
                  for k, v in res["padded"].items() if k not in ("psp", "pads")]
        print(f"hybrid_attn cp={cp} padded rows: max_rel over every loss and gradient {max(padded, default=math.nan):.3g}")
    assert not bad, "\n".join(bad)
    assert control, "the negative control did not run"
    print(f"attention model, stock's whole-row cut: loss max_rel {min(control):.3g} .. {max(control):.3g}")


# ------------------------------------------------------------------------------------------
# 2. the CP=1 answer itself: a packed row equals its documents run one at a time
# ------------------------------------------------------------------------------------------
def _cp1_packed_vs_documents(ctx) -> dict:
    """At CP=1, a row of documents of odd and even lengths (``--sft`` does not pad them at CP=1;
    inter-document masking never does) cut by Megatron's function as get_batch cuts it, against
    each document alone through stock megatron-core's own GatedDeltaNet code (SBHD, batch 1):
    every token's loss, and the packed gradient against the sum of the documents' gradients."""
    from gdn_cp_testing.megatron.batches import cut_for_rank, install_te_partition_stand_in, packed_batch
    from gdn_cp_testing.megatron.layer import rank_groups, stock_forward
    from gdn_cp_testing.megatron.model import VOCAB_SIZE, build_model, model_config, run_model
    from gdn_cp.ops.accuracy import max_rel

    install_te_partition_stand_in()
    alone = rank_groups()["self"]
    model = build_model("gpt", model_config("gpt", 1, "chunkwise"), alone, seed=SEED)
    docs = [7, 12, 1, 20]
    length = sum(docs)
    losses, grads = [], {}
    row = packed_batch([docs], length, vocab_size=VOCAB_SIZE, seed=ctx.rank)
    for start, n in zip([0, 7, 19, 20], docs):
        one = {k: (v[:, start:start + n] if k in ("tokens", "labels", "loss_mask") else None) for k, v in row.items()}
        one["position_ids"] = torch.arange(n).unsqueeze(0)
        with stock_forward():
            loss, g = run_model(model, one)
        losses.append(loss)
        for k, v in g.items():
            grads[k] = v if k not in grads else grads[k] + v
    want = torch.cat(losses, dim=1)
    out = {}
    for strategy in ("per_document", "whole_row"):
        try:
            cut = cut_for_rank(packed_batch([docs], length, vocab_size=VOCAB_SIZE, seed=ctx.rank), strategy,
                               cp_group=alone, seq_length=length)
            loss, g = run_model(model, cut.batch, cut.packed_seq_params)
            out[strategy] = {"loss": max_rel(loss, want), **{f"grad:{k}": max_rel(g[k], grads[k]) for k in grads}}
        except Exception as e:  # noqa: BLE001 - reported by the parent
            out[strategy] = f"{type(e).__name__}: {e}"
    return out


def test_cp1_packed_row_equals_its_documents_one_at_a_time(patched_megatron, rank_pool):
    """Every comparison above trusts the CP=1 THD answer; this checks it against code with no
    packing and no gdn-cp at all (stock 0.19.2 computes its deterministic core in fp32, hence
    the looser limit). Documents of odd length must run at CP=1 (no split is made)."""
    results = rank_pool(WORLD).run(_cp1_packed_vs_documents)
    for rank, per_strategy in enumerate(results):
        for strategy, errs in per_strategy.items():
            assert isinstance(errs, dict), f"rank {rank} {strategy}: {errs}"
            over = {k: v for k, v in errs.items() if not v <= STOCK_CORE_VS_FP64_MAX_REL}
            assert not over and len(errs) > 20, (rank, strategy, over)


# ------------------------------------------------------------------------------------------
# 3. the THD split when no record exists: linear_cp_thd_split, and the mutation check
# ------------------------------------------------------------------------------------------
def _unrecorded(psp):
    """The same PackedSeqParams with the boundaries copied (``.clone()``): what code that builds
    its own PackedSeqParams passes; no record of Megatron's cut reaches the layer."""
    import dataclasses

    fields = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")
    return dataclasses.replace(psp, **{f: getattr(psp, f).clone() for f in fields if getattr(psp, f) is not None})


# name -> (document lengths, Megatron strategy, copy the boundaries, linear_cp_thd_split, modes)
SPLIT_CASES = {
    # the mutation: whole-row rows read as per-document rows (every document divides by 2*cp)
    "whole_row_read_per_document": ([12, 4, 20, 12], "whole_row", True, "per_document", MODES),
    # no record, no setting: refused, never guessed (documents that could be cut either way)
    "whole_row_unrecorded_unset": ([12, 4, 20, 12], "whole_row", True, None, ("chunkwise",)),
    "per_document_unrecorded_unset": ([12, 4, 20, 12], "per_document", True, None, ("headwise",)),
    "whole_row_unrecorded_odd": ([17, 9, 22], "whole_row", True, "per_document", ("chunkwise",)),
    "whole_row_unrecorded_set": ([17, 9, 22], "whole_row", True, "whole_row", MODES),
    "per_document_unrecorded_set": ([12, 4, 20, 12], "per_document", True, "per_document", ("chunkwise",)),
    "whole_row_recorded_contradicted": ([12, 4, 20, 12], "whole_row", False, "per_document", ("chunkwise",)),
    "per_document_recorded_contradicted": ([12, 4, 20, 12], "per_document", False, "whole_row", ("chunkwise",)),
}


def _split_cases(ctx) -> dict:
    """GPTModel at CP=2 (both pairs of ranks, the same micro-batches): ``{(case, mode): errors or
    "Error: message"}``."""
    from gdn_cp_testing.megatron.batches import cut_for_rank, install_te_partition_stand_in, packed_batch
    from gdn_cp_testing.megatron.layer import rank_groups
    from gdn_cp_testing.megatron.model import VOCAB_SIZE, build_model, model_config, run_model

    install_te_partition_stand_in()
    group, alone = ctx.group(2), rank_groups()["self"]
    base = build_model("gpt", model_config("gpt", 1, "headwise"), alone, seed=SEED)
    models = {}
    out = {}
    for case, (docs, strategy, copy, field, modes) in SPLIT_CASES.items():
        make = partial(packed_batch, [docs], S, vocab_size=VOCAB_SIZE, seed=7)
        want = _cp1_answer(base, make(), strategy, S)
        for mode in modes:
            linear_cp_mode, swap = _swap_setting(mode)
            try:
                if (linear_cp_mode, field) not in models:
                    extra = {} if field is None else dict(linear_cp_thd_split=field)
                    models[(linear_cp_mode, field)] = build_model(
                        "gpt", model_config("gpt", 2, linear_cp_mode, **extra), group, seed=SEED)
                model = models[(linear_cp_mode, field)]
                cut = cut_for_rank(make(), strategy, cp_group=group, seq_length=S)
                psp = _unrecorded(cut.packed_seq_params) if copy else cut.packed_seq_params
                with swap:
                    out[(case, mode)] = _compare(run_model(model, cut.batch, psp), want, cut)
            except Exception as e:  # noqa: BLE001 - the parent checks which errors are expected
                out[(case, mode)] = f"{type(e).__name__}: {e}"
    return out


def test_thd_split_without_a_record(patched_megatron, rank_pool):
    """PackedSeqParams built from copies of the boundaries carry no record of Megatron's cut: the
    layer takes ``linear_cp_thd_split``, and refuses naming it when it is None. Whole-row rows whose
    documents all divide by 2*cp, set per_document, give a wrong model without an error: the
    comparison must see it (the mutation check: per-token loss off by 29-39% here, gradients by
    more). A document that cannot be cut per document is
    refused naming the field; the field set to whole_row gives the CP=1 answer; a field that
    contradicts Megatron's recorded cut is refused naming it."""
    results = rank_pool(WORLD).run(_split_cases, timeout_s=240)
    bad = []
    for rank, per_case in enumerate(results):
        for (case, mode), got in per_case.items():
            where = f"rank {rank} {case} {mode}"
            if case == "whole_row_read_per_document":
                if not (isinstance(got, dict) and got["loss"] > 1e-2):
                    bad.append(f"{where}: the wrong split was not seen by the comparison: {got}")
            elif case in ("whole_row_unrecorded_set", "per_document_unrecorded_set"):
                over = {k: v for k, v in got.items() if not v <= TOL} if isinstance(got, dict) else got
                if over:
                    bad.append(f"{where}: {over}")
            elif not (isinstance(got, str) and got.startswith("ValueError") and "linear_cp_thd_split" in got):
                bad.append(f"{where}: expected a ValueError naming linear_cp_thd_split, got {got}")
            elif case.endswith("_unset") and "linear_cp_thd_split is None and these packed (THD) rows carry no " \
                    "record" not in got:
                bad.append(f"{where}: expected the unset-split error, got {got}")
    assert not bad, "\n".join(bad)
    mutation = [r[("whole_row_read_per_document", m)]["loss"] for r in results for m in MODES]
    print(f"whole-row rows read per document: loss max_rel {min(mutation):.3g} .. {max(mutation):.3g}")


def _pads_before_documents(cu, padded, cp, rank):
    """A wrong cut for the mutation check: :func:`gdn_cp.layout.padded_rank_sources` with every
    document's pad rows before its real rows instead of after them."""
    import numpy as np

    from gdn_cp.layout import PAD_SOURCE
    from gdn_cp.layout.spans import expand_spans, zigzag_rank_spans

    c, p = np.array(cu, dtype=np.int64), np.array(padded, dtype=np.int64)
    spans = zigzag_rank_spans(p, cp, rank)
    rows = expand_spans(spans.start, spans.length).numpy()
    doc = np.searchsorted(p, rows, side="right") - 1
    offset = rows - p[doc] - (np.diff(p) - np.diff(c))[doc]
    return torch.from_numpy(np.where(offset >= 0, c[doc] + offset, PAD_SOURCE))


def _padded_mutation_cases(ctx) -> dict:
    """GPTModel, chunkwise, at CP=2 and 4 on padded rows: ``{(cp, case): errors}`` for the right cut
    (``right``), the pads left in the loss (loss mask 1 at every pad row) and the pads put before
    every document."""
    from gdn_cp.megatron import document_padding
    from gdn_cp_testing.megatron.batches import cut_for_rank, install_te_partition_stand_in, packed_batch
    from gdn_cp_testing.megatron.layer import rank_groups
    from gdn_cp_testing.megatron.model import VOCAB_SIZE, build_model, model_config, run_model

    install_te_partition_stand_in()
    base = build_model("gpt", model_config("gpt", 1, "headwise"), rank_groups()["self"], seed=SEED)
    out = {}
    for cp in (2, 4):
        group = ctx.group(cp)
        model = build_model("gpt", model_config("gpt", cp, "chunkwise"), group, seed=SEED)
        make = partial(packed_batch, [[17, 9, 22]], S, vocab_size=VOCAB_SIZE, seed=11)
        want = _cp1_answer(base, make(), "padded", S)
        for case in ("right", "pads_in_loss", "pads_before"):
            saved = document_padding.padded_rank_sources
            if case == "pads_before":
                document_padding.padded_rank_sources = _pads_before_documents
            try:
                cut = cut_for_rank(make(), "padded", cp_group=group, seq_length=S)
            finally:
                document_padding.padded_rank_sources = saved
            if case == "pads_in_loss":
                cut.batch["loss_mask"][cut.rows < 0] = 1.0
            errs = _compare(run_model(model, cut.batch, cut.packed_seq_params), want, cut)
            out[(cp, case)] = {"loss": errs["loss"], "pads": errs["pads"],
                               "grad": max(v for k, v in errs.items() if k.startswith("grad:"))}
    return out


def test_padded_cut_mutations_are_seen(patched_megatron, rank_pool):
    """The right padded cut equals CP=1; pads left in the loss change the gradients (their losses
    join the sum) and are flagged; pads before each document change every following token of it
    (the recurrence and the conv see them first). The comparison must see both."""
    results = rank_pool(WORLD).run(_padded_mutation_cases, timeout_s=240)
    bad = []
    for rank, per_case in enumerate(results):
        for (cp, case), errs in per_case.items():
            where = f"rank {rank} cp={cp} {case}: {errs}"
            if case == "right" and not (errs["loss"] <= TOL and errs["grad"] <= TOL and errs["pads"] == 0):
                bad.append(where)
            elif case == "pads_in_loss" and not errs["grad"] > 1e-2:
                bad.append(f"{where}: pads in the loss were not seen")
            elif case == "pads_before" and not errs["loss"] > 1e-2:
                bad.append(f"{where}: pads before the documents were not seen")
    assert not bad, "\n".join(bad)
    for cp in (2, 4):  # the ranks that hold pad rows flag them (at cp=2 here only rank 0 of each pair does)
        assert any(r[(cp, "pads_in_loss")]["pads"] == math.inf for r in results), (cp, results)
    for case in ("pads_in_loss", "pads_before"):
        seen = [e["grad" if case == "pads_in_loss" else "loss"] for r in results for (_, c), e in r.items() if c == case]
        print(f"padded cut mutation {case}: max_rel {min(seen):.3g} .. {max(seen):.3g}")


# ------------------------------------------------------------------------------------------
# 4. optimizer steps through Megatron's DDP, schedule, finalize_model_grads and optimizer
# ------------------------------------------------------------------------------------------
TRAIN_STEPS = 3
MICRO_BATCHES = 2
TRAIN_RUNS = {  # name -> (kind, strategy, [(cp, mode)]); the first run is the CP=1 reference
    "gpt": ("gpt", "whole_row", [(1, "headwise"), (2, "chunkwise"), (4, "headwise"), (4, "all_gather")]),
    "hybrid": ("hybrid", "per_document", [(1, "headwise"), (2, "headwise"), (4, "chunkwise")]),
    # --dataloader-inter-document-masking rows padded and cut per document (pads uneven over the ranks:
    # calculate_per_token_loss makes the step CP=1's)
    "hybrid_attn_padded": ("hybrid_attn", "padded", [(1, "headwise"), (2, "all_gather"), (4, "chunkwise")]),
}


def _train_micro_batches(strategy: str, cp: int, cp_group, step: int) -> list:
    from gdn_cp_testing.megatron.batches import cut_for_rank, packed_batch, random_lengths
    from gdn_cp_testing.megatron.model import VOCAB_SIZE

    out = []
    for mb in range(MICRO_BATCHES):
        seed = 10 * step + mb
        unit = 8 if strategy == "per_document" else 1  # documents cut per document divide by 2*cp (cp <= 4)
        docs = random_lengths(S, 3, seed, unit)
        batch = packed_batch([docs], S, vocab_size=VOCAB_SIZE, seed=seed)
        out.append(cut_for_rank(batch, strategy, cp_group=cp_group, seq_length=S))
    return out


def _train_cases(ctx, name: str) -> dict:
    """Every run of ``TRAIN_RUNS[name]`` on the whole world (DP = 4 / cp replicas, all on the same
    micro-batches): ``{(cp, mode): train_steps result}``."""
    from gdn_cp_testing.megatron.batches import install_te_partition_stand_in
    from gdn_cp_testing.megatron.model import build_model, model_config
    from gdn_cp_testing.megatron.training import megatron_parallel_state, train_steps

    install_te_partition_stand_in()
    kind, strategy, runs = TRAIN_RUNS[name]
    out = {}
    for cp, mode in runs:
        with megatron_parallel_state(cp) as ps:
            config = model_config(kind, cp, mode, calculate_per_token_loss=True, **HEADS[kind])
            build = partial(build_model, kind, config, seed=SEED)
            cp_group = ps.get_context_parallel_group()
            try:
                out[(cp, mode)] = train_steps(lambda pg: build(pg_collection=pg),
                                              partial(_train_micro_batches, strategy, cp, cp_group), TRAIN_STEPS,
                                              seq_length=S)
            except Exception as e:  # noqa: BLE001 - reported by the parent
                out[(cp, mode)] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.parametrize("name", sorted(TRAIN_RUNS))
def test_training_steps_equal_cp1(patched_megatron, rank_pool, name):
    """3 Adam steps of 2 micro-batches each: the loss of every step, the final parameters (max_rel
    over each tensor) equal CP=1's; the gradient norm (megatron computes it in fp32) to 1e-6."""
    from gdn_cp_testing.compare import training_diff

    results = rank_pool(WORLD).run(_train_cases, name, timeout_s=240)
    kind, strategy, runs = TRAIN_RUNS[name]
    bad = []
    for rank, per_run in enumerate(results):
        ref = per_run[runs[0]]
        assert isinstance(ref, dict), f"rank {rank} CP=1: {ref}"
        assert ref["moved"] > 1e-3, ref["moved"]  # the steps changed the model
        for run in runs[1:]:
            got = per_run[run]
            if not isinstance(got, dict):
                bad.append(f"rank {rank} {kind} {strategy} cp={run[0]} {run[1]}: {got}")
                continue
            d = training_diff(got, ref)
            loss, norm, params = d["loss"], d["grad_norm"], d["params"]
            if not (loss <= TOL and params <= TOL and norm <= 1e-6 and d["names_ok"]):
                bad.append(f"rank {rank} {kind} {strategy} cp={run[0]} {run[1]}: loss {loss:.3g}, params "
                           f"{params:.3g}, grad norm {norm:.3g} (losses {got['loss']} vs {ref['loss']})")
    assert not bad, "\n".join(bad)


def _parallel_state_entries(ctx):
    """Enter megatron_parallel_state for topologies seen before and new: per entry (tp, cp, the
    groups' identities and sizes, this rank's threads); outside it nothing is initialized."""
    from gdn_cp_testing.megatron.training import megatron_parallel_state
    from gdn_cp_testing.ranks import thread_census

    out = []
    for tp, cp in ((1, 2), (2, 2), (1, 2), (2, 2), (1, 4), (2, 2), (1, 2)):
        with megatron_parallel_state(cp, tensor_model_parallel_size=tp) as ps:
            groups = (ps.get_tensor_model_parallel_group(), ps.get_context_parallel_group(),
                      ps.get_data_parallel_group(with_context_parallel=True))
            out.append((tp, cp, tuple(id(g) for g in groups), tuple(g.size() for g in groups),
                        ps.get_global_memory_buffer() is not None, thread_census()[0]))
        assert not ps.model_parallel_is_initialized() and ps._GLOBAL_MEMORY_BUFFER is None
    return out


def test_megatron_parallel_state_is_made_once_per_topology(patched_megatron, rank_pool):
    """A topology entered again gets the same groups and costs no thread (each
    initialize_model_parallel creates dozens of gloo groups that hold threads until destroyed)."""
    for rank, entries in enumerate(rank_pool(WORLD).run(_parallel_state_entries)):
        first = {}
        for tp, cp, ids, sizes, buffer, _ in entries:
            assert sizes == (tp, cp, WORLD // tp) and buffer, (rank, tp, cp, sizes)
            assert first.setdefault((tp, cp), ids) == ids, (rank, tp, cp, "groups made again")
        threads = [e[-1] for e in entries]  # entries 2, 3 and 5, 6 only re-enter topologies made before
        assert threads[1] == threads[2] == threads[3] and threads[4] == threads[5] == threads[6], (rank, threads)
