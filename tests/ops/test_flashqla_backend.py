"""The FlashQLA backend on the CPU: its detection and refusals, the registry's choice, and its plumbing
(argument layout, grouped value heads, varlen boundaries, initial / final states, dtypes, value dims
in 128-wide blocks) against the reference backend through a CPU stand-in for ``flash_qla``
(tests/ops/fake_flashqla.py: FlashQLA's signature and refusals, gdn-cp's reference math), in-process
and in every mode at cp=2 on gloo ranks. The kernels themselves: tests/gpu/test_flashqla_backend.py."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from gdn_cp.ops import GDNShape, get_backend
from gdn_cp.ops.flashqla import detect, kernels
from gdn_cp.ops.registry import AUTO, BACKEND_CHOICES, BACKENDS, ORACLE, resolve_backend
from gdn_cp.ops.accuracy import rel_l2

from . import fake_flashqla

SHAPE = GDNShape(num_k_heads=2, num_v_heads=4, head_k_dim=128, head_v_dim=128)


@pytest.fixture
def fake():
    fake_flashqla.install()
    try:
        yield fake_flashqla
    finally:
        fake_flashqla.uninstall()


# ------------------------------------------------------------------------------------------
# detection
# ------------------------------------------------------------------------------------------

def _fakes(*, installed=("flash_qla", "tilelang"), capability=(9, 0), import_error=None, params=None, inter=True):
    def find_spec(name):
        return object() if name in installed else None

    def gdr(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
            cu_seqlens=None, auto_cp=True, cp_context=None):
        return None

    if params is not None:
        ns: dict = {}
        exec(f"def gdr({', '.join(params)}):\n    return None\n", ns)  # noqa: S102
        gdr = ns["gdr"]

    def build(cu_seqlens=None, *, enable_inter=False, enable_intra=False, group=None):
        return None

    modules = {"flash_qla": types.SimpleNamespace(chunk_gated_delta_rule=gdr),
               "flash_qla.ops.gated_delta_rule.chunk": types.SimpleNamespace(
                   CHUNK_SIZE=64, **({"build_cp_context": build} if inter else {}))}

    def import_module(name):
        if import_error is not None:
            raise import_error
        return modules[name]

    cap = (lambda: (capability, None)) if capability else (lambda: (None, "torch 2.x sees no CUDA GPU"))
    return dict(import_module=import_module, find_spec=find_spec, cuda_capability=cap)


@pytest.mark.parametrize("kwargs, reason", [
    (dict(installed=("tilelang",)), "flash-qla is not installed"),
    (dict(installed=("flash_qla",)), "tilelang is not installed"),
    (dict(capability=None), "sees no CUDA GPU"),
    (dict(capability=(8, 0)), "the GPU is sm_80; FlashQLA has kernels for sm_90"),
    (dict(import_error=ValueError("FlashQLA now support sm90 ...")), "importing flash_qla failed: ValueError"),
    (dict(params=("q", "k", "v", "g", "beta")), "takes no scale, initial_state"),
])
def test_probe_says_why_it_cannot_run(kwargs, reason):
    found = detect.probe(**_fakes(**kwargs))
    assert found.problem is not None and reason in found.problem, found


def test_probe_full_features():
    assert detect.probe(**_fakes()) == detect.FlashQLAFeatures(None, (9, 0), inter_card_cp=True, chunk_size=64)
    assert detect.probe(**_fakes(inter=False)).inter_card_cp is False


def test_this_machine_has_no_flashqla_and_says_why():
    """The CPU machine: the registry's probe gives a reason (never raises, imports nothing heavy)."""
    problem = BACKENDS["flashqla"].problem()
    assert problem is not None and ("not installed" in problem or "no CUDA GPU" in problem), problem


def test_versions_come_from_package_metadata(monkeypatch):
    import importlib.metadata

    versions = {"flash-qla": "0.1.3", "tilelang": "0.1.15"}

    def version(name):
        if name not in versions:
            raise importlib.metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert (detect.flashqla_version(), detect.tilelang_version()) == ("0.1.3", "0.1.15")


# ------------------------------------------------------------------------------------------
# the registry's choice
# ------------------------------------------------------------------------------------------

