"""The patched megatron-core 0.19.2 GatedDeltaNet under tensor parallelism (TP), sequence
parallelism (SP) and CP, against TP=1 CP=1 on the same full weights, on 4 gloo CPU ranks (the
session's 4-rank pool; deterministic mode, i.e. gdn-cp's reference backend and stock's torch core).

Rank grid as Megatron lays it out (TP fastest): TP groups {0,1} and {2,3}; at TP=2 x CP=2 the CP
groups are {0,2} and {1,3}; at TP=2 x CP=1 the two TP groups are data-parallel replicas that get
different data. Each TP rank holds its part of the full weights, split as 0.19.2 splits them
(``gdn_cp_testing.megatron.tp``). Compared on every rank: the output and the hidden_states gradient
on its rows, and every parameter gradient after what Megatron does before the optimizer (the TP
step of finalize_model_grads, the sum over CP, the TP parts gathered to full shape). fp64 <= 1e-10,
fp32 <= 1e-5 (fp32 SBHD at CP=1 runs the stock code path on both sides).

Sequence parallelism: Megatron's local torch norm refuses it ("sequence parallel not supported by
torch LayerNorm") and TransformerEngine cannot be installed here, so with SP the layer's out_norm is
``gdn_cp_testing.megatron.layer.SequenceParallelRMSNorm``: torch's RMSNorm with its weight tagged
``sequence_parallel`` as TransformerEngine's norms tag theirs.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from gdn_cp_testing.megatron.parity import MODES, tp_grid_case, tp_parity_case
from gdn_cp.ops.accuracy import CP_VS_CP1_MAX_REL as TOL

pytestmark = pytest.mark.megatron

WORLD = 4
DTYPES = (torch.float64, torch.float32)
LAYOUTS = ("sbhd", "thd")
ALL_PARAMS = ("in_proj.weight", "in_proj.bias", "conv1d.weight", "conv1d.bias", "A_log", "dt_bias",
              "out_norm.weight", "out_proj.weight", "out_proj.bias")
# heads that TP=2 divides but TP*CP=4 does not: chunkwise / all_gather only
TP_ONLY_HEADS = dict(linear_num_key_heads=2, linear_num_value_heads=6)


def _over_tolerance(results, what) -> list[str]:
    """``results``: per rank, ``{case: {mode: {quantity: error}}}`` with the dtype in ``case``."""
    bad = []
    for rank, per_case in enumerate(results):
        for case, per_mode in per_case.items():
            tol = TOL[torch.float64] if "float64" in str(case) else TOL[torch.float32]
            for mode, errs in per_mode.items():
                over = {k: v for k, v in errs.items() if not v <= tol}
                if over:
                    bad.append(f"{what} rank {rank} {case} {mode}: over {tol}: {over}")
    return bad


def _compared(results) -> set[str]:
    return {q for per_case in results for per_mode in per_case.values() for e in per_mode.values() for q in e}


# ------------------------------------------------------------------------------------------
# 0. the tests' TP split of the full weights is megatron-core 0.19.2's own
# ------------------------------------------------------------------------------------------
def _checkpoint_layout(ctx):
    """Each TP rank's parameters (split by gdn_cp_testing.megatron.tp) against the full weights, at
    the offsets megatron's sharded_state_dict gives every (sub-)tensor: ``{key: equal}``."""
    from gdn_cp_testing.megatron.layer import build_gdn, make_config, rank_groups
    from gdn_cp_testing.megatron.tp import tp_cp_groups

    tp_group, single, _ = tp_cp_groups(2, 1)

    def sharded(module):
        out = {}
        for item in module.sharded_state_dict(prefix="", metadata={"dp_cp_group": single}).values():
            if not torch.is_tensor(getattr(item, "data", None)):
                continue  # _extra_state
            for sh in item.build() if hasattr(item, "build_fn") else [item]:  # factories split sections
                out[sh.key] = (sh.data, tuple(sh.global_offset))
        return out

    build = dict(seed=3, bias=True, conv_bias=True)
    full = sharded(build_gdn(make_config(1, "chunkwise", torch.float64), rank_groups()["self"], **build))
    part = sharded(build_gdn(make_config(1, "chunkwise", torch.float64, tensor_model_parallel_size=2), single,
                             tp_group=tp_group, **build))
    assert set(full) == set(part), (sorted(full), sorted(part))
    return {key: torch.equal(full[key][0][tuple(slice(o, o + n) for o, n in zip(offset, data.shape))], data)
            for key, (data, offset) in part.items()}


