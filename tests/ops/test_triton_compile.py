"""gdn-cp's Triton glue kernels compile for a Hopper GPU (sm_90) on a
machine without a GPU (Triton's compiler and ptxas; gdn_cp_testing.triton_compile). The interpreter tests
(test_triton_glue.py) check the values; this checks what the interpreter cannot: that the compiler takes the
code (a function whose constexpr branches return different shapes ran in the interpreter and failed here)."""

from __future__ import annotations

import importlib.util
import os

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")


def _ptxas_missing() -> bool:
    import triton

    return not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))


def test_the_conv_kernels_compile_for_sm90():
    if _ptxas_missing():
        pytest.skip("this Triton ships no ptxas (Triton's CUDA backend is needed to compile for sm_90)")
    from gdn_cp_testing.triton_compile import compile_sm90, conv_kernels

    for name, kernel, pointers, constexprs in conv_kernels():
        used = compile_sm90(kernel, pointers, constexprs)
        assert 0 < used["registers"] <= 255, (name, used)


def test_the_gate_kernels_compile_for_sm90():
    if _ptxas_missing():
        pytest.skip("this Triton ships no ptxas (Triton's CUDA backend is needed to compile for sm_90)")
    from gdn_cp_testing.triton_compile import compile_sm90, gates_kernels

    for name, kernel, pointers, constexprs in gates_kernels():
        assert compile_sm90(kernel, pointers, constexprs)["registers"] > 0, name


def test_the_taps_once_form_waits_less_in_each_tile():
    """``GDN_CP_GLUE=triton_taps_per_program``'s reason to exist, as compiled (the GPU has not timed it): with its
    taps loaded once a program, the one-pass backward's tile loop (16 rows, 4 warps, l2 norm, bias, as launched)
    has fewer barriers and fewer instructions than the shipped form's, which loads each tap 1-D in every tile."""
    if _ptxas_missing():
        pytest.skip("this Triton ships no ptxas (Triton's CUDA backend is needed to compile for sm_90)")
    from gdn_cp_testing.triton_compile import compile_sm90, conv_kernels

    (_, kernel, pointers, shipped), (_, _, _, taps_once), (_, _, _, x_once) = \
        conv_kernels(16, 128, norm=True, halo=False)[3:6]
    every_tile, once, x = (compile_sm90(kernel, pointers, {**c, "HAS_BIAS": True}, 4, as_launched=True)
                           for c in (shipped, taps_once, x_once))
    assert once["loop_barriers"] < every_tile["loop_barriers"], (once, every_tile)
    assert once["loop_instructions"] < 0.9 * every_tile["loop_instructions"], (once, every_tile)
    # ``X_ONCE`` (GDN_CP_GLUE=triton_norm_dz_copy_x_once): each tile's x rows loaded once, not twice: fewer
    # instructions again, and none of the taps form's spill (it kept 255 registers and spilled on the H100, run
    # 2026-12-06c, which its layer rows paid back)
    assert x["loop_instructions"] < 0.8 * every_tile["loop_instructions"] and x["stack_bytes"] == 0, (x, once)
    assert x["loop_barriers"] == once["loop_barriers"], (x, once)


def test_narrow_programs_take_fewer_registers():
    """``GDN_CP_GLUE=triton_norm_dz_copy_narrow``'s reason to exist, as compiled (the GPU has not timed it): the
    one-pass backward (4 warps, a bias, as launched) keeps 255 registers a thread at 16 rows of whole 128-channel
    heads, which holds it to 2 programs an SM (run 2026-12-06h). v (no l2 norm) in blocks of 64 channels, and q / k
    (the norm needs the whole head) in tiles of 8 rows, each take at most 128, so 4 programs fit an SM (65,536
    registers, 128 threads a program). ``triton_norm_dz_copy_norm_pass`` runs q and k as v's blocks after the l2
    norm's backward alone, a light kernel (at most 64)."""
    if _ptxas_missing():
        pytest.skip("this Triton ships no ptxas (Triton's CUDA backend is needed to compile for sm_90)")
    from gdn_cp_testing.triton_compile import compile_sm90, conv_kernels

    def one_pass(bt, dim, norm):
        _, kernel, pointers, c = conv_kernels(bt, dim, norm=norm, halo=False)[3]
        return compile_sm90(kernel, pointers, {**c, "HAS_BIAS": True}, 4, as_launched=True)

    whole, v_block, q_fine = one_pass(16, 128, True), one_pass(16, 64, False), one_pass(8, 128, True)
    assert whole["registers"] == 255, whole
    assert v_block["registers"] <= 128 and v_block["stack_bytes"] == 0, v_block
    assert q_fine["registers"] <= 128 and q_fine["stack_bytes"] == 0, q_fine
    _, kernel, pointers, c = conv_kernels(16, 128, norm=True, halo=False)[6]
    assert compile_sm90(kernel, pointers, {**c, "HAS_BIAS": True}, 4, as_launched=True)["registers"] <= 64
