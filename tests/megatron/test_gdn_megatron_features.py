"""The patched megatron-core 0.19.2 GatedDeltaNet's Megatron features under gdn-cp, on gloo CPU ranks:

* heads that headwise cannot split: chunkwise / all_gather equal CP=1; headwise is refused by the
  patched TransformerConfig and (for configs that skip that check, e.g. hybrid models) by the
  forward, before any collective;
* dynamic CP: a micro-batch's PackedSeqParams.cp_group / local_cp_size inside a static CP=4 group;
  bad combinations raise ValueError before any collective;
* the per-micro-batch route cache: built by the first GDN layer, hit by the others;
* selective (gdn_norm_out) and full-layer recompute: same results, routes not rebuilt on replay;
* state_dict / sharded_state_dict identical across modes; a checkpoint crosses modes;
* stock vs patched (headwise, SBHD, CP=2) and THD + deterministic at CP=1 (stock refuses it);
* when the patch hands the call to gdn-cp (the forward returns None for the stock path).
"""

from __future__ import annotations

import io

import pytest
import torch

from gdn_cp_testing.inputs import hidden_inputs
from gdn_cp_testing.megatron.layer import (DIMS, build_gdn, install_cpu_shims, make_config, rank_groups, run_layer,
                                           stock_forward, stock_vs_patched, thd_params)
from gdn_cp_testing.megatron.parity import HIDDEN, MODES, parity_case, sbhd_len
from gdn_cp.ops.accuracy import max_rel
from gdn_cp_testing.packings import thd_case, zigzag_rows
from gdn_cp.ops.accuracy import CP_VS_CP1_MAX_REL as TOL

pytestmark = pytest.mark.megatron

ODD_HEADS = dict(linear_num_key_heads=3, linear_num_value_heads=6)
# _local_thd cuts every document into 2*cp parts itself (no record of Megatron's splitter): say so
PER_DOC = dict(linear_cp_thd_split="per_document")


def _worst(results, key=None):
    """{(case, mode): worst rel err over ranks and quantities}."""
    out = {}
    for per_rank in results:
        for case, per_mode in (per_rank if key is None else per_rank[key]).items():
            for mode, errs in per_mode.items():
                out[(case, mode)] = max(out.get((case, mode), 0.0), max(errs.values()))
    return out


def _local_thd(cp, rank, dtype, seed=5):
    cu_pad, cu_act = thd_case(cp)
    x, dout = hidden_inputs(cu_pad[-1], 1, dtype, seed=seed, hidden=HIDDEN)
    rows = zigzag_rows(cu_pad, cp, rank)
    return cu_pad, cu_act, x[rows], dout[rows]


def _cache_plan(psp):
    cache = psp._gdn_cp_route_cache
    (entry,) = cache._entries.values()  # one (boundaries, cp, rank) per micro-batch here
    return cache, entry[2]


# ------------------------------------------------------------------------------------------
# 2. head counts headwise cannot split
# ------------------------------------------------------------------------------------------
def _odd_heads(ctx):
    import torch.distributed as dist

    import gdn_cp.megatron.call as cfgmod
    from gdn_cp.megatron.layer import reset_settings

    rank, world = ctx.rank, ctx.world_size
    install_cpu_shims()
    res = {"parity": {}}
    for layout in ("sbhd", "thd"):
        res["parity"][layout] = parity_case(rank, world, layout, torch.float64, ("chunkwise", "all_gather"),
                                            cfg=ODD_HEADS)
    try:
        make_config(world, "headwise", torch.float64, **ODD_HEADS)
        res["config_error"] = None
    except ValueError as e:
        res["config_error"] = str(e)

    # The forward checks too (hybrid models never run the config's gated_delta_net checks).
    # Only rank 0 calls: a collective before the check would hang this case.
    module = build_gdn(make_config(world, "chunkwise", torch.float64, **ODD_HEADS, **PER_DOC), rank_groups()["world"])
    cu_pad, cu_act, x, _ = _local_thd(world, rank, torch.float64)
    errors = {}
    if rank == 0:
        for bad in ("headwise", "auto", "blockwise"):
            module.config.linear_cp_mode = bad
            reset_settings(module)  # the layer reads its config again on its next call
            try:
                module(x, None, packed_seq_params=thd_params(cu_pad, cu_act))
                errors[bad] = None
            except ValueError as e:
                errors[bad] = str(e)
    res["forward_errors"] = errors

    # A legal (mode, tp, cp) is validated once per module, then remembered.
    calls = []
    original = cfgmod.check_linear_cp_mode
    cfgmod.check_linear_cp_mode = lambda mode, **kw: (calls.append(mode), original(mode, **kw))[1]
    try:
        module.config.linear_cp_mode = "chunkwise"
        reset_settings(module)
        for _ in range(2):
            module(x, None, packed_seq_params=thd_params(cu_pad, cu_act))
    finally:
        cfgmod.check_linear_cp_mode = original
    res["validations"] = calls
    dist.barrier()
    return res