def test_tp_split_is_megatrons_checkpoint_layout(patched_megatron, rank_pool):
    """in_proj's output channels q|k|v|z|beta|alpha each split over TP (its weight is saved as one
    tensor per section), conv1d's q|k|v likewise, A_log / dt_bias by heads, out_proj by columns.
    One exception, megatron-core 0.19.2's and not the tests': in_proj.bias (bias=True only) is saved
    as the TP parts one after the other, not by section, so such a checkpoint does not load
    correctly at another TP size. The forward uses the sectioned layout (the parity tests pass with
    it), so the tests split in_proj.bias by section like the weight."""
    for rank, equal in enumerate(rank_pool(WORLD).run(_checkpoint_layout)):
        assert {k for k, ok in equal.items() if not ok} == {"in_proj.bias"}, (rank, equal)
        assert {"in_proj.weight.query", "in_proj.weight.alpha", "conv1d.weight.value", "conv1d.bias.key", "A_log",
                "dt_bias", "out_proj.weight", "out_proj.bias", "out_norm.weight"} <= set(equal), sorted(equal)


# ------------------------------------------------------------------------------------------
# 1. TP=2 x CP=2 and TP=2 x CP=1, SP off and on, every mode, SBHD and THD, fp64 and fp32
# ------------------------------------------------------------------------------------------
def _grid(ctx, grid, dtypes, cfg=None, modes=MODES):
    return tp_grid_case(grid, dtypes, modes, LAYOUTS, cfg=cfg)


TP_GRID = [(2, 2, False), (2, 2, True), (2, 1, False), (2, 1, True)]


def test_tp_cp_sp_equal_tp1_cp1(patched_megatron, rank_pool):
    results = rank_pool(WORLD).run(_grid, TP_GRID, DTYPES)
    assert not _over_tolerance(results, "TP x CP vs TP=1 CP=1"), "\n".join(_over_tolerance(results, ""))
    assert set(results[0]) == {(tp, cp, sp, lay, str(dt)) for tp, cp, sp in TP_GRID for lay in LAYOUTS
                               for dt in DTYPES}
    assert all(set(per_mode) == set(MODES) for per_mode in results[0].values())
    assert {f"grad:{p}" for p in ALL_PARAMS} | {"out", "grad:hidden_states"} <= _compared(results)


def _without_tp_grad_sum(ctx):
    """The same comparison with gdn-cp's out_norm TP gradient sum switched off (stock 0.19.2)."""
    import gdn_cp.megatron.layer as glue

    saved = glue.install_tp_grad_sum
    glue.install_tp_grad_sum = lambda layer: []
    try:
        return _grid(ctx, [(2, 1, False), (2, 2, False)], (torch.float32,), modes=("chunkwise",))
    finally:
        glue.install_tp_grad_sum = saved


def test_tp_comparison_catches_the_out_norm_gradient(patched_megatron, rank_pool):
    """Without the fix, TP ranks' out_norm.weight gradients are partial (SBHD at CP=1: the stock
    path; THD and CP=2: gdn-cp's path): the comparison above must see it, and only there."""
    results = rank_pool(WORLD).run(_without_tp_grad_sum)
    for rank, per_case in enumerate(results):
        for case, per_mode in per_case.items():
            errs = per_mode["chunkwise"]
            assert errs["grad:out_norm.weight"] > 1e-2, (rank, case, errs["grad:out_norm.weight"])
            rest = {k: v for k, v in errs.items() if k != "grad:out_norm.weight" and not v <= TOL[torch.float32]}
            assert not rest, (rank, case, rest)


