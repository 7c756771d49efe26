"""The glue's GPU paths (gdn_cp.ops.fused: gdn-cp's Triton kernels, and torch.compile of the conv + SiLU +
q/k/v split + l2 norm step and of the gates) against the same functions run eagerly and against FLA-free fp64 math:
bf16 at a real layer's width (Qwen3.5-9B's 16 key / 32 value heads of dim 128), a strided input (a view
of in_proj's output), packed sequences, with and without a halo, forward and backward; a new row count
compiles nothing new (one graph per variant, dynamic in T).

Marked ``gpu``; skipped without CUDA (the CPU tests of the same math: tests/ops/test_fused_glue.py)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from gdn_cp.ops.accuracy import rel_l2
from gdn_cp.layout import Boundaries
from gdn_cp.ops.fused import glue
from gdn_cp_testing.ranks import maybe_fast_autotune
from gdn_cp_testing.results import JsonlRecorder

pytestmark = pytest.mark.gpu
# opt-in, test-only (GDN_CP_TEST_FAST_AUTOTUNE=1; gpu_suite.sh's GDN_CP_TESTS_FAST_AUTOTUNE for this stage): each
# autotuner takes its first working config. Every check here holds for any config: the kernels' arithmetic and its
# order per element do not depend on the tile or the heads a program takes (the tap sums: rows in order per span).
FAST_AUTOTUNE = maybe_fast_autotune()
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.compile's Triton "
                                                                       "kernels); the CPU tests: tests/ops/test_fused_glue.py")
_record = JsonlRecorder.from_env("GDN_CP_GPU_RESULTS").record

HK, HV, D, W = 16, 32, 128, 4
C = 2 * HK * D + HV * D
KW = dict(k_heads=HK, v_heads=HV, head_k_dim=D, head_v_dim=D, qk_l2norm=True)


def _inputs(cu, halo, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = cu[-1]
    rows = torch.randn(t, C + 4160, device="cuda", generator=g).bfloat16().requires_grad_(True)  # + z, beta, alpha
    weight = (0.5 * torch.randn(C, W, device="cuda", generator=g)).bfloat16().requires_grad_(True)
    bias = (0.1 * torch.randn(C, device="cuda", generator=g)).bfloat16().requires_grad_(True)
    h = torch.randn(W - 1, C, device="cuda", generator=g).bfloat16().requires_grad_(True) if halo else None
    return rows, weight, bias, h


def _run(fn, rows, weight, bias, h, cu, seed):
    pos = Boundaries(cu).positions(rows.device)
    leaves = [rows, weight, bias] + ([h] if h is not None else [])
    out = fn(rows[:, :C], weight, bias, pos, h, **KW)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    douts = [torch.randn(o.shape, device="cuda", generator=g).bfloat16() for o in out]
    grads = torch.autograd.grad(out, leaves, douts)
    return [o.float() for o in out], [x.float() for x in grads]


def _differing(a: torch.Tensor, b: torch.Tensor) -> float:
    """The share of elements whose bits differ."""
    return float((a != b).float().mean())


@needs_cuda
@pytest.mark.parametrize("path", ["triton", "triton_one_pass", "triton_norm_dz_copy_scan", "compiled"])
@pytest.mark.parametrize("halo", [False, True])
def test_conv_split_paths_equal_eager_and_fp64(path, halo):
    """Each GPU path of the conv + SiLU + split + l2 norm against the plain-torch step in bf16 (the same
    rounding points: few elements may differ, by one rounding, from fp32 summation order) and in fp64.
    The compiled path compiles nothing new for a third row count (dynamic in T)."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    errors, graphs, differing = {}, [], {}
    for i, cu in enumerate(([0, 1000, 1000, 3000, 4096], [0, 2500, 6144], [0, 700, 5000, 5120])):
        rows, weight, bias, h = _inputs(cu, halo, seed=i)
        before = counters["stats"]["unique_graphs"]
        fn = partial(glue.conv_silu_split, path=path)
        got_out, got_grad = _run(fn, rows, weight, bias, h, cu, i)
        graphs.append(counters["stats"]["unique_graphs"] - before)
        eager_out, eager_grad = _run(partial(glue.conv_silu_split, path="eager"), rows, weight, bias, h, cu, i)
        leaves64 = [x.detach().double().requires_grad_(True) for x in (rows, weight, bias) + ((h,) if halo else ())]
        pos = Boundaries(cu).positions("cuda")
        out64 = glue._conv_silu_split(leaves64[0][:, :C], leaves64[1], leaves64[2], pos, leaves64[3] if halo else None,
                                      HK, HV, D, D, True, 1e-6)
        g = torch.Generator(device="cuda").manual_seed(i + 1)
        douts = [torch.randn(o.shape, device="cuda", generator=g).bfloat16().double() for o in out64]
        grads64 = torch.autograd.grad(out64, leaves64, douts)
        names = ["q", "k", "v", "d_rows", "d_weight", "d_bias"] + (["d_halo"] if halo else [])
        for name, a, b, ref in zip(names, got_out + got_grad, eager_out + eager_grad, list(out64) + list(grads64)):
            errors[(i, name)] = (rel_l2(a, b), rel_l2(a.double(), ref))
        for name, a, b in zip(names[:3], got_out, eager_out):
            differing[(i, name)] = _differing(a, b)
    _record("fused_glue_conv", path=path, halo=halo, new_graphs=graphs, differing=str(differing),
            errors={f"{i}:{n}": e for (i, n), e in errors.items()})
    bad = {k: e for k, e in errors.items() if not (e[0] < 1e-2 and e[1] < 1e-2)}
    assert not bad, f"{path} vs eager, {path} vs fp64 (rel. L2): {bad}"
    # rounding once instead of twice (or elsewhere) changes a third or more of the bf16 outputs
    assert max(differing.values()) < 0.02, f"share of bf16 outputs whose bits differ from eager: {differing}"
    if path == "compiled":
        assert graphs[2] == 0, f"new graphs per row count {graphs}: the glue recompiles per micro-batch"


