"""FlashQLA backend on an sm_90+ GPU: against the fp64 reference and FLA at CP=1, and every mode at
cp=2/4 (gloo ranks sharing one GPU, or NCCL with one GPU per rank) against CP=1 on the same backend,
THD (cut per document, sequences straddling ranks, an empty slot; cut as a whole row) and SBHD (batch
2 and 1), bf16; chunkwise through both exchange paths (``native``: FlashQLA's inter-card cp context
with FLA's for the conv; ``generic``: gdn-cp's own exchange, the state summaries from FlashQLA scans);
one realistic shape (16 key / 32 value heads, head dim 128, T=8K); and the second call's syncs.

Every test is marked ``gpu`` and skipped, with the reason, where the FlashQLA backend cannot run
(``gdn_cp.ops.flashqla.flashqla_problem()``: no flash-qla / TileLang, no sm_90+ GPU). The CPU tests of
the same plumbing (a flash_qla stand-in) are tests/ops/test_flashqla_backend.py.

TileLang compiles every kernel variant on first use (~1 min for a cold forward + backward, one kernel after
another). FlashQLA 0.1.3 specialises each kernel on the value and key head counts, the head dims, the dtypes
and the scale, on its flags (initial state, final state, and in the backward a final-state gradient; varlen,
always on here; its own split of long sequences, ``auto_cp``, which its cost model turns on from the chunks per
sequence and the heads) and, for the fused forward, on a value-block width of 32, 64 or 128 that it picks from
sequences x value heads against 70% of the SMs; the token and sequence counts are dynamic. So the tests share:
4 head shapes, all at head dim 128 and bf16 (key / value heads 4 / 8, which headwise cuts to 2 / 4 at cp=2 and
1 / 2 at cp=4; the selftest's 2 / 4; the realistic 16 / 32), and at most 5 packed sequences per call so that
every small-shape forward takes the 32-wide value block (6 sequences x 8 heads took 64: one more variant);
:data:`WARM` names one call per compiled variant of the generic paths (10), which the module compiles side by
side in fresh processes before its first test (:func:`compiled`; ~2 min cold instead of ~10 one after another,
nothing where ``TILELANG_CACHE_DIR`` holds them). FlashQLA's inter-card variants (the native path) compile in
their tests. Keep ``TILELANG_CACHE_DIR`` between runs (benchmarks/gpu_suite.sh carries it as ``.tl_cache``).

Tolerances (relative L2; gdn_cp.ops.accuracy), the FLA backend's: bf16 vs the fp64 reference
<= 1e-2; cp=N vs CP=1 <= 2e-3 outputs, <= 1e-2 gradients, or within 5e-3 of CP=1 and as close to fp64
as CP=1 is (FlashQLA's own split of long sequences, auto_cp, cuts them at other rows per CP size).
Measured errors are appended as JSON lines to ``$GDN_CP_GPU_RESULTS``.
"""

from __future__ import annotations

import time

import pytest
import torch

from gdn_cp.ops import GDNShape
from gdn_cp.ops.flashqla.detect import flashqla_problem
from gdn_cp_testing.inputs import fla_core_inputs
from gdn_cp.ops.accuracy import max_rel, rel_l2
from gdn_cp_testing.probes import count_syncs, first_sync_site
from gdn_cp_testing.results import JsonlRecorder
from gdn_cp_testing.compare import gather_rows
from gdn_cp.ops.accuracy import FLA_VS_FP64_REL_L2 as TOLERANCES

from .test_fla_backend import _judge

WHY_NOT = flashqla_problem()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(WHY_NOT is not None, reason=f"FlashQLA backend: {WHY_NOT}")]

DIMS = dict(num_k_heads=4, num_v_heads=8, head_k_dim=128, head_v_dim=128)
SHAPE = GDNShape(**DIMS)
REALISTIC = dict(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128)
CONV_W = 4
T_GLOBAL = 512
# name -> (global boundaries, split, SBHD batch or None). Per-document lengths are multiples of 2*cp = 8; at most
# 5 non-empty sequences (FlashQLA's value-block width, see the module docstring)
CASES = {
    "thd_docs": ([0, 40, 40, 128, 304, 384, 512], "per_document", None),  # an empty slot, straddling
    "thd_whole_row": ([0, 37, 37, 126, 300, 383, 512], "whole_row", None),  # odd lengths, one row cut
    "sbhd2": ([0, 256, 512], "per_document", 2),
    "sbhd1": ([0, 512], "per_document", 1),
}
MODES = ("headwise", "all_gather", "chunkwise")

