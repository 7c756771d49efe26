"""FLA backend on CUDA: against the fp64 reference at CP=1, and FLA's native chunkwise CP at cp=2/4
(gloo ranks on one GPU, or NCCL with one GPU per rank) against the same at CP=1: the cp context
cores alone, and the chunkwise mode (``gdn_core``) through both exchange paths (``native``: FLA's cp
context, contiguous or, on FLA >= 0.6 where the rows are one zigzag-cut stream, zigzag with no
layout all-to-all; ``generic``: gdn-cp's own exchange).

Every test here is marked ``gpu`` and skipped without CUDA + flash-linear-attention (the FLA
backend's input checks, which run anywhere, are in tests/ops/test_fla_checks.py). Measured errors
are appended as JSON lines to the file named by ``GDN_CP_GPU_RESULTS`` (the device suite writes it
into $OUT; docs/performance.md quotes it).

Tolerances (relative L2 = ||a-b|| / ||b||, i.e. normalized RMS; gdn_cp.ops.accuracy):
  FLA vs fp64 reference: fp32 <= 5e-3, bf16 <= 1e-2 (outputs and gradients).
  chunkwise cp=N vs CP=1 (same backend): fp32 <= 1e-4; bf16 <= 2e-3 outputs, <= 1e-2 gradients.
"""

from __future__ import annotations

import time

import pytest
import torch

from gdn_cp.layout import Boundaries
from gdn_cp.ops import GDNShape
from gdn_cp.ops import get_backend
from gdn_cp.ops.fla import native_cp
from gdn_cp.ops.fla.detect import fla_available
from gdn_cp.cli.selftest import compare, conv_case, gdn_case
from gdn_cp_testing.inputs import fla_core_inputs
from gdn_cp.ops.accuracy import max_rel, rel_l2
from gdn_cp_testing.ranks import maybe_fast_autotune
from gdn_cp_testing.probes import count_syncs
from gdn_cp_testing.results import JsonlRecorder
from gdn_cp_testing.compare import gather_rows
from gdn_cp.ops.accuracy import FLA_CP_CEILING_REL_L2 as CEILING
from gdn_cp.ops.accuracy import FLA_CP_VS_CP1_REL_L2 as CP_TOL
from gdn_cp.ops.accuracy import FLA_VS_FP64_REL_L2 as TOLERANCES

fla_backend = get_backend("fla")  # the kernels' module loads (torch), FLA itself on a kernel's first call

FAST_AUTOTUNE = maybe_fast_autotune()  # opt-in, test-only: GDN_CP_TEST_FAST_AUTOTUNE=1

GPU_OK = torch.cuda.is_available() and fla_available()
needs_gpu = pytest.mark.skipif(not GPU_OK, reason="needs CUDA + flash-linear-attention")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# CP_TOL / CEILING (gdn_cp.ops.accuracy): a tensor over CP_TOL still passes when CP is as
# accurate as CP=1 against fp64 (<= 1.1x CP=1's error + 1e-4) and within CEILING of CP=1; the record
# keeps issue_targets_met=False for it. Measured on an H200 (run of 2026-11-29, docs/performance.md):
# bf16 packed cp=4 output rel-L2 2.13e-3 against CP=1, both 4.2e-3 from fp64; fp32 packed cp=2 dg
# 1.26e-4, dbeta 1.03e-4 against CP=1, both 1.45e-3 / 1.88e-3 from fp64.

# T_global = 512 (128 rows per rank at cp=4, 256 at cp=2), W = 4.
# "packed": an empty segment; seq 3 = [126, 300) has 2 (= W-2) rows on rank 0 of cp=4, covers rank 1
# and ends on rank 2 (spans 3 ranks); seq 5 = [383, 450) has 1 row on rank 2 and continues on rank 3.
CHUNKWISE_CASES = {
    "packed": [0, 37, 37, 126, 300, 383, 450, 512],
    "single": [0, 512],
    "aligned": [0, 128, 256, 512],
}
# Per-document zigzag needs every length divisible by 2*cp (8 at cp=4): the chunkwise mode's own case.
MODE_ONLY_CASES = {"docs8": [0, 40, 40, 128, 304, 384, 448, 512]}
ALL_CASES = {**CHUNKWISE_CASES, **MODE_ONLY_CASES}
DIMS = dict(num_k_heads=2, num_v_heads=4, head_k_dim=64, head_v_dim=64)
SHAPE = GDNShape(**DIMS)
CONV_W = 4