# ------------------------------------------------------------------------------------------
# 2. dynamic CP at TP=2; heads that divide TP but not TP*CP; the chunkwise swap points
# ------------------------------------------------------------------------------------------
def _dynamic_tp(ctx):
    from gdn_cp_testing.megatron.tp import tp_cp_groups

    tp_group, single, _ = tp_cp_groups(2, 1)
    _, pair, _ = tp_cp_groups(2, 2)
    out = {}
    for sp in (False, True):
        for layout in LAYOUTS:
            # static CP=1; the micro-batch is split over the CP pair {0,2} / {1,3}
            out[("grow", sp, layout, "float64")] = tp_parity_case(
                layout, torch.float64, MODES, tp_group=tp_group, cp_group=pair, static_cp_group=single,
                sequence_parallel=sp)
            # static CP=2; each TP group runs its own micro-batch without CP
            out[("shrink", sp, layout, "float64")] = tp_parity_case(
                layout, torch.float64, MODES, tp_group=tp_group, cp_group=single, static_cp_group=pair,
                sequence_parallel=sp, data_seed=1 + pair.rank())
    return out


def test_dynamic_cp_at_tp2(patched_megatron, rank_pool):
    results = rank_pool(WORLD).run(_dynamic_tp)
    assert len(results[0]) == 8
    assert not _over_tolerance(results, "dynamic CP"), "\n".join(_over_tolerance(results, ""))


def _tp_only_heads(ctx):
    import torch.distributed as dist

    from gdn_cp_testing.megatron.layer import build_gdn, make_config, thd_params
    from gdn_cp_testing.megatron.tp import sp_slice, tp_cp_groups
    from gdn_cp_testing.packings import thd_case, zigzag_rows

    res = {"parity": _grid(ctx, [(2, 2, False), (2, 2, True)], (torch.float64,), cfg=TP_ONLY_HEADS,
                           modes=("chunkwise", "all_gather"))}
    # The forward refuses headwise before any collective (hybrid models skip the config check):
    # only rank 0 calls, so a collective before the check would hang this case.
    tp_group, cp_group, _ = tp_cp_groups(2, 2)
    errors = {}
    for sp in (False, True):
        config = make_config(2, "chunkwise", torch.float64, tensor_model_parallel_size=2, sequence_parallel=sp,
                             **TP_ONLY_HEADS)
        module = build_gdn(config, cp_group, tp_group=tp_group)
        cu_pad, cu_act = thd_case(2)
        rows = zigzag_rows(cu_pad, 2, cp_group.rank())
        rows = rows[sp_slice(rows.numel(), 2, tp_group.rank())] if sp else rows
        x = torch.zeros(rows.numel(), 1, config.hidden_size, dtype=torch.float64)
        module.config.linear_cp_mode = "headwise"
        if ctx.rank == 0:
            try:
                module(x, None, packed_seq_params=thd_params(cu_pad, cu_act))
                errors[sp] = None
            except ValueError as e:
                errors[sp] = str(e)
    res["forward_errors"] = errors
    dist.barrier()
    return res


