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
