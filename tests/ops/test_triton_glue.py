"""gdn-cp's Triton glue kernels (gdn_cp.ops.fused.triton_conv / triton_gates / triton_norm) on the CPU through Triton's
interpreter, against the plain-torch glue: packed sequences with empty slots and one-row sequences, a
halo, grouped value heads, head dims that are not powers of two, strided inputs, forward and backward.
fp32 must agree to float rounding; fp16 (which the interpreter rounds as a GPU does) to within one
rounding of the outputs. bf16 on a GPU: tests/gpu/test_fused_glue_gpu.py."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from tests.conftest import start_smoke_run

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="Triton is not installed (the interpreter runs the kernels on the CPU)")


# the interpreter's run (~55 CPU s on 2 cores) starts in the background when the session starts
# (tests/conftest.py), beside the tests that run in this process
SMOKE_RUNS = {"cases": ("gdn_cp_testing.triton_interpret", [], {"TRITON_INTERPRET": "1"})}


@pytest.fixture(scope="module")
def run():
    code, printed, out = start_smoke_run(sys.modules[__name__], "cases").result(timeout_s=300)
    assert code == 0, printed[-3000:]
    return printed, out


@pytest.fixture(scope="module")
def cases(run):
    return {c["case"]: c for c in json.loads(run[1].read_text())}


def test_the_interpreter_patches_triton_language_once_per_launch(run):
    """``gdn_cp_testing.triton_interpret.patch_triton_language_once_per_launch``: the run's nested ``@triton.jit`` calls
    no longer patch ``triton.language`` again (54 against ~70 CPU s for the same cases, the same results to the bit,
    2026-12-08); on a Triton whose interpreter differs it does nothing and says so, and this fails to say that the
    run is slower again."""
    assert "triton.language patched once per launch: True" in run[0], run[0][-2000:]


def test_every_case_ran(cases):
    assert len(cases) == 29 and sum(name.startswith("conv") for name in cases) == 24
    assert sum(name.startswith("norm") for name in cases) == 3
    assert sum("chunk=one_pass" in name for name in cases) == 6  # the one-pass backward beside the two-pass one
    assert sum("chunk=scan" in name for name in cases) == 12  # the backward as a scan down the rows
    # four with the scan's masks by branches (SCAN_BRANCH_MASKS: off by default), each the one-pass backward's bits
    branch = [case for name, case in cases.items() if "branch" in name.split("chunk=")[-1].split()]
    assert len(branch) == 4 and all(case["dx_dhalo_equal_one_pass"] for case in branch), branch
    # three with the halo apart (HALO_ROWS_APART, SCAN_HALO_TAIL: off by default): 3 spans, a 1-row first sequence, 5 rows
    assert sum("chunk=scan 16 apart" in name and "halo=True" in name and "branch" not in name for name in cases) == 3
    # a conv narrower than Megatron's 4 taps through each backward (the kernels keep four tap sums and lags)
    assert {name.split("chunk=")[1].split()[0] for name in cases if "width=" in name} == {"7", "one_pass", "scan"}
    # q and k written 2 or 3 times a head (``kv_repeat``): one case per backward that reads them (the two-pass,
    # one-pass and scan backwards; the forward writes them in each); the values are checked against the plain glue's
    # ``repeat_interleave`` with every other case
    assert {name.split("chunk=")[1].split()[0] for name in cases if "repeat=" in name} == {"7", "one_pass", "scan"}


def test_conv_outputs_and_gradients_equal_the_plain_glue(cases):
    for name, case in cases.items():
        if not name.startswith("conv"):
            continue
        assert case["contiguous"], name
        assert case.get("dx_laid_out_like_x", True), name
        # fp32: summation order only; fp16: the outputs round at the same points (1e-3 is one fp16 ulp
        # in every element), gradients through one rounding of the l2 norm's gradient
        tol = 1e-6 if "float32" in name else 2e-3
        bad = {k: v for k, v in case["errors"].items() if not v <= tol}
        assert not bad, f"{name}: {bad}"


def test_every_backward_writes_dx_into_in_projs_rows(cases):
    """dx is in_proj's gradient's columns of x's group (no copy, no concatenation in split_columns' backward):
    checked once per backward (the first case of each; they allocate dx alike)."""
    checked = {case["family"] for case in cases.values() if case.get("dx_laid_out_like_x")}
    assert checked == {"two_pass", "one_pass", "scan"}, checked


def test_the_scan_gives_the_one_pass_backwards_bits(cases):
    """``GDN_CP_GLUE=triton_norm_dz_copy_scan``'s backward computes each element with the one-pass backward's
    arithmetic in its order, rows rolled in registers instead of shared through a scratch tile: dx and the halo's
    gradient bit for bit the same (spans whose W-1 rows after them belong to the next program; a program whose second
    head is past the group; q and k written twice a head; a conv of 2 taps; row 0's sequence 1 row long)."""
    scan = [case for name, case in cases.items() if "chunk=scan" in name]
    assert len(scan) == 12 and all(case["dx_dhalo_equal_one_pass"] for case in scan), scan


def test_fp16_outputs_round_where_the_plain_glue_rounds(cases):
    """The same rounding points give the same bits (a kernel rounding once, or twice elsewhere, would not)."""
    for name, case in cases.items():
        if name.startswith("conv float16"):
            assert max(case["errors"][k] for k in ("q", "k", "v")) < 1e-3, name


def test_gates_equal_stocks_expression(cases):
    for name in ("gates float32", "gates float16"):
        case = cases[name]
        assert case["dtypes_match"], name
        tol = 1e-6 if "float32" in name else 2e-3
        bad = {k: v for k, v in case["errors"].items() if not v <= tol}
        assert not bad, f"{name}: {bad}"


def test_the_gated_norm_equals_flas_math_and_writes_dz_into_in_projs_gradient(cases):
    """The gated RMSNorm's output, o's, z's (inside in_proj's rows) and the weight's gradients against FLA's
    rms_norm_gated math in plain torch; dz written as z's columns of one in_proj-shaped buffer, or (dz_in_place
    off, glue path triton_norm_dz_copy) into a tensor of its own."""
    for name, case in cases.items():
        if not name.startswith("norm"):
            continue
        assert case["dz_into_rows"] == name.endswith("dz_in_place=True"), name
        tol = 1e-6 if "float32" in name else 2e-3
        bad = {k: v for k, v in case["errors"].items() if not v <= tol}
        assert not bad, f"{name}: {bad}"


def test_tuned_configs_report_every_launchers_picks(monkeypatch):
    """``benchmarks/glue_kernels.py`` records autotuning's picks: every key a launcher tuned, a launcher that picked
    nothing yet left out."""
    from types import SimpleNamespace

    from gdn_cp.ops.fused import triton_launch

    pick = SimpleNamespace(kwargs={"HB": 4, "UNROLL": 4}, num_warps=4)
    monkeypatch.setattr(triton_launch, "_TUNED", {
        "bwd": SimpleNamespace(cache={(128, 4): pick, (64, 4): pick}), "unused": SimpleNamespace(cache={})})
    assert triton_launch.tuned_configs() == {"bwd": {"(128, 4)": "{'HB': 4, 'UNROLL': 4}, num_warps 4",
                                                      "(64, 4)": "{'HB': 4, 'UNROLL': 4}, num_warps 4"}}


def test_autotuned_launchers_keep_their_picks_in_tritons_cache(monkeypatch):
    """On a GPU each launcher autotunes with ``cache_results`` (as FLA's ``FLA_CACHE_RESULTS``): a later process, or a
    device call that carries the ``*.autotune.json`` files (benchmarks/suite_caches.sh), reads the pick instead of
    timing every config again."""
    import triton

    from gdn_cp.ops.fused import triton_conv, triton_launch

    if not triton_launch._CACHE_RESULTS:
        pytest.skip(f"Triton {triton.__version__} has no autotune cache_results (Triton >= 3.2 has)")
    monkeypatch.setattr(triton_launch, "INTERPRETED", False)
    monkeypatch.setattr(triton_launch, "_TUNED", {})
    triton_launch.launcher(triton_conv.gdn_cp_glue_conv_fwd, ["D"], triton_launch.TILE_CONFIGS, {})
    tuned = triton_launch._TUNED["gdn_cp_glue_conv_fwd"]
    assert tuned.cache_results is True and len(tuned.configs) == len(triton_launch.TILE_CONFIGS)


@pytest.mark.parametrize("rows", [1, 2, 40])
def test_the_forward_reads_the_halo_in_a_launch_of_its_own_where_asked(monkeypatch, rows):
    """With ``HALO_ROWS_APART`` on (layer_full's lever ``halo_apart``) and a halo, the forward launches each group
    twice: every row without the halo, then rows 0..W-2 (fewer where there are fewer rows) with it, so the halo's loads
    stay out of every other tile (docs: run 2026-12-07n); without one, once. Off (the default since run 2026-12-07q):
    once, with the halo. The launches recorded, not run (the values: the interpreter's cases above)."""
    import torch

    from gdn_cp.ops.fused import triton_conv

    assert triton_conv.HALO_ROWS_APART is False  # the layer did not show it faster (run 2026-12-07q)
    launched = []
    monkeypatch.setattr(triton_conv, "_fwd", lambda grid, *args, **meta: launched.append(
        (grid({"BT": 16}), args[8], meta["HAS_HALO"])))  # args[8]: the rows the launch covers (T)
    x, weight = torch.zeros(rows, 3 * 16), torch.zeros(3 * 16, 4)
    positions = torch.arange(rows, dtype=torch.int32)
    tiles = triton_conv.triton.cdiv(rows, 16)
    for apart in (True, False):
        monkeypatch.setattr(triton_conv, "HALO_ROWS_APART", apart)
        for halo in (torch.zeros(3, 3 * 16), None):
            launched.clear()
            triton_conv.conv_silu_split_triton(x, weight, None, positions, halo, 1, 1, 16, 16, True, 1e-6, scan=True)
            if halo is None:
                assert launched == [((tiles, 1), rows, False)] * 3, launched
            elif apart:
                assert launched == [((tiles, 1), rows, False), ((1, 1), min(rows, 3), True)] * 3, launched
            else:
                assert launched == [((tiles, 1), rows, True)] * 3, launched


def test_the_scan_reads_the_halo_in_its_tail_loop_where_asked(monkeypatch):
    """With a halo and ``SCAN_HALO_TAIL`` on, the backward's scan is launched once per group with ``HALO_TAIL`` (its
    rows 8 and up in a loop that reads no halo, the rows below in a second loop that does: the values are the
    interpreter's ``apart`` cases, the same bits as the one-pass backward's); off (the default until a GPU run times
    it), or without a halo: ``HALO_TAIL`` False. The launches recorded, not run."""
    import torch

    from gdn_cp.ops.fused import triton_conv

    assert triton_conv.SCAN_HALO_TAIL is False
    launched = []
    monkeypatch.setattr(triton_conv, "_fwd", lambda grid, *args, **meta: None)
    monkeypatch.setattr(triton_conv, "_scan", lambda grid, *args, **meta: launched.append(
        (meta["HAS_HALO"], meta["HALO_TAIL"])))
    x = torch.zeros(40, 3 * 16, requires_grad=True)
    weight = torch.zeros(3 * 16, 4)
    positions = torch.arange(40, dtype=torch.int32)
    for tail in (True, False):
        monkeypatch.setattr(triton_conv, "SCAN_HALO_TAIL", tail)
        for halo in (torch.zeros(3, 3 * 16), None):
            q, k, v = triton_conv.conv_silu_split_triton(x, weight, None, positions, halo, 1, 1, 16, 16, True, 1e-6,
                                                         scan=True)
            launched.clear()
            torch.autograd.grad((q, k, v), x, (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)))
            assert launched == [(halo is not None, halo is not None and tail)] * 3, (tail, launched)


