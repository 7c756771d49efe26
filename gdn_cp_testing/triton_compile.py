"""gdn-cp's Triton glue kernels compiled for a Hopper GPU (sm_90) on a machine without one.

Triton's interpreter (:mod:`gdn_cp_testing.triton_interpret`) runs a kernel's Python on the CPU, so it accepts
code the compiler refuses (two returns of different shapes from one function, say); this module runs the real
compiler, to a cubin with the ptxas Triton ships, and reads the cubin's registers and stack (spill) bytes per
thread with the cuobjdump Triton ships. The tests compile every kernel once; ``benchmarks/glue_kernels.py
--resources`` reads the pre-activation kernel at every autotuning config. Triton's own compile API (``ASTSource``,
``triton.compile``) is internal: a Triton that moves it fails here loudly, not silently.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

SM90 = ("cuda", 90, 32)
BF16_CONV = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "halo_ptr": "*bf16", "pos_ptr": "*i32",
             "dout_ptr": "*bf16", "out_ptr": "*bf16", "pre_ptr": "*fp32", "dw_ptr": "*fp32", "db_ptr": "*fp32",
             "dx_ptr": "*bf16", "scratch_ptr": "*fp32", "head_ptr": "*fp32"}
"""Pointer types of the conv kernels' arguments in a bf16 layer (every other argument: i32, EPS fp32)."""
BF16_GATES = {"a_ptr": "*bf16", "b_ptr": "*bf16", "decay_ptr": "*fp32", "dtb_ptr": "*bf16", "g_ptr": "*fp32",
              "beta_ptr": "*bf16", "dg_ptr": "*fp32", "dbeta_ptr": "*bf16", "da_ptr": "*bf16", "db_ptr": "*bf16",
              "ddecay_ptr": "*fp32", "ddtb_ptr": "*fp32"}


def compile_sm90(kernel, pointers: dict, constexprs: dict, num_warps: int = 4) -> dict:
    """``kernel`` (a ``@triton.jit`` function) compiled for sm_90 -> ``{"registers": n, "stack_bytes": n}`` per
    thread; raises Triton's CompilationError where the compiler refuses the code."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(kernel.arg_names)
    signature = {n: pointers.get(n) or ("constexpr" if n in constexprs else "fp32" if n == "EPS" else "i32")
                 for n in names}
    source = ASTSource(kernel, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns without it; the GPU's default
    compiled = triton.compile(source, target=GPUTarget(*SM90), options={"num_warps": num_warps})
    return cubin_resources(compiled.asm["cubin"])


def cubin_resources(cubin: bytes) -> dict:
    """Registers and stack bytes per thread of the one kernel in ``cubin`` (cuobjdump -res-usage)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", text)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{text}")
    return {"registers": int(found.group(1)), "stack_bytes": int(found.group(2))}


def conv_kernels(bt: int = 16, dim: int = 128, norm: bool = True, halo: bool = True):
    """``(name, kernel, pointers, constexprs)`` of the conv glue's kernels (every backward form)."""
    from gdn_cp.ops.fused import triton_conv as tc

    tile = {"D": dim, "BD": dim, "BT": bt, "W": 4, "HAS_BIAS": False, "HAS_HALO": halo, "NORM": norm}
    return (
        ("conv_fwd", tc.gdn_cp_glue_conv_fwd, BF16_CONV, tile),
        ("conv_bwd_pre", tc.gdn_cp_glue_conv_bwd_pre, BF16_CONV,
         {**tile, "SPAN": 64, "WP": 4}),
        ("conv_bwd_dx", tc.gdn_cp_glue_conv_bwd_dx, {**BF16_CONV, "pre_ptr": "*fp32", "w_ptr": "*bf16"},
         {"BT": 32, "BC": 128, "W": 4}),
        ("conv_bwd_one_pass", tc.gdn_cp_glue_conv_bwd, BF16_CONV, {**tile, "TAPS_ONCE": False}),
        ("conv_bwd_one_pass_taps", tc.gdn_cp_glue_conv_bwd, BF16_CONV, {**tile, "TAPS_ONCE": True}),
    )


def gates_kernels():
    from gdn_cp.ops.fused import triton_gates as tg

    return (("gates_fwd", tg.gdn_cp_glue_gates_fwd, BF16_GATES, {"BT": 64, "BH": 32}),
            ("gates_bwd", tg.gdn_cp_glue_gates_bwd, BF16_GATES, {"BT": 64, "BH": 32, "RUN": 16}))