def test_choices_and_order():
    assert BACKEND_CHOICES == (AUTO, "reference", "fla", "flashqla")
    assert [s.name for s in sorted(BACKENDS.values(), key=lambda s: s.preference)] == ["flashqla", "fla", "reference"]


def test_auto_takes_flashqla_only_where_it_takes_the_layer(fake):
    bf16 = dict(head_dims=(128, 128), dtype="bfloat16")
    assert resolve_backend(AUTO, "cuda", **bf16)[0] == "flashqla"
    # FLA does not import on this machine: auto then falls to the reference, saying why for each
    for kw, why in ((dict(head_dims=(64, 64), dtype="bfloat16"), "head dims of 128 only"),
                    (dict(head_dims=(128, 128), dtype="float32"), "bfloat16 / float16 activations only, not float32"),
                    (dict(), "chosen where the layer's head dims and dtype are known")):
        name, reason = resolve_backend(AUTO, "cuda", **kw)
        assert name == ORACLE and why in reason, reason
    assert resolve_backend(AUTO, "cpu", **bf16)[0] == ORACLE
    assert resolve_backend(AUTO, "cuda", deterministic=True, **bf16)[0] == ORACLE


def test_a_named_backend_that_cannot_run_is_refused(fake):
    with pytest.raises(ValueError, match="backend 'flashqla' with deterministic_mode"):
        resolve_backend("flashqla", "cuda", deterministic=True, head_dims=(128, 128), dtype="bfloat16")
    with pytest.raises(ValueError, match="FlashQLA runs on cuda only"):
        resolve_backend("flashqla", "cpu", head_dims=(128, 128), dtype="bfloat16")
    with pytest.raises(ValueError, match="head dims of 128 only"):
        resolve_backend("flashqla", "cuda", head_dims=(128, 64), dtype="bfloat16")
    assert resolve_backend("flashqla", "cuda", head_dims=(128, 256), dtype="float16") == ("flashqla", "requested")
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("tilelang", "cuda")


# ------------------------------------------------------------------------------------------
# the kernels' plumbing, against the reference backend
# ------------------------------------------------------------------------------------------

def _gdr_inputs(cu, shape=SHAPE, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    T, n = cu[-1], len(cu) - 1
    hk, hv, dk, dv = shape.num_k_heads, shape.num_v_heads, shape.head_k_dim, shape.head_v_dim
    t = {
        "q": torch.randn(T, hk, dk, generator=gen), "k": torch.randn(T, hk, dk, generator=gen),
        "v": torch.randn(T, hv, dv, generator=gen),
        "g": F.logsigmoid(torch.randn(T, hv, generator=gen) + 3.0), "beta": torch.sigmoid(torch.randn(T, hv, generator=gen)),
        "h0": torch.randn(n, hv, dk, dv, generator=gen) * 0.1,
    }
    cast = {"q": dtype, "k": dtype, "v": dtype, "beta": dtype, "g": torch.float32, "h0": torch.float32}
    return {k: v.to(cast[k]) for k, v in t.items()}, torch.randn(T, hv, dv, generator=gen), torch.randn(n, hv, dk, dv,
                                                                                                         generator=gen)


def _run(backend, t, do, dfs, cu):
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in t.items()}
    o, fs = backend.chunk_gated_delta_rule(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                                           cu_seqlens=cu, initial_state=leaves["h0"], output_final_state=True)
    ((o.float() * do).sum() + (fs * dfs).sum()).backward()
    return {"o": o.detach().float(), "fs": fs.detach(), **{f"d{k}": v.grad.float() for k, v in leaves.items()}}