def test_heads_dividing_tp_but_not_tp_times_cp(patched_megatron, rank_pool):
    from gdn_cp_testing.megatron.layer import make_config

    results = rank_pool(WORLD).run(_tp_only_heads, timeout_s=180)
    parity = [r["parity"] for r in results]
    assert not _over_tolerance(parity, "TP-only heads"), "\n".join(_over_tolerance(parity, ""))
    for sp, msg in results[0]["forward_errors"].items():
        assert msg is not None, f"headwise ran with 2 key heads at TP=2 x CP=2 (sp={sp})"
        for needle in ("linear_cp_mode='headwise'", "tensor_model_parallel_size=2", "context_parallel_size=2",
                       "linear_num_key_heads=2", "'chunkwise'"):
            assert needle in msg, (needle, msg)
    with pytest.raises(ValueError, match=r"headwise.*tensor_model_parallel_size=2, context_parallel_size=2.*"
                                         r"linear_num_key_heads=2 is not divisible by TP\*CP=2\*2=4.*"
                                         r"'chunkwise' or 'all_gather'"):
        make_config(2, "headwise", torch.float64, tensor_model_parallel_size=2, **TP_ONLY_HEADS)


def _swap_points_tp(ctx):
    import torch.distributed as dist

    from gdn_cp_testing.probes import all_to_all_bytes, env_setting
    from gdn_cp_testing.megatron.layer import build_gdn, make_config, thd_params
    from gdn_cp_testing.megatron.tp import sp_slice, tp_cp_groups
    from gdn_cp_testing.packings import thd_case, zigzag_rows

    tp_group, cp_group, _ = tp_cp_groups(2, 2)
    res, moved = {}, {}
    for sp, points in ((False, ("hidden", "core", "auto")), (True, ("core", "auto"))):
        for point in points:
            with env_setting("GDN_CP_CHUNKWISE_SWAP", point):
                for layout in LAYOUTS:
                    with all_to_all_bytes() as sent:
                        res[(sp, point, layout, "float64")] = tp_parity_case(
                            layout, torch.float64, ("chunkwise",), tp_group=tp_group, cp_group=cp_group,
                            sequence_parallel=sp)
                    moved[(sp, point, layout)] = sent.bytes
    # With SP, forcing the hidden_states swap is refused before any collective (rank 0 calls alone).
    error = None
    with env_setting("GDN_CP_CHUNKWISE_SWAP", "hidden"):
        config = make_config(2, "chunkwise", torch.float64, tensor_model_parallel_size=2, sequence_parallel=True,
                             linear_cp_thd_split="per_document")  # the rows are cut per document (zigzag_rows)
        module = build_gdn(config, cp_group, tp_group=tp_group)
        cu_pad, cu_act = thd_case(2)
        rows = zigzag_rows(cu_pad, 2, cp_group.rank())
        x = torch.zeros(rows[sp_slice(rows.numel(), 2, tp_group.rank())].numel(), 1, config.hidden_size,
                        dtype=torch.float64)
        if ctx.rank == 0:
            try:
                module(x, None, packed_seq_params=thd_params(cu_pad, cu_act))
            except ValueError as e:
                error = str(e)
    dist.barrier()
    return res, moved, error


def test_chunkwise_swap_points_at_tp2(patched_megatron, rank_pool):
    from gdn_cp.modes import GDNShape
    from gdn_cp.modes.swap import choose_swap_point
    from gdn_cp_testing.megatron.layer import DIMS
    from gdn_cp_testing.megatron.parity import HIDDEN
    from gdn_cp_testing.packings import thd_case

    results = rank_pool(WORLD).run(_swap_points_tp, timeout_s=180)
    parity = [r[0] for r in results]
    assert not _over_tolerance(parity, "swap points"), "\n".join(_over_tolerance(parity, ""))
    t_local = thd_case(2)[0][-1] // 2
    hidden_thd = 4 * t_local * HIDDEN * 8  # hidden_states in and the output back, fwd and bwd, fp64
    # what auto picks for this (small) shape at TP=2: hidden_states without SP, the core with SP
    local = GDNShape(num_k_heads=DIMS["linear_num_key_heads"] // 2, num_v_heads=DIMS["linear_num_value_heads"] // 2,
                     head_k_dim=DIMS["linear_key_head_dim"], head_v_dim=DIMS["linear_value_head_dim"])
    auto = {sp: choose_swap_point(shape=local, hidden_size=HIDDEN, tp=2, sequence_parallel=sp, act_bytes=8).point
            for sp in (False, True)}
    assert auto == {False: "hidden", True: "core"}, auto
    for rank, (_, moved, _) in enumerate(results):
        assert moved[(False, "hidden", "thd")] == moved[(False, "auto", "thd")] == hidden_thd, (rank, moved)
        for key in ((False, "core", "thd"), (True, "core", "thd"), (True, "auto", "thd")):
            assert 0 < moved[key] != hidden_thd, (rank, key, moved)
    error = results[0][2]
    assert error is not None, "the hidden_states swap ran under sequence parallelism"
    for needle in ("GDN_CP_CHUNKWISE_SWAP=hidden", "sequence_parallel=True", "tensor_model_parallel_size=2",
                   "set GDN_CP_CHUNKWISE_SWAP=core"):
        assert needle in error, (needle, error)


