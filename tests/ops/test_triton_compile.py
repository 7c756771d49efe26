"""gdn-cp's Triton glue kernels compile for a Hopper GPU (sm_90) on a
machine without a GPU (Triton's compiler and ptxas; gdn_cp_testing.triton_compile). The interpreter tests
(test_triton_glue.py) check the values; this checks what the interpreter cannot: that the compiler takes the
code (a function whose constexpr branches return different shapes ran in the interpreter and failed here). The
compiles run in one process of their own, started in the background when the session starts
(gdn_cp_testing.triton_compile.tests_report, ~7 CPU s), so the tests here read its report."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from tests.conftest import start_smoke_run

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

SMOKE_RUNS = {"compiled": ("gdn_cp_testing.triton_compile", [])}


@pytest.fixture(scope="module")
def compiled():
    code, printed, out = start_smoke_run(sys.modules[__name__], "compiled").result(timeout_s=300)
    assert code == 0, printed[-3000:]  # a kernel the compiler refuses: its CompilationError
    report = json.loads(out.read_text())
    if "skipped" in report:
        pytest.skip(report["skipped"])
    return report


def test_the_conv_kernels_compile_for_sm90(compiled):
    assert len(compiled["conv"]) == 5
    for name, used in compiled["conv"].items():
        assert 0 < used["registers"] <= 255, (name, used)


def test_the_gate_kernels_compile_for_sm90(compiled):
    assert compiled["gates"] and all(used["registers"] > 0 for used in compiled["gates"].values()), compiled["gates"]


def test_the_scan_keeps_few_registers_and_no_barrier(compiled):
    """``GDN_CP_GLUE=triton_norm_dz_copy_scan``'s reason to exist, as compiled (the GPU timed it since: runs
    2026-12-06l-o): a step of the scan (one row of 4 heads of 128, 4 warps, as launched) needs no barrier (its time
    shifts are registers), where the one-pass backward's tile (16 rows, 4 warps, l2 norm, bias) waits at 6 or more;
    without a conv bias (Megatron's GDN default) at most 128 registers a thread with the l2 norm and without, and
    with a halo (a CP rank's rows that continue a sequence): 4 programs an SM, where the one-pass backward's 255 fit 2
    (with a bias, q's: 146, 3). The halo's gradient is summed after the scan (``triton_conv._halo_gradient``):
    computed in the scan after its loop, the halo's q scan took 146 registers."""
    for name, used in compiled["scan"].items():
        assert used["loop_barriers"] == 0 and used["stack_bytes"] == 0, (name, used)
        assert used["registers"] <= (128 if name in ("q", "v", "q_halo") else 168), (name, used)
    one_pass = compiled["one_pass"]
    assert one_pass["loop_barriers"] >= 6 and one_pass["registers"] == 255, one_pass


def test_the_forward_keeps_the_halo_out_of_its_main_launch(compiled):
    """The forward runs every row without the halo, then rows 0..W-2 again with it (the only rows that read it): the
    halo's loads and masks took registers from every tile (sm_90, 16 rows of a q head, 4 warps: 84 against 50), and a
    rank whose rows continue a sequence paid 12-15% more for its forward (run 2026-12-07n, H100, kernel time)."""
    forward = compiled["forward"]
    assert forward["plain"]["registers"] < forward["halo"]["registers"], forward


def test_the_unrolled_scan_issues_fewer_instructions_a_step(compiled):
    """The backward scan's autotuning also offers 4 steps a loop pass (``UNROLL``): its rolling windows are then
    renamed, not moved, so a step issues fewer instructions (q: ~280 against 339), for more registers (168, still no
    spill). Whether that wins is the GPU's to say (the autotuner picks; glue_kernels records its pick)."""
    scan = compiled["scan"]
    for name in ("q", "v"):
        once, unrolled = scan[name], scan[f"{name}_unroll4"]
        assert unrolled["loop_instructions"] / 4 < 0.9 * once["loop_instructions"], (name, once, unrolled)


def test_the_scan_with_the_halo_in_its_tail_loop_runs_the_loop_of_a_rank_without_one(compiled):
    """``triton_conv.SCAN_HALO_TAIL``'s reason to exist, as compiled (not yet timed on a GPU): q's scan as autotuned
    on an H100 (2 warps, unrolled by 4, 255 registers) spills 40 bytes a thread and issues 7% more instructions a
    step when every step may read the halo (run 2026-12-07r: 21% slower with a halo, 165 against 136 us); with the
    halo read in the tail loop only, no spill, and its main loop within 1% of a rank's without a halo."""
    q = compiled["scan_2_warps"]
    assert q["q_halo"]["stack_bytes"] > 0 and q["q"]["stack_bytes"] == 0, q
    assert q["q_halo"]["loop_instructions"] > 1.05 * q["q"]["loop_instructions"], q
    assert q["q_halo_tail"]["stack_bytes"] == 0 and q["q_halo_tail"]["loop_barriers"] == 0, q
    assert q["q_halo_tail"]["loop_instructions"] <= 1.01 * q["q"]["loop_instructions"], q


def test_the_scan_with_its_masks_by_branches_issues_fewer_instructions_a_step(compiled):
    """``triton_conv.SCAN_BRANCH_MASKS``' reason to exist, as compiled (not yet timed on a GPU): with the sequence
    masks as selects, every element of every step pays 9 of its instructions for them (q's loop as autotuned on an
    H100: 2 warps, unrolled by 4, 1,975 instructions a pass); by uniform branches, taken only at a sequence's first
    three rows and its last, the loop's common path issues 1,745 (12% fewer), no spill. (Compiled once, not kept in
    the suite's time: v 1,313 against 1,594, 18% fewer; q with the halo in the tail loop 1,748, no spill.)"""
    select, branch = compiled["scan_2_warps"]["q"], compiled["scan_branch"]["q_branch"]
    assert branch["loop_common_path"] < 0.92 * select["loop_common_path"] <= 0.92 * branch["loop_instructions"], (
        select, branch)
    assert branch["stack_bytes"] == 0 and branch["loop_barriers"] == 0, branch


def test_the_flush_to_zero_sigmoid_issues_fewer_instructions_a_step(compiled):
    """``triton_conv.FTZ_SIGMOID``'s reason to exist, as compiled (not yet timed on a GPU): ``tl.sigmoid``'s
    full-range ``ex2.approx.f32`` and ``div.full.f32`` take 12 instructions an element on sm_90; in flush-to-zero
    approximations ~4. q's loop with the masks by branches as autotuned (2 warps, unrolled by 4): 1,745 instructions
    a pass on its common path, 1,487 with it (15% fewer), no spill. (Compiled once: without the branches 1,975 against
    1,719; v with the branches 1,313 against 1,055.)"""
    branch, ftz = compiled["scan_branch"]["q_branch"], compiled["scan_branch"]["q_branch_ftz"]
    assert ftz["loop_common_path"] < 0.9 * branch["loop_common_path"], (branch, ftz)
    assert ftz["stack_bytes"] == 0 and ftz["loop_barriers"] == 0, ftz