@pytest.mark.parametrize("dv", [128, 256], ids=["dv128", "dv256_in_blocks"])
def test_gated_delta_rule_matches_the_reference(fake, dv):
    """Empty sequences (first, middle, last), grouped value heads, initial and final states, bf16: the
    same numbers as the reference backend on the same inputs (gradients summed over value blocks
    aside), and FlashQLA saw what it takes."""
    cu = [0, 0, 37, 37, 100, 130, 130]
    shape = GDNShape(num_k_heads=2, num_v_heads=4, head_k_dim=128, head_v_dim=dv)
    t, do, dfs = _gdr_inputs(cu, shape)
    got = _run(get_backend("flashqla"), t, do, dfs, cu)
    want = _run(get_backend("reference"), t, do, dfs, cu)
    errs = {k: rel_l2(got[k], want[k]) for k in want}
    # in blocks, the gradients of what every block reads (q, k, g, beta) are sums of one gradient per block,
    # each rounded to its input's dtype first (bf16: ~3e-3)
    tol = {k: 1e-2 if dv > 128 and k in ("dq", "dk", "dg", "dbeta") else 1e-5 for k in errs}
    assert all(e < tol[k] for k, e in errs.items()), errs
    calls = fake.CALLS
    assert len(calls) == dv // 128  # one call per 128 value columns
    for c in calls:
        assert c["cu"] == [0, 37, 100, 130] and (c["H"], c["HV"], c["K"], c["V"]) == (2, 4, 128, 128)
        assert c["h0"] and c["final"] and c["l2norm"] and c["auto_cp"] and c["dtype"] == torch.bfloat16


@pytest.mark.parametrize("hk, hv, runs", [(1, 3, 4), (1, 1, 2), (3, 3, 6), (3, 9, 12), (2, 6, 6)])
def test_value_heads_flashqla_cannot_compile_run_padded(fake, hk, hv, runs):
    """Per-rank head counts FlashQLA 0.1.3 cannot compile (an odd number of value heads: headwise CP=2 of a
    2 / 6 layer gives 1 / 3 per rank, which crashed inside the first forward on an H200) run with zero value
    heads added to each key head's group: the same numbers as the reference, the real heads' gradients
    and states only."""
    cu = [0, 0, 37, 100]
    shape = GDNShape(num_k_heads=hk, num_v_heads=hv, head_k_dim=128, head_v_dim=128)
    t, do, dfs = _gdr_inputs(cu, shape)
    got = _run(get_backend("flashqla"), t, do, dfs, cu)
    want = _run(get_backend("reference"), t, do, dfs, cu)
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in want.items()}
    errs = {k: rel_l2(got[k], want[k]) for k in want}
    assert all(e < 1e-5 for e in errs.values()), errs
    assert [(c["H"], c["HV"]) for c in fake.CALLS] == [(hk, runs)]


def test_padded_value_heads_rule():
    from gdn_cp.ops.flashqla.spec import padded_value_heads, value_heads_problem

    assert [padded_value_heads(hk, hv) for hk, hv in [(1, 3), (1, 1), (3, 3), (2, 4), (4, 12), (5, 15)]] == [4, 2, 6, 4,
                                                                                                           12, 20]
    assert value_heads_problem(3) and value_heads_problem(32) is None


def test_auto_cp_follows_the_setting(fake, monkeypatch):
    cu = [0, 64]
    t, _, _ = _gdr_inputs(cu)
    monkeypatch.setenv("GDN_CP_FLASHQLA_AUTO_CP", "0")
    get_backend("flashqla").chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], cu_seqlens=cu)
    assert fake.CALLS[-1]["auto_cp"] is False and fake.CALLS[-1]["h0"] is False and fake.CALLS[-1]["final"] is False


def test_no_rows_and_only_empty_sequences(fake):
    t, _, _ = _gdr_inputs([0, 0, 0])
    o, fs = get_backend("flashqla").chunk_gated_delta_rule(
        t["q"], t["k"], t["v"], t["g"], t["beta"], cu_seqlens=[0, 0, 0], initial_state=t["h0"], output_final_state=True)
    assert o.shape == (0, 4, 128) and torch.equal(fs, t["h0"]) and not fake.CALLS


@pytest.mark.parametrize("change, match", [
    (dict(dk=64), r"head_k_dim=64, head_v_dim=128: FlashQLA's kernels take head dims of 128 only"),
    (dict(dv=192), r"head_v_dim=192"),
    (dict(dtype=torch.float32), r"bfloat16 / float16 activations only, not float32\. Fix:"),
    (dict(v_dtype=torch.float16), r"q, k, v must share one dtype"),
])
def test_refusals_name_the_fix_before_any_kernel(fake, change, match):
    dk, dv = change.get("dk", 128), change.get("dv", 128)
    shape = GDNShape(num_k_heads=2, num_v_heads=4, head_k_dim=dk, head_v_dim=dv)
    t, _, _ = _gdr_inputs([0, 40], shape, dtype=change.get("dtype", torch.bfloat16))
    if "v_dtype" in change:
        t["v"] = t["v"].to(change["v_dtype"])
    with pytest.raises(ValueError, match=match):
        get_backend("flashqla").chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], cu_seqlens=[0, 40])
    assert not fake.CALLS
    if "v_dtype" not in change:
        with pytest.raises(ValueError, match=match):
            get_backend("flashqla").check_shape(shape, change.get("dtype", torch.bfloat16))