_record = JsonlRecorder.from_env("GDN_CP_GPU_RESULTS", fast_autotune=FAST_AUTOTUNE).record


# ------------------------------------------------------------------------------------------
# chunkwise: FLA's native CP at cp=2/4 against CP=1
# ------------------------------------------------------------------------------------------

def _leaves(inp: dict, dtype: torch.dtype, device, rows=None) -> dict:
    sl = rows if rows is not None else slice(None)
    cast = {"qkv": dtype, "g": torch.float32, "beta": dtype, "w": dtype, "b": dtype}
    return {k: (inp[k][sl] if k in ("qkv", "g", "beta") else inp[k]).to(device=device, dtype=cast[k])
            .detach().requires_grad_(True) for k in cast}


def _fwd_bwd(t: dict, do: torch.Tensor, cu, group, cache=None):
    o = native_cp.cp_context_core(
        t["qkv"], t["g"], t["beta"], t["w"], t["b"], shape=SHAPE, cu_seqlens_global=cu, group=group, cache=cache)
    (o.float() * do).sum().backward()
    return o


def _grads(t: dict) -> dict:
    return {f"d{k}": v.grad.detach().cpu() for k, v in t.items()}


def _rank_chunkwise(rctx, inp: dict, cu: list[int], dtype: str, cp: int, check_syncs: bool = False):
    """One rank of a cp-sized group: its contiguous slice, forward + backward (+ sync count)."""
    import torch.distributed as dist

    group = rctx.group(cp)
    r = dist.get_rank(group)
    part = cu[-1] // cp
    rows = slice(r * part, (r + 1) * part)
    dev = rctx.device
    cu = Boundaries(cu)  # one boundaries object per micro-batch, as a plan holds it
    cache: dict = {}
    do = inp["do"][rows].to(dev)
    t = _leaves(inp, DTYPES[dtype], dev, rows)
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    o = _fwd_bwd(t, do, cu, group, cache)
    torch.cuda.synchronize(dev)
    out = {"o": o.detach().cpu(), **_grads(t), "first_call_s": time.perf_counter() - t0}
    if check_syncs:
        entry = cache.get(native_cp._CACHE_KEY)
        ctx_before = entry.ctx if entry is not None else None
        t2 = _leaves(inp, DTYPES[dtype], dev, rows)
        n_coll = rctx.collective_count()
        o2, syncs = count_syncs(lambda: _fwd_bwd(t2, do, cu, group, cache))
        torch.cuda.synchronize(dev)
        out["sync_warnings"] = len(syncs)
        out["sync_messages"] = syncs[:3]
        out["collectives_second_call"] = rctx.collective_count() - n_coll
        out["context_reused"] = cache.get(native_cp._CACHE_KEY).ctx is ctx_before
        out["second_call_equal"] = bool(torch.equal(o2.detach().cpu(), out["o"]))
        # The strict form (error on the first sync) only when no rank of the group saw a sync:
        # a rank raising between two collectives would leave the others waiting.
        seen = torch.tensor([len(syncs)], device=dev, dtype=torch.float32)
        dist.all_reduce(seen, group=group)
        if seen.item() == 0:
            t3 = _leaves(inp, DTYPES[dtype], dev, rows)
            torch.cuda.set_sync_debug_mode("error")
            try:
                _fwd_bwd(t3, do, cu, group, cache)
                out["error_mode_ok"] = True
            except RuntimeError as exc:
                out["error_mode_ok"] = f"{exc}"[:300]
            finally:
                torch.cuda.set_sync_debug_mode(0)
        else:
            out["error_mode_ok"] = "skipped: the group saw syncs in warn mode"
    return out


def _rank_validation(rctx, cu: list[int], local_rows: int, cp: int):
    """Bad layouts must fail on every rank before any collective (so nothing hangs)."""
    group = rctx.group(cp)
    Hk, Hv, Dk, Dv = DIMS["num_k_heads"], DIMS["num_v_heads"], DIMS["head_k_dim"], DIMS["head_v_dim"]
    C = 2 * Hk * Dk + Hv * Dv
    dev = rctx.device
    n0 = rctx.collective_count()
    try:
        native_cp.cp_context_core(
            torch.zeros(local_rows, C, device=dev), torch.zeros(local_rows, Hv, device=dev),
            torch.zeros(local_rows, Hv, device=dev), torch.zeros(C, CONV_W, device=dev), None,
            shape=SHAPE, group=group, cu_seqlens_global=cu)
    except ValueError as exc:
        return {"error": str(exc), "collectives": rctx.collective_count() - n0}
    return {"error": None, "collectives": rctx.collective_count() - n0}