# ------------------------------------------------------------------------------------------
# 3. out_norm's gradient through Megatron's DistributedDataParallel and finalize_model_grads
# ------------------------------------------------------------------------------------------
def _finalize_case(ctx, *, stock: bool, sp: bool, layout: str, cp: int, normalization: str = "RMSNorm"):
    """Megatron's own parallel state (TP=2 x CP=cp on 4 ranks, DP = the rest, every DP replica on
    the same data), the layer wrapped in DistributedDataParallel, forward + backward, then
    ``finalize_model_grads``. Returns, per parameter, the error of ``main_grad`` (TP parts
    gathered, divided by DP) against the TP=1 CP=1 gradient, and out_norm.weight's main_grad."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    from gdn_cp_testing.megatron.layer import build_gdn, make_config, rank_groups, stock_forward
    from gdn_cp_testing.megatron.parity import case_inputs, cp1_answer, thd_split_cfg
    from gdn_cp_testing.megatron.tp import gather_tp_grads, sp_slice
    from gdn_cp_testing.megatron.training import megatron_parallel_state
    from gdn_cp.ops.accuracy import max_rel

    # stock 0.19.2's deterministic core is fp32 (SBHD at CP=1 runs it); gdn-cp's path runs fp64
    dtype = torch.float32 if layout == "sbhd" and cp == 1 else torch.float64
    fields = dict(calculate_per_token_loss=True, normalization=normalization)  # DDP sums, no 1/dp scaling
    fields = thd_split_cfg(layout, fields)  # case_inputs cuts THD rows per document
    with megatron_parallel_state(cp, tensor_model_parallel_size=2) as parallel_state:
        tp_group = parallel_state.get_tensor_model_parallel_group()
        cp_group = parallel_state.get_context_parallel_group()
        x, dout, rows, psp = case_inputs(layout, cp, cp_group.rank(), dtype, 0, 32, "cpu")
        if sp:
            rows = rows[sp_slice(rows.numel(), 2, tp_group.rank())]
        base = build_gdn(make_config(1, "chunkwise", dtype, **fields), rank_groups()["self"], seed=1, bias=True,
                         conv_bias=True)
        want = cp1_answer(base, layout, dtype, x, dout, psp)[2]
        config = make_config(cp, "chunkwise", dtype, tensor_model_parallel_size=2, sequence_parallel=sp, **fields)
        module = build_gdn(config, cp_group, tp_group=tp_group, seed=1, bias=True, conv_bias=True)
        model = DistributedDataParallel(config, DistributedDataParallelConfig(), module)
        with stock_forward() if stock else contextlib.nullcontext():
            out, bias = model(x[rows].detach().clone().requires_grad_(True), None, packed_seq_params=psp())
            (out + bias).backward(dout[rows])
        finalize_model_grads([model])
        main = {name: p.main_grad.detach().clone() for name, p in module.named_parameters()}
        full = gather_tp_grads(module, main, tp_group)
        dp = parallel_state.get_data_parallel_world_size()
        errs = {name: max_rel(g / dp, want[name]) for name, g in full.items()}
        return errs, main["out_norm.weight"], str(dtype)


def _finalize_cases(ctx):
    out = {}
    for sp in (False, True):
        out[("stock", sp, "sbhd", 1, "RMSNorm")] = _finalize_case(ctx, stock=True, sp=sp, layout="sbhd", cp=1)
        for layout, cp in (("sbhd", 1), ("thd", 1), ("thd", 2), ("sbhd", 2)):
            out[("gdn-cp", sp, layout, cp, "RMSNorm")] = _finalize_case(ctx, stock=False, sp=sp, layout=layout, cp=cp)
    # LayerNorm: out_norm has a bias, replicated over TP like its weight (Megatron's local norm: SP off)
    out[("stock", False, "sbhd", 1, "LayerNorm")] = _finalize_case(ctx, stock=True, sp=False, layout="sbhd", cp=1,
                                                                   normalization="LayerNorm")
    out[("gdn-cp", False, "sbhd", 1, "LayerNorm")] = _finalize_case(ctx, stock=False, sp=False, layout="sbhd",
                                                                    cp=1, normalization="LayerNorm")
    return out


def test_out_norm_gradient_after_finalize_model_grads(patched_megatron, rank_pool):
    """Stock 0.19.2 at TP=2 without SP: each TP rank's out_norm gradient is its own heads' part and
    finalize_model_grads leaves it so (replicas differ; neither is the TP=1 gradient). With SP, the
    weight is tagged sequence_parallel and finalize sums it. gdn-cp (also on the stock CP=1 SBHD
    code path) sums it over TP in the backward where finalize will not: every parameter's
    main_grad then equals the TP=1 gradient, with SP on (no double sum) and off."""
    results = rank_pool(WORLD).run(_finalize_cases, timeout_s=240)
    for case in results[0]:
        source, sp, layout, cp, norm = case
        per_rank = [r[case] for r in results]
        tol = TOL[torch.float64] if per_rank[0][2] == "torch.float64" else TOL[torch.float32]
        replicas_equal = all(torch.equal(per_rank[r][1], per_rank[r ^ 1][1]) for r in range(WORLD))
        norm_params = [n for n in per_rank[0][0] if n.startswith("out_norm.")]
        assert norm_params == (["out_norm.weight"] if norm == "RMSNorm" else ["out_norm.weight", "out_norm.bias"])
        if source == "stock" and not sp:
            # the bug: both out_norm parameters wrong, TP replicas different; everything else right
            assert not replicas_equal, case
            for errs, _, _ in per_rank:
                assert all(errs[n] > 1e-2 for n in norm_params), (case, errs)
                assert all(v <= tol for n, v in errs.items() if n not in norm_params), (case, errs)
            continue
        assert replicas_equal, case
        for rank, (errs, _, _) in enumerate(per_rank):
            assert all(v <= tol for v in errs.values()) and len(errs) == len(ALL_PARAMS) + len(norm_params) - 1, \
                (case, rank, errs)


def _hook_once(ctx):
    """Steps on one TP=2 layer (stock CP=1 SBHD path twice, gdn-cp's path twice, THD): the out_norm
    gradient sum is installed once, so every step's gradient is the same full gradient."""
    from gdn_cp_testing.inputs import hidden_inputs
    from gdn_cp_testing.megatron.layer import build_gdn, gdn_cp_forward, make_config, run_layer, thd_params
    from gdn_cp_testing.megatron.tp import tp_cp_groups
    from gdn_cp_testing.packings import thd_case

    tp_group, single, _ = tp_cp_groups(2, 1)
    module = build_gdn(make_config(1, "chunkwise", torch.float64, tensor_model_parallel_size=2), single,
                       tp_group=tp_group)
    cu_pad, cu_act = thd_case(1)
    x, dout = hidden_inputs(cu_pad[-1], 1, torch.float64, 3, module.config.hidden_size)
    grads = [run_layer(module, x, dout)[2]["out_norm.weight"] for _ in range(2)]
    with gdn_cp_forward():
        grads += [run_layer(module, x, dout)[2]["out_norm.weight"] for _ in range(2)]
    run_layer(module, x, dout, thd_params(cu_pad, cu_act))
    return [len(module.out_norm.weight._backward_hooks)] + grads


def test_out_norm_gradient_sum_is_installed_once(patched_megatron, rank_pool):
    for rank, (hooks, *grads) in enumerate(rank_pool(WORLD).run(_hook_once)):
        assert hooks == 1, (rank, hooks)
        assert torch.equal(grads[0], grads[1]) and torch.equal(grads[2], grads[3]), rank
        # stock path (fp32 core) == gdn-cp path (fp64): the same sum, not twice it
        assert torch.allclose(grads[0], grads[2], rtol=1e-5, atol=0), rank


# ------------------------------------------------------------------------------------------
# 4. combinations that cannot work fail before any collective
# ------------------------------------------------------------------------------------------
def _bad_dynamic_at_tp2(ctx):
    import torch.distributed as dist

    from gdn_cp_testing.megatron.layer import build_gdn, make_config, thd_params
    from gdn_cp_testing.megatron.tp import tp_cp_groups
    from gdn_cp_testing.packings import thd_case

    tp_group, single, _ = tp_cp_groups(2, 1)
    _, pair, _ = tp_cp_groups(2, 2)
    errors = {}
    for sp in (False, True):
        module = build_gdn(make_config(1, "chunkwise", torch.float64, tensor_model_parallel_size=2,
                                       sequence_parallel=sp), single, tp_group=tp_group)
        cu_pad, cu_act = thd_case(2)
        x = torch.zeros(cu_pad[-1] // 2 // (2 if sp else 1), 1, module.config.hidden_size, dtype=torch.float64)
        bad = {
            "cp_group_is_the_tp_group": dict(cp_group=tp_group, local_cp_size=2),
            "local_cp_size_mismatch": dict(cp_group=pair, local_cp_size=4),
        }
        if ctx.rank == 0:  # alone: a collective before the check would hang the case
            for name, kw in bad.items():
                try:
                    module(x, None, packed_seq_params=thd_params(cu_pad, cu_act, **kw))
                    errors[(name, sp)] = None
                except ValueError as e:
                    errors[(name, sp)] = str(e)
    dist.barrier()
    return errors


def test_bad_dynamic_cp_at_tp2_fails_before_any_collective(patched_megatron, rank_pool):
    errors = rank_pool(WORLD).run(_bad_dynamic_at_tp2, timeout_s=120)[0]
    assert len(errors) == 4, errors
    for sp in (False, True):
        msg = errors[("cp_group_is_the_tp_group", sp)]
        assert msg and "PackedSeqParams.cp_group has ranks [0, 1]" in msg and "tensor-parallel group [0, 1]" in msg, msg
        assert "at most one rank of each TP group" in msg and "tp_rank + 2 * cp_rank" in msg, msg
        msg = errors[("local_cp_size_mismatch", sp)]
        assert msg and "local_cp_size=4" in msg and "cp_group.size()=2" in msg, msg


def test_tp_configs_that_cannot_work_are_refused(patched_megatron):
    from gdn_cp_testing.megatron.layer import install_cpu_shims, make_config

    install_cpu_shims()
    with pytest.raises(ValueError, match="sequence parallelism without tensor parallelism"):
        make_config(1, "chunkwise", torch.float64, sequence_parallel=True)
    for mode in MODES:  # 3 key heads cannot be split over TP=2 in any mode
        with pytest.raises(ValueError, match=rf"linear_cp_mode='{mode}'.*tensor_model_parallel_size=2.*"
                                             r"linear_num_key_heads=3 is not divisible by"):
            make_config(1, mode, torch.float64, tensor_model_parallel_size=2, linear_num_key_heads=3,
                        linear_num_value_heads=6)