def test_cpu_tensors_are_refused_without_the_stand_in():
    t, _, _ = _gdr_inputs([0, 40])
    with pytest.raises(ValueError, match=r"TileLang kernels run on NVIDIA sm_90\+ GPUs only"):
        get_backend("flashqla").chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], cu_seqlens=[0, 40])


def test_transition_summary_through_value_blocks(fake):
    """Chunkwise's summary ``[M | S_ext]`` of a slice that continues on both sides comes from one scan of
    values ``[0 | v]`` (Dk + Dv = 256 wide: two FlashQLA calls) from ``[I | 0]``: the reference's
    tree-composed summary, to fp32 rounding."""
    from gdn_cp.modes.chunkwise import transition_summary
    from gdn_cp.ops import get_backend

    reference = get_backend("reference")

    cu = [0, 150]
    t, _, _ = _gdr_inputs(cu)
    got = transition_summary(t["q"], t["k"], t["v"], t["g"], t["beta"], cu, get_backend("flashqla"), torch.float32, True)
    want = reference.chunk_state_summary(t["k"], t["v"], t["g"], t["beta"], cu_seqlens=cu)[0]
    assert rel_l2(got[..., :128], want[..., :128]) < 1e-5 and rel_l2(got[..., 128:], want[..., 128:]) < 1e-5
    assert [c["V"] for c in fake.CALLS] == [128, 128] and all(c["h0"] for c in fake.CALLS)


def test_conv_and_gated_norm_without_fla_are_gdn_cps(fake):
    """FlashQLA has no conv: FLA's where FLA imports, else the reference conv (this machine), said in the stack."""
    assert kernels.conv_choice()[0] is get_backend("reference").causal_conv1d
    assert kernels.fused_gated_rms_norm() is None
    report = detect.stack_report()
    assert "plain-torch conv" in report["choices"]["conv"] and report["problem"] is None


def test_conv_runs_on_every_call(fake):
    """The conv is computed on every call, never cached on its arguments: a list ``cu_seqlens`` (what
    ``gdn-cp selftest`` passes) is taken, a grad-mode call after a no-grad one on the same tensors gets a
    ``grad_fn``, and an in-place change of the input changes the output (a ``functools`` cache on the
    conv once kept the last activation alive and answered with its stale output)."""
    torch.manual_seed(0)
    reference = get_backend("reference").causal_conv1d
    x = torch.randn(12, 6, requires_grad=True)
    w, b, cu = torch.randn(6, 4), torch.randn(6), [0, 5, 12]
    with torch.no_grad():
        first = kernels.causal_conv1d(x, w, b, cu_seqlens=cu)
    second = kernels.causal_conv1d(x, w, b, cu_seqlens=cu)
    assert first.grad_fn is None and second.grad_fn is not None
    with torch.no_grad():
        x.mul_(2.0)
    third = kernels.causal_conv1d(x, w, b, cu_seqlens=cu)
    assert not torch.allclose(third, second)
    torch.testing.assert_close(third, reference(x, w, b, cu_seqlens=cu))


# ------------------------------------------------------------------------------------------
# every mode at cp=2 on gloo ranks, with the stand-in
# ------------------------------------------------------------------------------------------

CP_CU = [0, 20, 20, 72, 80, 80, 128]  # per document (lengths multiples of 2*cp=4): straddling, empty slots


