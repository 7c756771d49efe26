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
    assert len(compiled["conv"]) == 9
    for name, used in compiled["conv"].items():
        assert 0 < used["registers"] <= 255, (name, used)


def test_the_gate_kernels_compile_for_sm90(compiled):
    assert compiled["gates"] and all(used["registers"] > 0 for used in compiled["gates"].values()), compiled["gates"]


def test_the_taps_once_form_waits_less_in_each_tile(compiled):
    """``GDN_CP_GLUE=triton_taps_per_program``'s reason to exist, as compiled (the GPU has not timed it): with its
    taps loaded once a program, the one-pass backward's tile loop (16 rows, 4 warps, l2 norm, bias, as launched)
    has fewer barriers and fewer instructions than the shipped form's, which loads each tap 1-D in every tile."""
    every_tile, once, x = (compiled["forms"][name] for name in ("every_tile", "taps_once", "x_once"))
    assert once["loop_barriers"] < every_tile["loop_barriers"], (once, every_tile)
    assert once["loop_instructions"] < 0.9 * every_tile["loop_instructions"], (once, every_tile)
    # ``X_ONCE`` (GDN_CP_GLUE=triton_norm_dz_copy_x_once): each tile's x rows loaded once, not twice: fewer
    # instructions again, and none of the taps form's spill (it kept 255 registers and spilled on the H100, run
    # 2026-12-06c, which its layer rows paid back)
    assert x["loop_instructions"] < 0.8 * every_tile["loop_instructions"] and x["stack_bytes"] == 0, (x, once)
    assert x["loop_barriers"] == once["loop_barriers"], (x, once)


def test_narrow_programs_take_fewer_registers(compiled):
    """``GDN_CP_GLUE=triton_norm_dz_copy_narrow``'s reason to exist, as compiled (the GPU has not timed it): the
    one-pass backward (4 warps, a bias, as launched) keeps 255 registers a thread at 16 rows of whole 128-channel
    heads, which holds it to 2 programs an SM (run 2026-12-06h). v (no l2 norm) in blocks of 64 channels, and q / k
    (the norm needs the whole head) in tiles of 8 rows, each take at most 128, so 4 programs fit an SM (65,536
    registers, 128 threads a program). ``triton_norm_dz_copy_norm_pass`` runs q and k as v's blocks after the l2
    norm's backward alone, a light kernel (at most 64)."""
    whole, narrow = compiled["forms"]["every_tile"], compiled["narrow"]
    assert whole["registers"] == 255, whole
    for name in ("v_block", "q_fine"):
        assert narrow[name]["registers"] <= 128 and narrow[name]["stack_bytes"] == 0, (name, narrow[name])
    assert narrow["l2norm_bwd"]["registers"] <= 64, narrow["l2norm_bwd"]


def test_the_scan_keeps_few_registers_and_no_barrier(compiled):
    """``GDN_CP_GLUE=triton_norm_dz_copy_scan``'s reason to exist, as compiled (the GPU has not timed it): a step of
    the scan (one row of 4 heads of 128, 4 warps, as launched) needs no barrier (its time shifts are registers),
    where the one-pass backward's tile waits at 6 or more; without a conv bias (Megatron's GDN default) at most 128
    registers a thread with the l2 norm and without: 4 programs an SM instead of 2 (with a bias, q's: 146, 3)."""
    for name, used in compiled["scan"].items():
        assert used["loop_barriers"] == 0 and used["stack_bytes"] == 0, (name, used)
        assert used["registers"] <= (128 if name in ("q", "v", "q_fwd") else 168), (name, used)
    assert compiled["forms"]["x_once"]["loop_barriers"] >= 6, compiled["forms"]["x_once"]


def test_the_unrolled_scan_issues_fewer_instructions_a_step(compiled):
    """The backward scan's autotuning also offers 4 steps a loop pass (``UNROLL``): its rolling windows are then
    renamed, not moved, so a step issues fewer instructions (q: ~280 against 339), for more registers (168, still no
    spill). Whether that wins is the GPU's to say (the autotuner picks; glue_kernels records its pick)."""
    scan = compiled["scan"]
    for name in ("q", "v"):
        once, unrolled = scan[name], scan[f"{name}_unroll4"]
        assert unrolled["loop_instructions"] / 4 < 0.9 * once["loop_instructions"], (name, once, unrolled)