def test_odd_heads(patched_megatron, rank_pool):
    results = rank_pool(2).run(_odd_heads, timeout_s=120)
    worst = _worst(results, "parity")
    assert all(v <= TOL[torch.float64] for v in worst.values()), worst
    assert set(worst) == {(lay, m) for lay in ("sbhd", "thd") for m in ("chunkwise", "all_gather")}
    msg = results[0]["config_error"]
    assert msg is not None, "TransformerConfig accepted headwise with 3 key heads at CP=2"
    for needle in ("linear_cp_mode='headwise'", "linear_num_key_heads=3", "context_parallel_size=2",
                   "'chunkwise'", "'all_gather'"):
        assert needle in msg, (needle, msg)
    fe = results[0]["forward_errors"]
    assert fe["headwise"] and "linear_num_key_heads=3" in fe["headwise"] and "chunkwise" in fe["headwise"], fe
    assert fe["auto"] and "resolve_linear_cp_mode" in fe["auto"], fe
    assert fe["blockwise"] and "'headwise', 'chunkwise', 'all_gather'" in fe["blockwise"], fe
    for r in results:
        assert r["validations"] == ["chunkwise"], r["validations"]


# ------------------------------------------------------------------------------------------
# 3. dynamic CP
# ------------------------------------------------------------------------------------------
def _dynamic(ctx):
    from megatron.core.packed_seq_params import PackedSeqParams

    rank, world = ctx.rank, ctx.world_size
    install_cpu_shims()
    groups = rank_groups()
    pair, me = groups["pair"], groups["self"]
    res = {"pair": {}, "single": {}}
    for layout in ("sbhd", "thd"):
        # ranks {0,1} and {2,3} each split their own micro-batch (different data) over their pair
        res["pair"][layout] = parity_case(rank, world, layout, torch.float64, MODES, cp_group=pair,
                                          dynamic=True, data_seed=1 + rank // 2)
        # a micro-batch on a group of one rank: no CP (the static group of 4 must not be used)
        res["single"][layout] = parity_case(rank, world, layout, torch.float64, MODES, cp_group=me,
                                            dynamic=True, data_seed=10 + rank)

    # Bad dynamic-CP parameters: ValueError before any collective (only rank 0 calls).
    errors = {}
    if rank == 0:
        module = build_gdn(make_config(world, "chunkwise", torch.float64), groups["world"])
        cu_pad, cu_act = thd_case(2)
        x_thd = torch.zeros(cu_pad[-1] // 2, 1, DIMS["hidden_size"], dtype=torch.float64)
        x_sbhd = torch.zeros(sbhd_len(2) // 2, 2, DIMS["hidden_size"], dtype=torch.float64)
        bad = {
            "size_mismatch": dict(cp_group=pair, local_cp_size=4),
            "group_without_size": dict(cp_group=pair),
            "size_without_group": dict(local_cp_size=2),
        }
        for name, kw in bad.items():
            for layout, x, psp in (("thd", x_thd, thd_params(cu_pad, cu_act, **kw)),
                                   ("sbhd", x_sbhd, PackedSeqParams(qkv_format="sbhd", **kw))):
                try:
                    module(x, None, packed_seq_params=psp)
                    errors[(name, layout)] = None
                except ValueError as e:
                    errors[(name, layout)] = str(e)
    res["errors"] = errors
    import torch.distributed as dist

    dist.barrier()
    return res


def test_dynamic_cp(patched_megatron, rank_pool):
    results = rank_pool(4).run(_dynamic, timeout_s=180)
    for key in ("pair", "single"):
        worst = _worst(results, key)
        assert len(worst) == 6 and all(v <= TOL[torch.float64] for v in worst.values()), (key, worst)
    errors = results[0]["errors"]
    assert len(errors) == 6
    for (name, layout), msg in errors.items():
        assert msg is not None, f"{name} ({layout}) was accepted"
        assert "local_cp_size" in msg and "cp_group" in msg, msg
    assert "local_cp_size=4" in errors[("size_mismatch", "thd")] and "size()=2" in errors[("size_mismatch", "thd")]


# ------------------------------------------------------------------------------------------
# 4. route cache on PackedSeqParams
# ------------------------------------------------------------------------------------------
def _route_cache(ctx):
    from gdn_cp.megatron.call import ROUTE_CACHE_ATTR
    from gdn_cp_testing.probes import plan_builds

    rank, world = ctx.rank, ctx.world_size
    install_cpu_shims()
    group = rank_groups()["world"]
    cu_pad, cu_act, x, dout = _local_thd(world, rank, torch.float64)
    out = {}
    for mode in MODES:
        cfg = make_config(world, mode, torch.float64, **PER_DOC)
        layer1 = build_gdn(cfg, group, seed=1, layer_number=1)
        layer2 = build_gdn(cfg, group, seed=2, layer_number=2)
        psp = thd_params(cu_pad, cu_act)
        assert ROUTE_CACHE_ATTR == "_gdn_cp_route_cache"
        rec = {}
        with plan_builds() as built:  # routes, maps and chunkwise plans built, by every plan
            h1, _ = layer1(x.clone().requires_grad_(True), None, packed_seq_params=psp)
            cache, plan = _cache_plan(psp)
            rec["after_layer1"] = (cache.hits, cache.misses, built.total)
            h2, _ = layer2(h1, None, packed_seq_params=psp)
            cache2, plan2 = _cache_plan(psp)
            rec["same_plan"] = cache2 is cache and plan2 is plan
            rec["after_layer2"] = (cache.hits, cache.misses, built.total)
            h2.backward(dout)
            rec["after_backward"] = (cache.hits, cache.misses, built.total)
            rec["plan_cp"] = (plan.cp_size, plan.cp_rank, plan.t_global)

            fresh = thd_params(cu_pad, cu_act)  # the next micro-batch: same values, new object
            layer1(x, None, packed_seq_params=fresh)
            fcache, fplan = _cache_plan(fresh)
            # the fresh plan builds what the first one did; the first one is left as it was
            rec["fresh"] = (fcache is not cache, fplan is not plan, fcache.hits, fcache.misses, built.total)
            rec["old_untouched"] = (cache.hits, cache.misses)

        psp.cu_seqlens_q_padded.add_(0)  # an in-place write (same values) bumps _version: rebuild
        layer1(x, None, packed_seq_params=psp)
        rec["after_inplace"] = (cache.hits, cache.misses)
        out[mode] = rec
    return out


def test_route_cache(patched_megatron, rank_pool):
    for rank, per_mode in enumerate(rank_pool(2).run(_route_cache)):
        for mode, rec in per_mode.items():
            hits, misses, builds = rec["after_layer1"]
            assert (hits, misses) == (0, 1) and builds > 0, (rank, mode, rec)
            assert rec["same_plan"], (rank, mode, rec)
            assert rec["after_layer2"] == (1, 1, builds), (rank, mode, rec)
            assert rec["after_backward"] == (1, 1, builds), (rank, mode, rec)
            assert rec["plan_cp"] == (2, rank, thd_case(2)[0][-1]), (rank, mode, rec)
            assert rec["fresh"] == (True, True, 0, 1, 2 * builds), (rank, mode, rec)
            assert rec["old_untouched"] == (1, 1), (rank, mode, rec)
            assert rec["after_inplace"] == (1, 2), (rank, mode, rec)


# ------------------------------------------------------------------------------------------
# 5. recompute
# ------------------------------------------------------------------------------------------
def _recompute(ctx):
    from megatron.core import tensor_parallel

    from gdn_cp_testing.probes import plan_builds

    rank, world = ctx.rank, ctx.world_size
    install_cpu_shims()
    group = rank_groups()["world"]
    selective = dict(recompute_granularity="selective", recompute_modules=["gdn_norm_out"])
    out = {}
    for layout in ("thd", "sbhd"):
        if layout == "thd":
            cu_pad, cu_act, x, dout = _local_thd(world, rank, torch.float64)
            psp = lambda: thd_params(cu_pad, cu_act)  # noqa: E731
        else:
            s = sbhd_len(world)
            x, dout = hidden_inputs(s, 2, torch.float64, seed=9, hidden=HIDDEN)
            rows = zigzag_rows([0, s], world, rank)
            x, dout = x[rows], dout[rows]
            psp = lambda: None  # noqa: E731
        for mode in MODES:
            rec = {}
            plain = build_gdn(make_config(world, mode, torch.float64, **PER_DOC), group)
            want = run_layer(plain, x, dout, psp())

            sel = build_gdn(make_config(world, mode, torch.float64, **selective, **PER_DOC), group)
            assert sel.recompute_norm_out
            got = run_layer(sel, x, dout, psp())
            rec["selective_bitwise"] = _bitwise(got, want)
            rec["selective_replayed"] = sel.norm_out_checkpoint is not None and sel.norm_out_checkpoint.ctx is None

            # full-layer recompute, as Megatron's full recompute wraps a layer
            full = build_gdn(make_config(world, mode, torch.float64, **PER_DOC), group)
            p = psp()
            x_leaf = x.clone().requires_grad_(True)
            with plan_builds() as built:
                y = tensor_parallel.checkpoint(lambda h: full(h, None, packed_seq_params=p)[0], False, x_leaf)
                before = _route_state(full, p, built)
                y.backward(dout)
                after = _route_state(full, p, built)
            grads = {n: q.grad for n, q in full.named_parameters()}
            rec["full_bitwise"] = _bitwise((y.detach(), x_leaf.grad, grads), want)
            rec["full_routes"] = (before, after)
            out[(layout, mode)] = rec
    return out


def _route_state(module, psp, built):
    if psp is not None:
        cache, _ = _cache_plan(psp)
        return ("thd", cache.hits, cache.misses, built.total)
    from gdn_cp.megatron.layer import layer_state

    plans = layer_state(module).sbhd_plans
    return ("sbhd", len(plans), built.total, tuple(id(p) for p in plans.values()))


def _bitwise(got, want):
    """Names of the quantities that differ (an empty list: bit-identical)."""
    (y, gx, grads), (wy, wgx, wgrads) = got, want
    diff = [n for n, a, b in (("out", y, wy), ("grad:hidden_states", gx, wgx)) if not torch.equal(a, b)]
    diff += [n for n in wgrads if grads[n] is None or not torch.equal(grads[n], wgrads[n])]
    return diff


def test_recompute(patched_megatron, rank_pool):
    for rank, per_case in enumerate(rank_pool(2).run(_recompute)):
        assert len(per_case) == 6
        for case, rec in per_case.items():
            assert rec["selective_bitwise"] == [], (rank, case, rec)
            assert rec["selective_replayed"], (rank, case, "gdn_norm_out recompute did not run")
            assert rec["full_bitwise"] == [], (rank, case, rec)
            before, after = rec["full_routes"]
            if before[0] == "thd":  # the replay hits the micro-batch's plan: no miss, no build
                assert after == ("thd", before[1] + 1, before[2], before[3]), (rank, case, before, after)
            else:
                assert after == before, (rank, case, before, after)


# ------------------------------------------------------------------------------------------
# 6. checkpoints across modes
# ------------------------------------------------------------------------------------------
def _state_dicts(ctx):
    rank, world = ctx.rank, ctx.world_size
    install_cpu_shims()
    group = rank_groups()["world"]
    cu_pad, cu_act, x, _ = _local_thd(world, rank, torch.float64)
    res = {"sd": {}, "sharded": {}, "sharded_error": None}
    modules = {m: build_gdn(make_config(world, m, torch.float64, **PER_DOC), group, seed=3, conv_bias=True)
               for m in MODES}
    for mode, module in modules.items():
        sd = module.state_dict()
        res["sd"][mode] = {k: (tuple(v.shape), v.dtype, v.clone()) for k, v in sd.items() if torch.is_tensor(v)}
        res["sd_nontensor"] = sorted(k for k, v in sd.items() if not torch.is_tensor(v))
        try:
            ssd = module.sharded_state_dict(prefix="decoder.layers.0.self_attention.",
                                            metadata={"dp_cp_group": group})
            res["sharded"][mode] = _describe_sharded(ssd)
        except Exception as e:  # noqa: BLE001 - reported (the test requires it to work)
            res["sharded_error"] = f"{type(e).__name__}: {e}"

    # save in one mode, load into another (different weights before loading): same output
    crossed = {}
    for src in MODES:
        buf = io.BytesIO()
        torch.save(modules[src].state_dict(), buf)
        want, _ = modules[src](x, None, packed_seq_params=thd_params(cu_pad, cu_act))
        for dst in MODES:
            if dst == src:
                continue
            target = build_gdn(make_config(world, dst, torch.float64, **PER_DOC), group, seed=77, conv_bias=True)
            buf.seek(0)
            missing = target.load_state_dict(torch.load(buf), strict=True)
            got, _ = target(x, None, packed_seq_params=thd_params(cu_pad, cu_act))
            crossed[(src, dst)] = (max_rel(got.detach(), want.detach()), list(missing.missing_keys))
    res["crossed"] = crossed
    return res


def _describe_sharded(ssd):
    out = {}
    for key, item in ssd.items():
        items = item.build() if hasattr(item, "build") and not hasattr(item, "global_shape") else item
        if not isinstance(items, dict):
            items = {key: items}
        for sub_key, sh in items.items():
            out[(key, sub_key)] = (type(sh).__name__, getattr(sh, "key", None),
                                   tuple(getattr(sh, "local_shape", ()) or ()),
                                   tuple(getattr(sh, "global_shape", ()) or ()),
                                   tuple(getattr(sh, "global_offset", ()) or ()),
                                   tuple(getattr(sh, "axis_fragmentations", ()) or ()),
                                   repr(getattr(sh, "replica_id", None)))
    return out


def test_state_dict_same_in_every_mode(patched_megatron, rank_pool):
    for rank, res in enumerate(rank_pool(2).run(_state_dicts)):
        assert res["sharded_error"] is None, res["sharded_error"]
        ref = res["sd"]["headwise"]
        assert {"in_proj.weight", "conv1d.weight", "conv1d.bias", "A_log", "dt_bias", "out_norm.weight",
                "out_proj.weight"} <= set(ref), sorted(ref)
        for mode in MODES:
            sd = res["sd"][mode]
            assert sorted(sd) == sorted(ref), (mode, sorted(sd), sorted(ref))
            for k in ref:
                assert sd[k][:2] == ref[k][:2] and torch.equal(sd[k][2], ref[k][2]), (mode, k)
            assert res["sharded"][mode] == res["sharded"]["headwise"], mode
        assert res["sharded"]["headwise"], "empty sharded_state_dict"
        for (src, dst), (err, missing) in res["crossed"].items():
            assert missing == [] and err <= TOL[torch.float64], (rank, src, dst, err, missing)


# ------------------------------------------------------------------------------------------
# 7. stock vs patched; 8. THD + deterministic at CP=1; when the forward hands over
# ------------------------------------------------------------------------------------------
def _stock_vs_patched(ctx):
    rank, world = ctx.rank, ctx.world_size
    install_cpu_shims()
    group = rank_groups()["world"]
    s = sbhd_len(world)
    x, dout = hidden_inputs(s, 2, torch.float32, seed=13, hidden=HIDDEN)
    rows = zigzag_rows([0, s], world, rank)
    x, dout = x[rows], dout[rows]
    res = {}
    for conv_bias in (False, True):
        module = build_gdn(make_config(world, "headwise", torch.float32), group, seed=4, conv_bias=conv_bias)
        res[conv_bias] = stock_vs_patched(module, x, dout, group, max_rel)
    return res


def test_stock_vs_patched_headwise(patched_megatron, rank_pool):
    """fp32, rounding level (<= 1e-5): not bit-equal, because stock's deterministic core is
    torch_chunk_gated_delta_rule and gdn-cp's is the reference backend (same math, different
    summation order; the conv is F.conv1d vs the reference's unfolded conv)."""
    for rank, res in enumerate(rank_pool(2).run(_stock_vs_patched)):
        for conv_bias, errs in res.items():
            assert len(errs) >= 8
            bad = {k: v for k, v in errs.items() if not v <= TOL[torch.float32]}
            assert not bad, (rank, conv_bias, bad)


def _thd_cp1_and_dispatch(ctx):
    from megatron.core.packed_seq_params import PackedSeqParams

    from gdn_cp_testing.stand_ins import handed_over

    def dispatches(module, psp):
        return handed_over(module, torch.zeros(4, 1, HIDDEN), psp) is not None

    rank, world = ctx.rank, ctx.world_size
    install_cpu_shims()
    groups = rank_groups()
    res = {}
    # THD + deterministic at CP=1 vs stock on each sequence (SBHD [L, 1, H], stock path)
    cu_pad, cu_act = thd_case(2)
    module = build_gdn(make_config(1, "headwise", torch.float32), groups["self"], seed=6, conv_bias=True)
    x, dout = hidden_inputs(cu_pad[-1], 1, torch.float32, seed=21 + rank, hidden=HIDDEN)
    psp = thd_params(cu_pad, cu_act)
    got = run_layer(module, x, dout, psp)
    ys, gxs, grads = [], [], {}
    for a, b in zip(cu_pad[:-1], cu_pad[1:]):
        if a == b:
            continue
        assert not dispatches(module, None)
        y, gx, g = run_layer(module, x[a:b], dout[a:b])
        ys.append(y)
        gxs.append(gx)
        for n, v in g.items():
            grads[n] = v if n not in grads else grads[n] + v
    errs = {"out": max_rel(got[0], torch.cat(ys)), "grad:hidden_states": max_rel(got[1], torch.cat(gxs))}
    errs.update({f"grad:{n}": max_rel(got[2][n], grads[n]) for n in grads})
    res["thd_cp1"] = errs
    try:
        with stock_forward():
            module(x, None, packed_seq_params=thd_params(cu_pad, cu_act))
        res["stock_thd_error"] = None
    except AssertionError as e:
        res["stock_thd_error"] = str(e)

    cp1 = module
    cp2 = build_gdn(make_config(world, "chunkwise", torch.float32), groups["world"])
    sbhd = PackedSeqParams(qkv_format="sbhd")
    res["dispatch"] = {
        "cp1_none": dispatches(cp1, None),
        "cp1_sbhd_params": dispatches(cp1, sbhd),
        "cp1_thd": dispatches(cp1, thd_params(cu_pad, cu_act)),
        "cp2_none": dispatches(cp2, None),
        "cp2_thd": dispatches(cp2, thd_params(cu_pad, cu_act)),
        "cp2_dynamic_single": dispatches(
            cp2, PackedSeqParams(qkv_format="sbhd", cp_group=groups["self"], local_cp_size=1)),
        "cp1_dynamic_pair": dispatches(
            cp1, PackedSeqParams(qkv_format="sbhd", cp_group=groups["world"], local_cp_size=world)),
    }
    return res


def test_thd_deterministic_cp1_and_dispatch(patched_megatron, rank_pool):
    for rank, res in enumerate(rank_pool(2).run(_thd_cp1_and_dispatch)):
        bad = {k: v for k, v in res["thd_cp1"].items() if not v <= TOL[torch.float32]}
        assert not bad and len(res["thd_cp1"]) >= 8, (rank, res["thd_cp1"])
        assert res["stock_thd_error"] and "deterministic" in res["stock_thd_error"], res["stock_thd_error"]
        assert res["dispatch"] == {
            "cp1_none": False, "cp1_sbhd_params": False, "cp1_thd": True, "cp2_none": True, "cp2_thd": True,
            "cp2_dynamic_single": True, "cp1_dynamic_pair": True,
        }, res["dispatch"]