def test_the_scan_masks_by_branches_where_asked(monkeypatch):
    """``SCAN_BRANCH_MASKS`` on: the backward's scan is launched with ``BRANCH`` (the sequence masks by uniform
    branches: the interpreter's ``branch`` cases, the same bits as the one-pass backward's); off (the default until a
    GPU run times it): ``BRANCH`` False. The launches recorded, not run."""
    import torch

    from gdn_cp.ops.fused import triton_conv

    assert triton_conv.SCAN_BRANCH_MASKS is False
    launched = []
    monkeypatch.setattr(triton_conv, "_fwd", lambda grid, *args, **meta: None)
    monkeypatch.setattr(triton_conv, "_scan", lambda grid, *args, **meta: launched.append(meta["BRANCH"]))
    x = torch.zeros(40, 3 * 16, requires_grad=True)
    for branch in (True, False):
        monkeypatch.setattr(triton_conv, "SCAN_BRANCH_MASKS", branch)
        q, k, v = triton_conv.conv_silu_split_triton(x, torch.zeros(3 * 16, 4), None, torch.arange(40, dtype=torch.int32),
                                                     None, 1, 1, 16, 16, True, 1e-6, scan=True)
        launched.clear()
        torch.autograd.grad((q, k, v), x, (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)))
        assert launched == [branch] * 3, (branch, launched)