_record = JsonlRecorder.from_env("GDN_CP_GPU_RESULTS").record
BASELINE_DEVICE = "cuda"  # where the CP=1 baselines run (a CPU dry run with a flash_qla stand-in sets "cpu")


def _leaves(inp: dict, device, rows=None) -> dict:
    sl = rows if rows is not None else slice(None)
    cast = {"qkv": torch.bfloat16, "g": torch.float32, "beta": torch.bfloat16, "w": torch.bfloat16, "b": torch.bfloat16}
    return {k: (inp[k][sl] if k in ("qkv", "g", "beta") else inp[k]).to(device=device, dtype=cast[k])
            .detach().requires_grad_(True) for k in cast}


def _grads(t: dict) -> dict:
    return {f"d{k}": v.grad.detach().float().cpu() for k, v in t.items()}


def _rows(case: str, cp: int, rank: int) -> torch.Tensor:
    from gdn_cp_testing.packings import zigzag_rows

    cu, split, batch = CASES[case]
    if batch is None:
        return zigzag_rows(cu, cp, rank, whole_row=split == "whole_row")
    seq = cu[-1] // batch
    one = zigzag_rows([0, seq], cp, rank)
    return torch.cat([b * seq + one for b in range(batch)])


def _plan(case: str, cp: int, rank: int):
    from gdn_cp.layout import RouteCache, plan_for_sbhd

    cu, split, batch = CASES[case]
    if batch is None:
        return RouteCache().plan(cu, cp, rank, split=split)
    return plan_for_sbhd(cu[-1] // batch, batch, cp, rank)


def _core_cp1(backend, t: dict, cu, shape=SHAPE):
    from gdn_cp.modes.local import local_core  # the CP=1 core (its inputs trusted: the test made them)

    return local_core(t["qkv"], t["g"], t["beta"], t["w"], t["b"], shape=shape, cu_seqlens=cu, backend=backend,
                      glue="auto")


_BASELINES: dict = {}


def _baseline(case: str, dims=None, cu=None):
    """CP=1 on FlashQLA, on FLA (where it imports) and the fp64 reference, on the same bf16-rounded inputs
    (``cu``: boundaries of a case not in CASES)."""
    dims = dims or DIMS
    key = (case, tuple(dims.values()))
    if key in _BASELINES:
        return _BASELINES[key]
    from gdn_cp.ops import get_backend
    from gdn_cp.ops.fla.detect import fla_available

    shape = GDNShape(**dims)
    cu = CASES[case][0] if cu is None else cu
    inp = fla_core_inputs(cu[-1], **dims, width=CONV_W, seed=5)
    dev = torch.device(BASELINE_DEVICE)
    out = {}
    for name in ("flashqla", "fla", "reference"):
        if name == "fla" and not fla_available():
            continue
        t = _leaves(inp, dev)
        if name == "reference":
            t = {k: v.detach().double().requires_grad_(True) for k, v in t.items()}
        o = _core_cp1(get_backend(name), t, cu, shape)
        (o.double() * inp["do"].to(dev).double()).sum().backward()
        out[name] = {"o": o.detach().float().cpu(), **_grads(t)}
    _BASELINES[key] = (inp, out)
    return _BASELINES[key]


WARM = (
    # (key heads, value heads, boundaries, initial state, final state): one call per compiled variant of FlashQLA
    # that the generic paths here call (tests/ops/test_flashqla_backend.py holds the list to the calls they make)
    (4, 8, (0, 256, 512), False, False),  # CP=1, all_gather, chunkwise's pieces
    (4, 8, (0, 128), False, True),  # chunkwise: a rank's tail, which continues on the next rank
    (4, 8, (0, 128), True, False),  # chunkwise: a rank's head, which continues an earlier rank's
    (4, 8, (0, 128), True, True),  # chunkwise: one sequence over the whole slice (the transition summary)
    (2, 4, (0, 256, 512), False, False),  # headwise at cp=2
    (2, 4, (0, 37, 130, 301), True, True),  # gdn-cp selftest's case
    (1, 2, (0, 256, 512), False, False),  # headwise at cp=4
    (16, 32, (0, 8192), False, False),  # the realistic shape at CP=1 (FlashQLA splits it: auto_cp)
    (16, 32, (0, 4096), False, True),  # ... rank 0 at cp=2 (the tail)
    (16, 32, (0, 4096), True, False),  # ... rank 1 at cp=2 (the head)
)


def warm_one(hk: int, hv: int, cu: tuple, h0: bool, final: bool) -> float:
    """One FlashQLA forward + backward of this variant on CUDA (what TileLang compiles for it lands in
    ``TILELANG_CACHE_DIR``); the seconds it took."""
    from gdn_cp.ops.flashqla import kernels

    t0, dev, t = time.perf_counter(), torch.device("cuda"), cu[-1]
    q, k = (torch.randn(t, hk, 128, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    v = torch.randn(t, hv, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.nn.functional.logsigmoid(torch.randn(t, hv, device=dev) + 3).requires_grad_(True)
    beta = torch.rand(t, hv, device=dev, dtype=torch.bfloat16, requires_grad=True)
    init = torch.zeros(len(cu) - 1, hv, 128, 128, device=dev, requires_grad=True) if h0 else None
    o, fs = kernels.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=list(cu), initial_state=init,
                                           output_final_state=final)
    (o.float().sum() + (fs.sum() if final else 0)).backward()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """:data:`WARM`'s variants compiled side by side, one fresh process each, before the first test (TileLang
    compiles one kernel at a time in a process); a variant that fails here fails again in its test."""
    import concurrent.futures as cf
    import multiprocessing as mp
    import os

    t0 = time.perf_counter()
    workers = max(1, min(len(WARM), (os.cpu_count() or 2) - 1))
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        futures = {pool.submit(warm_one, *w): w for w in WARM}
        took = {}
        for f in cf.as_completed(futures):
            try:
                took[str(futures[f])] = round(f.result(), 1)
            except Exception as e:  # noqa: BLE001 - its test says what fails
                took[str(futures[f])] = repr(e)[:200]
    _record("flashqla_warm", seconds=round(time.perf_counter() - t0, 1), workers=workers, variants=took)


@pytest.fixture(scope="module")
def cuda_pool(rank_pool):
    p = rank_pool(4, device="cuda")
    _record("flashqla_pool", backend=p.backend, one_gpu=p.one_gpu, world=p.world_size)
    return p


# ------------------------------------------------------------------------------------------
# CP=1
# ------------------------------------------------------------------------------------------

def test_flashqla_vs_reference_and_fla_cp1():
    """Conv + gated delta rule on packed THD with an empty slot: FlashQLA against the fp64 reference
    (the FLA backend's bf16 tolerance) and against FLA (recorded; within the same tolerance)."""
    t0 = time.perf_counter()
    _, out = _baseline("thd_docs")
    seconds = time.perf_counter() - t0  # the first FlashQLA call: TileLang's compile, unless cached
    ref, got = out["reference"], out["flashqla"]
    errs = {k: rel_l2(got[k], ref[k]) for k in ref}
    vs_fla = {k: rel_l2(got[k], out["fla"][k]) for k in ref} if "fla" in out else None
    fla_vs_ref = {k: rel_l2(out["fla"][k], ref[k]) for k in ref} if "fla" in out else None
    _record("flashqla_vs_reference_cp1", rel_l2=errs, max_rel={k: max_rel(got[k], ref[k]) for k in ref},
            rel_l2_vs_fla=vs_fla, fla_rel_l2_vs_reference=fla_vs_ref, first_call_s=round(seconds, 1))
    bad = {k: e for k, e in errs.items() if not e <= TOLERANCES["bfloat16"]}
    assert not bad, f"FlashQLA vs fp64 reference over {TOLERANCES['bfloat16']}: {bad}"
    if vs_fla is not None:
        bad = {k: e for k, e in vs_fla.items() if not e <= TOLERANCES["bfloat16"]}
        assert not bad, f"FlashQLA vs FLA over {TOLERANCES['bfloat16']}: {bad}"


def test_selftest_cases_pass():
    """``gdn-cp selftest --gpu``'s FlashQLA cases (gated delta rule with initial and final states,
    grouped value heads, an empty sequence; FLA's conv) pass here."""
    from gdn_cp.cli.selftest import backend_cases

    cases, not_checked = [], []
    backend_cases("flashqla", cases, not_checked, seed=0)
    _record("flashqla_selftest", cases=[c.line() for c in cases], not_checked=not_checked)
    assert cases and not not_checked and all(c.ok for c in cases), [c.line() for c in cases]


# ------------------------------------------------------------------------------------------
# every mode at cp=2/4 against CP=1
# ------------------------------------------------------------------------------------------

def _rank_modes(rctx, inputs: dict, cp: int, path: str):
    """Every mode on every case, on this rank's zigzag rows of a cp-sized group, with the chunkwise
    path set to ``path``; per (case, mode): output, gradients, rows, what chunkwise ran."""
    import torch.distributed as dist

    from gdn_cp.modes import CallContext, Settings, gdn_core, prepare_mode
    from gdn_cp.ops import get_backend

    backend = get_backend("flashqla")
    group = rctx.group(cp)
    r = dist.get_rank(group)
    out = {}
    for case in CASES:
        plan, rows = _plan(case, cp, r), _rows(case, cp, r)
        for mode in MODES if path == "generic" else ("chunkwise",):
            t = _leaves(inputs[case], rctx.device, rows)
            o = gdn_core(t["qkv"], t["g"], t["beta"], t["w"], t["b"], shape=SHAPE, mode=mode, plan=plan,
                         group=group, backend=backend, chunkwise_path=path)
            (o.float() * inputs[case]["do"][rows].to(rctx.device)).sum().backward()
            ran = prepare_mode(CallContext(settings=Settings(mode=mode, chunkwise_path=path), shape=SHAPE, plan=plan,
                                           group=group, backend=backend)).path
            out[f"{case}/{mode}"] = {"o": o.detach().float().cpu(), **_grads(t), "rows": rows, "ran": ran}
    return out


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("path", ["generic", "native"])
def test_modes_match_cp1(cuda_pool, path, cp):
    """generic: headwise, all_gather and chunkwise (gdn-cp's exchange); native: chunkwise on FlashQLA's
    inter-card context (skipped where it cannot run: FlashQLA < 0.1.3, or FLA's cp context missing)."""
    from gdn_cp.ops.flashqla.native_cp import native_cp_problem

    if path == "native" and native_cp_problem() is not None:
        pytest.skip(f"FlashQLA's native chunkwise core: {native_cp_problem()}")
    inputs = {case: _baseline(case)[0] for case in CASES}
    t0 = time.perf_counter()
    results = cuda_pool.run(_rank_modes, inputs, cp, path)
    seconds = time.perf_counter() - t0
    failures = []
    for key in results[0]:
        case, mode = key.split("/")
        _, base = _baseline(case)
        got = [gather_rows(results, key, cp, s, T_GLOBAL) for s in range(0, cuda_pool.world_size, cp)]
        bad, targets_met, errs, maxes, ref_errs, cp1_ref_errs = _judge(got, base["flashqla"], base["reference"],
                                                                       "bfloat16")
        ran = sorted({res[key]["ran"] for res in results})
        vs_fla = {k: rel_l2(got[0][k], base["fla"][k]) for k in got[0]} if "fla" in base else None
        _record("flashqla_mode_vs_cp1", case=case, mode=mode, path=path, ran=ran, cp=cp, ok=not bad,
                issue_targets_met=targets_met, rel_l2=errs, max_rel=maxes, rel_l2_vs_fp64_reference=ref_errs,
                cp1_rel_l2_vs_fp64_reference=cp1_ref_errs, rel_l2_vs_fla_cp1=vs_fla, seconds=round(seconds, 1))
        failures += [f"{key}: {b}" for b in bad]
        want = path if mode == "chunkwise" else mode
        if ran != [want]:
            failures.append(f"{key}: ran {ran}, expected {want}")
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------------------------------
# the realistic shape, and the second call's syncs
# ------------------------------------------------------------------------------------------

def _rank_realistic(rctx, inp: dict, cu: list, cp: int, path: str):
    import torch.distributed as dist

    from gdn_cp.layout import RouteCache
    from gdn_cp.modes import gdn_core
    from gdn_cp.ops import get_backend
    from gdn_cp_testing.packings import zigzag_rows

    group = rctx.group(cp)
    r = dist.get_rank(group)
    rows = zigzag_rows(cu, cp, r)
    plan = RouteCache().plan(cu, cp, r)
    t = _leaves(inp, rctx.device, rows)
    o = gdn_core(t["qkv"], t["g"], t["beta"], t["w"], t["b"], shape=GDNShape(**REALISTIC), mode="chunkwise",
                 plan=plan, group=group, backend=get_backend("flashqla"), chunkwise_path=path)
    (o.float() * inp["do"][rows].to(rctx.device)).sum().backward()
    return {"single": {"o": o.detach().float().cpu(), **_grads(t), "rows": rows}}


@pytest.mark.parametrize("path", ["generic", "native"])
def test_realistic_shape_chunkwise_cp2(cuda_pool, path):
    """16 key / 32 value heads, head dim 128, T=8192 in one sequence: chunkwise at cp=2 against FlashQLA
    at CP=1, FLA at CP=1 and the fp64 reference."""
    from gdn_cp.ops.flashqla.native_cp import native_cp_problem

    if path == "native" and native_cp_problem() is not None:
        pytest.skip(f"FlashQLA's native chunkwise core: {native_cp_problem()}")
    t = 8192
    inp, base = _baseline("realistic", REALISTIC, cu=[0, t])
    results = cuda_pool.run(_rank_realistic, inp, [0, t], 2, path)
    got = [gather_rows(results, "single", 2, s, t) for s in range(0, cuda_pool.world_size, 2)]
    bad, targets_met, errs, _, ref_errs, cp1_ref_errs = _judge(got, base["flashqla"], base["reference"], "bfloat16")
    flashqla_vs_fla = {k: rel_l2(base["flashqla"][k], base["fla"][k]) for k in base["fla"]} if "fla" in base else None
    _record("flashqla_realistic_cp2", path=path, T=t, dims=REALISTIC, ok=not bad, issue_targets_met=targets_met,
            rel_l2=errs, rel_l2_vs_fp64_reference=ref_errs, cp1_rel_l2_vs_fp64_reference=cp1_ref_errs,
            cp1_flashqla_vs_fla=flashqla_vs_fla)
    assert not bad, "\n".join(bad)


def _rank_syncs(rctx, inp: dict, cp: int, path: str):
    """A second identical call (same plan, same boundaries objects: a later layer of the micro-batch)
    under torch's sync debug mode: the device->host syncs its forward and its backward make, each with where
    (:func:`count_syncs`; a backward's at the ``backward()`` call). The inputs are on the device before the count
    starts: a host->device copy syncs (torch's ``memcpy_and_sync``), and run 2026-12-07f counted the test's own five
    (qkv, g, beta, the conv's weight and bias) as 5 syncs of the layer's. Where there are any, the same rows'
    boundaries through the CP=1 core twice (no collective: a rank raising between two would leave the others
    waiting) say whether FlashQLA's call alone syncs again, and where first (:func:`first_sync_site`)."""
    import torch.distributed as dist

    from gdn_cp.layout import host_boundaries
    from gdn_cp.modes import gdn_core
    from gdn_cp.ops import get_backend

    group, backend = rctx.group(cp), get_backend("flashqla")
    r = dist.get_rank(group)
    plan, rows = _plan("thd_docs", cp, r), _rows("thd_docs", cp, r)
    do = inp["do"][rows].to(rctx.device)

    def forward(t):
        return gdn_core(t["qkv"], t["g"], t["beta"], t["w"], t["b"], shape=SHAPE, mode="chunkwise", plan=plan,
                        group=group, backend=backend, chunkwise_path=path)

    (forward(_leaves(inp, rctx.device, rows)).float() * do).sum().backward()
    second = _leaves(inp, rctx.device, rows)
    o, fwd = count_syncs(lambda: forward(second))
    _, bwd = count_syncs(lambda: (o.float() * do).sum().backward())
    out = {"syncs": len(fwd) + len(bwd), "forward": fwd, "backward": bwd}
    if fwd or bwd:
        cu, do_all = host_boundaries(CASES["thd_docs"][0]), inp["do"].to(rctx.device)

        def cp1_step(t):
            (_core_cp1(backend, t, cu).float() * do_all).sum().backward()

        cp1_step(_leaves(inp, rctx.device))
        t2, t3 = _leaves(inp, rctx.device), _leaves(inp, rctx.device)
        _, cp1 = count_syncs(lambda: cp1_step(t2))
        out.update(cp1_second_call=cp1, cp1_first_sync=first_sync_site(lambda: cp1_step(t3)) if cp1 else None)
    return out


@pytest.mark.parametrize("path", ["generic", "native"])
def test_second_call_makes_no_sync(cuda_pool, path):
    """gdn-cp's rule: after the first layer of a micro-batch, a layer call makes no device->host sync.
    FlashQLA's caches (boundaries-derived tensors, keyed on the tensor object, 4 entries) must hit. Its inputs are
    on the device before the count (``_rank_syncs``)."""
    from gdn_cp.ops.flashqla.native_cp import native_cp_problem

    if path == "native" and native_cp_problem() is not None:
        pytest.skip(f"FlashQLA's native chunkwise core: {native_cp_problem()}")
    inp, _ = _baseline("thd_docs")
    results = cuda_pool.run(_rank_syncs, inp, 2, path)
    _record("flashqla_zero_sync", path=path, ranks=results)
    assert all(r["syncs"] == 0 for r in results), results