@pytest.fixture(scope="module")
def cuda_pool(rank_pool):
    """The session's 4-rank CUDA pool (gloo ranks on one GPU, or NCCL with 4 GPUs)."""
    if not GPU_OK:
        pytest.skip("needs CUDA + flash-linear-attention")
    p = rank_pool(4, device="cuda")
    _record("pool", backend=p.backend, one_gpu=p.one_gpu, world=p.world_size, startup_s=round(p.startup_s, 2))
    return p


_BASELINES: dict = {}


def _baseline(case: str, dtype: str):
    """CP=1 on the FLA backend (and the fp64 reference composition) for a chunkwise case."""
    key = (case, dtype)
    if key not in _BASELINES:
        from gdn_cp.ops import get_backend

        reference = get_backend("reference")

        cu = ALL_CASES[case]
        inp = fla_core_inputs(cu[-1], **DIMS, width=CONV_W)
        dev = torch.device("cuda")
        t = _leaves(inp, DTYPES[dtype], dev)
        o = _fwd_bwd(t, inp["do"].to(dev), cu, None)
        fla1 = {"o": o.detach().cpu(), **_grads(t)}
        # fp64 reference composition on the same (rounded) inputs
        r = {k: v.detach().double().requires_grad_(True) for k, v in t.items()}
        Hk, Hv, Dk, Dv = DIMS["num_k_heads"], DIMS["num_v_heads"], DIMS["head_k_dim"], DIMS["head_v_dim"]
        x = reference.causal_conv1d(r["qkv"], r["w"], r["b"], cu_seqlens=cu, activation="silu")
        q, k, v = x.split([Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
        T = cu[-1]
        o_ref, _ = reference.chunk_gated_delta_rule(
            q.reshape(T, Hk, Dk), k.reshape(T, Hk, Dk), v.reshape(T, Hv, Dv), r["g"], r["beta"], cu_seqlens=cu)
        (o_ref * inp["do"].to(dev).double()).sum().backward()
        ref = {"o": o_ref.detach().cpu(), **_grads(r)}
        _BASELINES[key] = (inp, fla1, ref)
    return _BASELINES[key]


def _gather_cp(results: list, cp: int, group_start: int) -> dict:
    mine = results[group_start:group_start + cp]
    out = {k: torch.cat([m[k] for m in mine]) for k in ("o", "dqkv", "dg", "dbeta")}
    for k in ("dw", "db"):  # parameter gradients: per-rank partial sums
        out[k] = torch.stack([m[k].double() for m in mine]).sum(0)
    return out


def _judge(got_by_group: list[dict], fla1: dict, ref: dict, dtype: str):
    """``(failures, targets_met, errs, maxes, ref_errs, cp1_ref_errs)`` of CP results (one dict per
    group) against CP=1 (``fla1``) and the fp64 reference, with the CEILING rule above."""
    cp1_ref_errs = {k: rel_l2(fla1[k], ref[k]) for k in fla1}
    tol = CP_TOL[dtype]
    errs, maxes, ref_errs = {}, {}, {}
    failures = []
    targets_met = True
    for gi, got in enumerate(got_by_group):
        for k, a in got.items():
            e = rel_l2(a, fla1[k])
            errs[f"g{gi}:{k}"] = e
            maxes[f"g{gi}:{k}"] = max_rel(a, fla1[k])
            lim = tol["out"] if k == "o" else tol["grad"]
            e_ref = rel_l2(a, ref[k])
            if gi == 0:
                ref_errs[k] = e_ref
            if e > lim:
                targets_met = False
                parity = e_ref <= 1.1 * cp1_ref_errs[k] + 1e-4
                if e <= CEILING[dtype] and parity:
                    continue  # see CEILING
                failures.append(f"group {gi} {k}: rel-L2 {e:.3e} > {lim:.0e} (vs fp64: CP {e_ref:.3e}, "
                                f"CP=1 {cp1_ref_errs[k]:.3e})")
    ref_tol = TOLERANCES[dtype]
    for k, e in ref_errs.items():
        if e > ref_tol:
            failures.append(f"vs fp64 reference {k}: rel-L2 {e:.3e} > {ref_tol:.0e}")
    return failures, targets_met, errs, maxes, ref_errs, cp1_ref_errs


def _check_chunkwise(cuda_pool, case, dtype, cp):
    cu = CHUNKWISE_CASES[case]
    inp, fla1, ref = _baseline(case, dtype)
    t0 = time.perf_counter()
    results = cuda_pool.run(_rank_chunkwise, inp, cu, dtype, cp)
    seconds = time.perf_counter() - t0
    got = [_gather_cp(results, cp, gstart) for gstart in range(0, cuda_pool.world_size, cp)]
    failures, targets_met, errs, maxes, ref_errs, cp1_ref_errs = _judge(got, fla1, ref, dtype)
    _record("chunkwise_cp_vs_cp1", case=case, dtype=dtype, cp=cp, backend=cuda_pool.backend,
            ok=not failures, issue_targets_met=targets_met, rel_l2=errs, max_rel=maxes,
            rel_l2_vs_fp64_reference=ref_errs, cp1_rel_l2_vs_fp64_reference=cp1_ref_errs,
            seconds=round(seconds, 2), first_call_s=[round(r["first_call_s"], 3) for r in results])
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype,cp", [("float32", 2), ("float32", 4), ("bfloat16", 2), ("bfloat16", 4)])
def test_chunkwise_fla_cp_matches_cp1_packed(cuda_pool, dtype, cp):
    _check_chunkwise(cuda_pool, "packed", dtype, cp)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("cp", [2, 4])
def test_chunkwise_second_call_makes_no_sync(cuda_pool, cp):
    cu = CHUNKWISE_CASES["packed"]
    inp, _, _ = _baseline("packed", "bfloat16")
    results = cuda_pool.run(_rank_chunkwise, inp, cu, "bfloat16", cp, check_syncs=True)
    summary = [{k: r[k] for k in ("sync_warnings", "sync_messages", "collectives_second_call",
                                    "context_reused", "second_call_equal", "error_mode_ok")}
               for r in results]
    _record("zero_sync", cp=cp, backend=cuda_pool.backend, ranks=summary)
    for r, s in enumerate(summary):
        assert s["sync_warnings"] == 0, f"rank {r}: {s}"
        assert s["error_mode_ok"] is True, f"rank {r}: {s}"
        assert s["context_reused"], f"rank {r}: FLA CP context was rebuilt on the second call"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("cu,local_rows,cp,match", [
    ([0, 100, 510], 127, 4, "not divisible by 4"),
    ([0, 3, 8], 2, 4, "each rank holds 2 rows"),
    ([0, 512], 100, 4, "holds 100 rows"),
])
def test_chunkwise_bad_layout_fails_before_any_collective(cuda_pool, cu, local_rows, cp, match):
    results = cuda_pool.run(_rank_validation, cu, local_rows, cp)
    for r, res in enumerate(results):
        assert res["error"] is not None and match in res["error"], f"rank {r}: {res}"
        assert res["collectives"] == 0, f"rank {r} made {res['collectives']} collectives before failing"


# ------------------------------------------------------------------------------------------
# CP=1: FLA vs the fp64 reference backend
# ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("op", ["conv", "gdn"])
def test_fla_vs_reference_cp1(op, dtype):
    from gdn_cp.ops import get_backend

    reference = get_backend("reference")

    fn = conv_case if op == "conv" else gdn_case
    t0 = time.perf_counter()
    pairs = fn(fla_backend, reference, dtype=DTYPES[dtype], device=torch.device("cuda"), seed=1)
    torch.cuda.synchronize()
    res = compare(f"fla/{op}/{dtype}", pairs, TOLERANCES[dtype], time.perf_counter() - t0)
    _record("fla_vs_reference", op=op, dtype=dtype, ok=res.ok, tol=res.tolerance, rel_l2=res.errors,
            max_rel=res.max_errors, seconds=round(res.seconds, 2))
    assert res.ok, res.line() + f"\nerrors: {res.errors}"


@pytest.mark.gpu
@needs_gpu
def test_selftest_passes_on_this_gpu():
    from gdn_cp.cli.selftest import run_selftest

    t0 = time.perf_counter()
    rep = run_selftest(gpu=True)
    _record("selftest", ok=rep.ok, seconds=round(time.perf_counter() - t0, 2), report=str(rep),
            versions=rep.versions)
    assert rep.ok, str(rep)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", [c for c in CHUNKWISE_CASES if c != "packed"])
def test_chunkwise_fla_cp_matches_cp1_other_layouts(cuda_pool, case, dtype, cp):
    _check_chunkwise(cuda_pool, case, dtype, cp)


# ------------------------------------------------------------------------------------------
# the chunkwise mode (gdn_core) through both exchange paths, against CP=1
# ------------------------------------------------------------------------------------------

# (case, split, row layout): which rows each rank feeds gdn_core (zigzag rows, its one layout).
# Those of a per-document split are routed to the contiguous layout; one zigzag-cut stream (a
# whole-row split, or a single sequence) goes to FLA >= 0.6's zigzag cp context as it is. (The
# chunkwise swap at hidden_states, contiguous rows through the layer, is the Megatron GPU parity's.)
MODE_CASES = [
    ("docs8", "per_document", "zigzag"),
    ("packed", "whole_row", "zigzag"),
    ("single", "per_document", "zigzag"),
]


def _rank_mode_cases(rctx, inputs: dict, dtype: str, cp: int, path: str):
    """Every MODE_CASES entry through ``gdn_core(mode="chunkwise")`` with the chunkwise path set to
    ``path``, on this rank's rows; per case: outputs, gradients, the rows, what ran."""
    import torch.distributed as dist

    from gdn_cp.layout import RouteCache
    from gdn_cp.modes import CallContext, Settings, gdn_core, prepare_mode
    from gdn_cp_testing.packings import zigzag_rows

    group = rctx.group(cp)
    r = dist.get_rank(group)
    dev = rctx.device
    out = {}
    for case, split, layout in MODE_CASES:
        inp = inputs[case]
        cu = ALL_CASES[case]
        plan = RouteCache().plan(cu, cp, r, split=split)
        rows = zigzag_rows(cu, cp, r, whole_row=split == "whole_row")
        t = _leaves(inp, DTYPES[dtype], dev, rows)
        a2a_before = rctx.collectives.get("all_to_all_single", 0)
        o = gdn_core(t["qkv"], t["g"], t["beta"], t["w"], t["b"], shape=SHAPE, mode="chunkwise", plan=plan,
                     group=group, backend=fla_backend, chunkwise_path=path)
        (o.float() * inp["do"][rows].to(dev)).sum().backward()
        call = CallContext(settings=Settings(mode="chunkwise", chunkwise_path=path), shape=SHAPE, plan=plan,
                           group=group, backend=fla_backend)
        out[f"{case}/{split}/{layout}"] = {
            "o": o.detach().cpu(), **_grads(t), "rows": rows, "path": prepare_mode(call).path,
            "all_to_alls": rctx.collectives.get("all_to_all_single", 0) - a2a_before,
        }
    return out


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("path", ["native", "generic"])
def test_chunkwise_mode_paths_match_cp1(cuda_pool, path, cp):
    from gdn_cp.ops.fla.detect import has_zigzag_layout

    dtype = "bfloat16"
    inputs = {case: _baseline(case, dtype)[0] for case in {c for c, _, _ in MODE_CASES}}
    results = cuda_pool.run(_rank_mode_cases, inputs, dtype, cp, path)
    failures = []
    for case, split, layout in MODE_CASES:
        key = f"{case}/{split}/{layout}"
        _, fla1, ref = _baseline(case, dtype)
        got = [gather_rows(results, key, cp, g, ALL_CASES[case][-1])
               for g in range(0, cuda_pool.world_size, cp)]
        bad, targets_met, errs, maxes, ref_errs, cp1_ref_errs = _judge(got, fla1, ref, dtype)
        ran = {res[key]["path"] for res in results}
        a2a = [res[key]["all_to_alls"] for res in results]
        one_stream = split == "whole_row" or case == "single"
        want = path if path == "generic" or not (one_stream and layout == "zigzag" and has_zigzag_layout()) \
            else "native-zigzag"
        _record("chunkwise_mode_path_vs_cp1", case=case, split=split, layout=layout, path=path, ran=sorted(ran),
                dtype=dtype, cp=cp, backend=cuda_pool.backend, ok=not bad, issue_targets_met=targets_met,
                rel_l2=errs, max_rel=maxes, rel_l2_vs_fp64_reference=ref_errs,
                cp1_rel_l2_vs_fp64_reference=cp1_ref_errs, all_to_alls=a2a)
        failures += [f"{key}: {b}" for b in bad]
        if ran != {want}:
            failures.append(f"{key}: ran {sorted(ran)}, expected {want}")
        if want == "native-zigzag" and any(a2a):
            failures.append(f"{key}: the zigzag path made all-to-alls {a2a}")
    assert not failures, "\n".join(failures)