def _rank_modes(ctx):
    import torch.distributed as dist

    from gdn_cp.layout import RouteCache
    from gdn_cp.modes import gdn_core
    from gdn_cp.modes.spec import MODE_NAMES
    from gdn_cp.modes.inputs import core_inputs
    from gdn_cp_testing.inputs import cp1_core_answer
    from gdn_cp_testing.packings import zigzag_rows

    fake_flashqla.install()
    try:
        backend = get_backend("flashqla")
        world, rank = ctx.world_size, ctx.rank
        inputs = core_inputs(CP_CU[-1], SHAPE, 4, torch.bfloat16, seed=3)
        fp64 = {k: v.double() for k, v in inputs.items()}
        ref_o, ref_g = cp1_core_answer(fp64, SHAPE, CP_CU)
        rows = zigzag_rows(CP_CU, world, rank)
        plan = RouteCache().plan(CP_CU, world, rank)
        out = {}
        for mode in MODE_NAMES:
            leaves = {k: inputs[k][rows].detach().clone().requires_grad_(True) for k in ("qkv", "g", "beta")}
            weights = {k: inputs[k].detach().clone().requires_grad_(True) for k in ("conv_weight", "conv_bias")}
            o = gdn_core(leaves["qkv"], leaves["g"], leaves["beta"], weights["conv_weight"], weights["conv_bias"],
                         shape=SHAPE, mode=mode, plan=plan, group=dist.group.WORLD, backend=backend)
            o.backward(inputs["dout"][rows])
            errs = {"out": rel_l2(o.detach().double(), ref_o[rows])}
            errs.update({k: rel_l2(leaves[k].grad.double(), ref_g[k][rows]) for k in leaves})
            for k, w in weights.items():
                grad = w.grad.clone()
                dist.all_reduce(grad)
                errs[k] = rel_l2(grad.double(), ref_g[k])
            out[mode] = errs
        out["calls"] = [(c["H"], c["HV"], c["V"]) for c in fake_flashqla.CALLS]
        return out
    finally:
        fake_flashqla.uninstall()


def test_every_mode_at_cp2_matches_cp1(rank_pool):
    """headwise (1/cp of the heads, full sequences), all_gather (everything) and chunkwise (its own halo and
    state exchange: summaries from FlashQLA scans, the transition one in value blocks) on packed THD with
    sequences straddling ranks and empty slots, bf16, against the fp64 reference at CP=1 on the same rows."""
    results = rank_pool(2).run(_rank_modes)
    for rank, res in enumerate(results):
        for mode in ("headwise", "all_gather", "chunkwise"):
            bad = {k: e for k, e in res[mode].items() if not e < 1e-2}
            assert not bad, f"rank {rank} {mode}: rel-L2 vs CP=1 over 1e-2: {bad}"
        assert (1, 2, 128) in res["calls"] and (2, 4, 128) in res["calls"], res["calls"]  # headwise's half, the rest


def _gpu_module_calls(ctx, inputs, cp):
    """Every FlashQLA call of tests/gpu/test_flashqla_backend.py's generic modes at ``cp`` on this rank, through the
    stand-in: (key heads, value heads, initial state, final state, sequences)."""
    from tests.gpu import test_flashqla_backend as gpu

    fake_flashqla.install(record_only=True)  # which calls, not their values
    try:
        gpu._rank_modes(ctx, inputs, cp, "generic")
        return [(c["H"], c["HV"], c["h0"], c["final"], len(c["cu"]) - 1) for c in fake_flashqla.CALLS]
    finally:
        fake_flashqla.uninstall()