@needs_cuda
@pytest.mark.parametrize("path", ["triton", "triton_norm_dz_copy", glue.CUDA_DEFAULT])
def test_key_heads_written_repeated_are_the_repeated_outputs_bit_for_bit(path):
    """``kv_repeat=2`` (``REPEAT_KEY_HEADS_IN_CONV``, for FLA 0.4.2): q and k written twice a head by the kernels,
    their copies' gradients summed as the backward reads them, against the same path's q and k repeated by
    ``repeat_interleave`` (autograd sums the copies in bf16): every output and gradient bit for bit the same, with a
    halo, bf16 at Qwen3.5-9B's width."""
    cu = [0, 1000, 1000, 3000, 4096]
    rows, weight, bias, h = _inputs(cu, True, seed=7)

    def repeated_after(x, *rest, **kw):
        q, k, v = glue.conv_silu_split(x, *rest, **kw, path=path)
        return q.repeat_interleave(2, dim=1), k.repeat_interleave(2, dim=1), v

    got = _run(partial(glue.conv_silu_split, path=path, kv_repeat=2), rows, weight, bias, h, cu, 7)
    want = _run(repeated_after, rows, weight, bias, h, cu, 7)
    names = ["q", "k", "v", "d_rows", "d_weight", "d_bias", "d_halo"]
    same = {n: torch.equal(a, b) for n, a, b in zip(names, got[0] + got[1], want[0] + want[1])}
    _record("fused_glue_kv_repeat", path=path, same=same)
    assert got[0][0].shape == (4096, 2 * HK, D) and all(same.values()), same


@needs_cuda
@pytest.mark.parametrize("switches", [(True, False, False), (False, True, False), (True, True, False),
                                      (False, False, True), (True, True, True)])
def test_the_scans_switches_keep_its_bits(monkeypatch, switches):
    """``triton_conv.SCAN_HALO_TAIL`` / ``SCAN_BRANCH_MASKS`` / ``FTZ_SIGMOID`` (off by default, layer_full's levers
    ``halo_apart`` / ``scan_branch``, glue_kernels' forms): the default's scan with the halo read in its tail loop, its
    masks by branches, the sigmoid in flush-to-zero approximations (forward too), or several, gives the same bits as
    with none, every output and gradient (bf16 at Qwen3.5-9B's width, a halo, an empty sequence, sequence starts
    inside and on the edges of the scan's spans; pre-activations within about +-10, where every sigmoid is normal)."""
    from gdn_cp.ops.fused import triton_conv

    cu = [0, 1000, 1000, 1024, 3000, 3001, 4096]  # spans of 64 rows: starts inside them and on an edge
    rows, weight, bias, h = _inputs(cu, True, seed=11)
    fn = partial(glue.conv_silu_split, path=glue.CUDA_DEFAULT)
    want = _run(fn, rows, weight, bias, h, cu, 11)
    monkeypatch.setattr(triton_conv, "SCAN_HALO_TAIL", switches[0])
    monkeypatch.setattr(triton_conv, "SCAN_BRANCH_MASKS", switches[1])
    monkeypatch.setattr(triton_conv, "FTZ_SIGMOID", switches[2])
    got = _run(fn, rows, weight, bias, h, cu, 11)
    names = ["q", "k", "v", "d_rows", "d_weight", "d_bias", "d_halo"]
    same = {n: torch.equal(a, b) for n, a, b in zip(names, got[0] + got[1], want[0] + want[1])}
    _record("fused_glue_scan_switches", tail=switches[0], branch=switches[1], ftz=switches[2], same=same)
    assert all(same.values()), same