@pytest.mark.slow
def test_the_gpu_tests_compile_ahead_every_variant_they_call(rank_pool, fake, monkeypatch):
    """tests/gpu/test_flashqla_backend.py compiles its WARM list side by side before its first test (TileLang
    compiles one kernel after another in a process: 1 of its 22 tests in a cold 210 s call). Every FlashQLA call of
    its CP=1 baselines and of every mode at cp=2 and 4 (generic path), recorded here through the stand-in, is one
    of WARM's variants: the same key / value heads, initial and final state, and at most 5 sequences (at these
    heads FlashQLA's fused forward then takes its 32-wide value block, as WARM's calls do); the selftest's case
    is WARM's too."""
    from gdn_cp.cli.selftest import SELFTEST_CU, SELFTEST_DIMS
    from tests.gpu import test_flashqla_backend as gpu

    monkeypatch.setattr(gpu, "BASELINE_DEVICE", "cpu")
    monkeypatch.setattr(gpu, "_BASELINES", {})
    fake.CALLS.clear()
    inputs = {case: gpu._baseline(case)[0] for case in gpu.CASES}
    calls = [(c["H"], c["HV"], c["h0"], c["final"], len(c["cu"]) - 1) for c in fake.CALLS]
    for cp in (2, 4):
        calls += [c for rank in rank_pool(4).run(_gpu_module_calls, inputs, cp) for c in rank]
    warm = {(hk, hv, h0, final) for hk, hv, _, h0, final in gpu.WARM}
    assert {c[:4] for c in calls} <= warm and max(c[4] for c in calls) <= 5, sorted(set(calls))
    assert {(1, 2), (2, 4), (4, 8)} == {c[:2] for c in calls}  # 3 head shapes here, the realistic 16 / 32 the 4th
    assert max(len(cu) - 1 for hk, hv, cu, _, _ in gpu.WARM if hv <= 8) <= 5
    assert (SELFTEST_DIMS["num_k_heads"], SELFTEST_DIMS["num_v_heads"], tuple(sorted(set(SELFTEST_CU))), True,
            True) in gpu.WARM


def _rank_sync_test_counts(ctx):
    """tests/gpu/test_flashqla_backend.py's ``_rank_syncs`` through the stand-in, with torch's sync count stubbed:
    which of the test's own calls ran inside a counted call."""
    from tests.gpu import test_flashqla_backend as gpu

    fake_flashqla.install(record_only=True)
    counting, inside = [False], []
    saved = {name: getattr(gpu, name) for name in ("_leaves", "count_syncs", "first_sync_site", "BASELINE_DEVICE",
                                                   "_BASELINES")}
    leaves = gpu._leaves

    def recording_leaves(*args, **kwargs):
        inside.append(counting[0])
        return leaves(*args, **kwargs)

    def count(fn):
        counting[0] = True
        try:
            return fn(), ["called a synchronizing CUDA operation at x"]  # "syncs": the CP=1 check runs too
        finally:
            counting[0] = False

    try:
        gpu.BASELINE_DEVICE, gpu._BASELINES, gpu._leaves, gpu.count_syncs = "cpu", {}, recording_leaves, count
        gpu.first_sync_site = lambda fn: count(fn)[1][0]
        inp, _ = gpu._baseline("thd_docs")
        inside.clear()
        out = gpu._rank_syncs(ctx, inp, 2, "generic")
        return inside, sorted(out)
    finally:
        for name, value in saved.items():  # the pool's processes serve later tests
            setattr(gpu, name, value)
        fake_flashqla.uninstall()


def test_the_gpu_sync_test_makes_its_inputs_before_it_counts(rank_pool):
    """Run 2026-12-07f's FlashQLA zero-sync test counted its own inputs' five host->device copies (each a
    ``memcpy_and_sync``) as the layer's 5 syncs: the leaves were made inside the counted call. Every ``_leaves``
    call of the test now comes before a count starts, the CP=1 check's included."""
    for inside, keys in rank_pool(2).run(_rank_sync_test_counts):
        assert len(inside) == 5 and not any(inside), inside  # chunkwise: first, second; CP=1: first, second, third
        assert keys == ["backward", "cp1_first_sync", "cp1_second_call", "forward", "syncs"], keys


def test_the_first_use_says_what_it_costs_once_per_process(fake, caplog, monkeypatch, tmp_path):
    """FlashQLA's first use in a process logs, at INFO (Megatron-LM's default level), that its TileLang kernels compile
    now (minutes cold) and where their cache lives (issue 46: with TileLang's own INFO lines kept out, nothing else
    says it); once: the functions are looked up once per process."""
    import logging

    from gdn_cp.ops.flashqla import kernels

    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    kernels.flashqla_api.cache_clear()
    with caplog.at_level(logging.INFO, logger="gdn_cp.ops.flashqla.kernels"):
        kernels.flashqla_api()
        kernels.flashqla_api()
    said = [r.getMessage() for r in caplog.records if r.name == "gdn_cp.ops.flashqla.kernels"]
    assert len(said) == 1 and "compiles its TileLang kernels on first use" in said[0] and str(tmp_path) in said[0], said