@needs_cuda
@pytest.mark.parametrize("path", ["triton", "triton_one_pass", "compiled"])
def test_gates_paths_equal_stocks_expression(path):
    torch.manual_seed(0)
    rows = torch.randn(4096, 12352, device="cuda").bfloat16().requires_grad_(True)
    a_log = torch.rand(HV, device="cuda").bfloat16().requires_grad_(True)
    dt_bias = torch.randn(HV, device="cuda").bfloat16().requires_grad_(True)
    _, _, beta_raw, alpha = torch.split(rows, [C, HV * D, HV, HV], dim=-1)
    g, beta = glue.gates(alpha, beta_raw, a_log, dt_bias, path=path)
    want_g = -a_log.exp() * F.softplus(alpha.float() + dt_bias)
    dg, db = torch.randn_like(g), torch.randn_like(beta)
    got = torch.autograd.grad((g, beta), (rows, a_log, dt_bias), (dg, db))
    want = torch.autograd.grad((want_g, beta_raw.sigmoid()), (rows, a_log, dt_bias), (dg, db))
    errs = {"g": rel_l2(g, want_g), "beta": rel_l2(beta.float(), beta_raw.sigmoid().float())}
    errs.update({f"d_{n}": rel_l2(a.float(), b.float()) for n, a, b in zip(("rows", "a_log", "dt_bias"), got, want)})
    _record("fused_glue_gates", path=path, errors=errs)
    assert g.dtype == torch.float32 and beta.dtype == torch.bfloat16
    assert all(e < 1e-2 for e in errs.values()), errs


@needs_cuda
@pytest.mark.parametrize("dz_in_place", [True, False], ids=["triton_norm", "triton_norm_dz_copy"])
def test_gated_norm_kernel_equals_flas(dz_in_place):
    """gdn-cp's gated RMSNorm (glue path ``triton_norm``: z read inside in_proj's rows, dz written there;
    ``triton_norm_dz_copy`` and the default, its scan: dz in a tensor of its own, copied into in_proj's gradient) against
    FLA's ``rms_norm_gated`` on a contiguous copy, bf16 at Qwen3.5-9B's width: the same math and rounding points
    (few output bits may differ, from fp32 summation order), every gradient within 1e-2."""
    fla_norm = pytest.importorskip("fla.modules.fused_norm_gate", reason="FLA is not installed (the reference)")
    from gdn_cp.ops.fused.split import split_columns
    from gdn_cp.ops.fused.triton_norm import gated_rms_norm_triton

    torch.manual_seed(0)
    t = 4099  # rows past a tile
    rows = torch.randn(t, C + HV * D + 2 * HV, device="cuda").bfloat16().requires_grad_(True)
    o = torch.randn(t, HV, D, device="cuda").bfloat16().requires_grad_(True)
    weight = (1 + 0.1 * torch.randn(D, device="cuda")).bfloat16().requires_grad_(True)
    dy = torch.randn(t * HV, D, device="cuda").bfloat16()
    z = split_columns(rows, [C, HV * D, HV, HV])[1].reshape(t, HV, D)
    got = gated_rms_norm_triton(o, z, weight, 1e-6, dz_in_place=dz_in_place)
    got_grads = torch.autograd.grad(got, (o, rows, weight), dy)
    z_plain = torch.split(rows, [C, HV * D, HV, HV], dim=-1)[1].reshape(-1, D)
    want = fla_norm.rms_norm_gated(o.reshape(-1, D), z_plain, weight, None, activation="swish", eps=1e-6)
    want_grads = torch.autograd.grad(want, (o, rows, weight), dy)
    errs = {"y": rel_l2(got.float(), want.float())}
    errs.update({f"d_{n}": rel_l2(a.float(), b.float()) for n, a, b in zip(("o", "rows", "weight"), got_grads,
                                                                             want_grads)})
    differing = _differing(got, want)
    _record("fused_glue_norm", errors=errs, differing=differing, dz_in_place=dz_in_place)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert all(e < 1e-2 for e in errs.values()), errs
    assert differing < 0.02, f"share of bf16 outputs whose bits differ from FLA's: {differing}"
