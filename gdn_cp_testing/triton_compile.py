"""gdn-cp's Triton glue kernels compiled for a Hopper GPU (sm_90) on a machine without one.

Triton's interpreter (:mod:`gdn_cp_testing.triton_interpret`) runs a kernel's Python on the CPU, so it accepts
code the compiler refuses (two returns of different shapes from one function, say); this module runs the real
compiler, to a cubin with the ptxas Triton ships, and reads the cubin's registers and stack (spill) bytes per
thread with the cuobjdump Triton ships. The tests compile every kernel once.
Triton's own compile API (``ASTSource``, ``triton.compile``) is internal: a Triton that moves it fails here
loudly, not silently.
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


AS_LAUNCHED_INTS = ("x_stride", "dx_stride", "halo_stride", "C0", "T", "SPAN", "HEADS")
"""Integer arguments that a launch at the layer's shapes passes as multiples of 16 (Triton specializes a launch on
that, as it does on every pointer's 16-byte alignment): with those hints the compiled code is what the GPU runs, its
loads vectorized; without them it is much longer."""


def compile_sm90(kernel, pointers: dict, constexprs: dict, num_warps: int = 4, as_launched: bool = False) -> dict:
    """``kernel`` (a ``@triton.jit`` function) compiled for sm_90 -> ``{"registers": n, "stack_bytes": n}`` per
    thread; raises Triton's CompilationError where the compiler refuses the code. ``as_launched``: with the hints
    of :data:`AS_LAUNCHED_INTS` and aligned pointers, and the tile loop read too (:func:`tile_loop`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(kernel.arg_names)
    signature = {n: pointers.get(n) or ("constexpr" if n in constexprs else "fp32" if n == "EPS" else "i32")
                 for n in names}
    hints = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if as_launched and n not in constexprs and (n.endswith("_ptr") or n in AS_LAUNCHED_INTS)}
    source = ASTSource(kernel, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                       attrs=hints)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns without it; the GPU's default
    compiled = triton.compile(source, target=GPUTarget(*SM90), options={"num_warps": num_warps})
    used = cubin_resources(compiled.asm["cubin"])
    return {**used, **tile_loop(compiled.asm["cubin"])} if as_launched else used


def _cuobjdump(cubin: bytes, flag: str) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def tile_loop(cubin: bytes) -> dict:
    """``{"loop_instructions": n, "loop_barriers": n, "loop_common_path": n}`` per thread in one pass of the kernel's
    widest loop (the longest backward branch of its SASS: a row-tile loop), a static count: what one tile costs in
    issued instructions, and how often its warps wait for each other (BAR); ``loop_common_path``: the instructions
    left when every conditional forward branch in the loop is taken (the blocks a uniform ``if`` skips, e.g. the
    scan's masks at a sequence's first and last rows, not counted)."""
    code = re.findall(r"/\*([0-9a-f]{4,})\*/\s+((?:@!?U?P\w+\s+)?)([A-Z][A-Z0-9_.]*)([^;]*);",
                      _cuobjdump(cubin, "-sass"))
    code = [(int(at, 16), guard.strip(), op, re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None)
            for at, guard, op, rest in code]
    spans = [(int(target.group(1), 16), at) for at, _, _, target in code if target and int(target.group(1), 16) < at]
    if not spans:
        return {"loop_instructions": 0, "loop_barriers": 0, "loop_common_path": 0}
    low, high = max(spans, key=lambda span: span[1] - span[0])
    body = [(at, guard, op, target) for at, guard, op, target in code if low <= at <= high]
    skipped = [(at, int(target.group(1), 16)) for at, guard, _, target in body
               if guard and target and int(target.group(1), 16) > at]
    return {"loop_instructions": len(body), "loop_barriers": sum(op.startswith("BAR") for _, _, op, _ in body),
            "loop_common_path": sum(not any(a < at < b for a, b in skipped) for at, _, _, _ in body)}


def cubin_resources(cubin: bytes) -> dict:
    """Registers and stack bytes per thread of the one kernel in ``cubin`` (cuobjdump -res-usage)."""
    text = _cuobjdump(cubin, "-res-usage")
    found = re.search(r"REG:(\d+) STACK:(\d+)", text)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{text}")
    return {"registers": int(found.group(1)), "stack_bytes": int(found.group(2))}


def conv_kernels(bt: int = 16, dim: int = 128, norm: bool = True, halo: bool = True):
    """``(name, kernel, pointers, constexprs)`` of the conv glue's kernels: the forward, the two-pass backward's two,
    the one-pass backward (``[3]``), the backward's scan (4 heads a program)."""
    from gdn_cp.ops.fused import triton_conv as tc

    tile = {"D": dim, "BD": dim, "BT": bt, "W": 4, "HAS_BIAS": False, "HAS_HALO": halo, "NORM": norm, "REPEAT": 1}
    return (
        ("conv_fwd", tc.gdn_cp_glue_conv_fwd, BF16_CONV, {**tile, "FTZ": False}),
        ("conv_bwd_pre", tc.gdn_cp_glue_conv_bwd_pre, BF16_CONV,
         {**tile, "SPAN": 64, "WP": 4}),
        ("conv_bwd_dx", tc.gdn_cp_glue_conv_bwd_dx, {**BF16_CONV, "pre_ptr": "*fp32", "w_ptr": "*bf16"},
         {"BT": 32, "BC": 128, "W": 4}),
        ("conv_bwd_one_pass", tc.gdn_cp_glue_conv_bwd, BF16_CONV, tile),
        ("conv_bwd_scan", tc.gdn_cp_glue_conv_bwd_scan, BF16_CONV,
         {**{k: v for k, v in tile.items() if k != "BT"}, "HB": 4, "UNROLL": 1, "HALO_TAIL": False, "BRANCH": False,
          "FTZ": False}),
    )


def gates_kernels():
    from gdn_cp.ops.fused import triton_gates as tg

    return (("gates_fwd", tg.gdn_cp_glue_gates_fwd, BF16_GATES, {"BT": 64, "BH": 32}),
            ("gates_bwd", tg.gdn_cp_glue_gates_bwd, BF16_GATES, {"BT": 64, "BH": 32, "RUN": 16}))


def ptxas_missing() -> str | None:
    """Why nothing can compile for sm_90 here, or None: this Triton ships no ptxas (its CUDA backend)."""
    import triton

    if os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        return None
    return "this Triton ships no ptxas (Triton's CUDA backend is needed to compile for sm_90)"


def tests_report() -> dict:
    """What tests/ops/test_triton_compile.py checks, compiled in one process of its own (a background run of the test
    session, ~7 CPU s): every kernel as the tests' default shape compiles; the one-pass backward as launched (16
    rows, 4 warps, l2 norm, bias); the backward's scan (4 heads a program, 4 warps), with and without the l2 norm,
    without a bias (Megatron's GDN conv has none by default) and, for q, with one, with a halo, and unrolled by 4;
    q's scan at 2 warps unrolled by 4 without a halo, with one in every step and with one in the tail loop only, and
    with the sequence masks by branches (and the flush-to-zero sigmoid)."""
    skipped = ptxas_missing()
    if skipped:
        return {"skipped": skipped}

    def as_launched(bt, dim, norm, index, bias=True, halo=False, warps=4, **more):
        _, kernel, pointers, c = conv_kernels(bt, dim, norm=norm, halo=halo)[index]
        return compile_sm90(kernel, pointers, {**c, "HAS_BIAS": bias, **more}, warps, as_launched=True)

    return {"conv": {name: compile_sm90(k, p, c) for name, k, p, c in conv_kernels()},
            "gates": {name: compile_sm90(k, p, c) for name, k, p, c in gates_kernels()},
            "one_pass": as_launched(16, 128, True, 3),
            "forward": {"plain": as_launched(16, 128, True, 0, bias=False),
                        "halo": as_launched(16, 128, True, 0, bias=False, halo=True)},
            "scan": {"q": as_launched(16, 128, True, 4, bias=False), "v": as_launched(16, 128, False, 4, bias=False),
                     "q_bias": as_launched(16, 128, True, 4),
                     "q_halo": as_launched(16, 128, True, 4, bias=False, halo=True),
                     "q_unroll4": as_launched(16, 128, True, 4, bias=False, UNROLL=4),
                     "v_unroll4": as_launched(16, 128, False, 4, bias=False, UNROLL=4)},
            # q as autotuned on an H100 (run 2026-12-07r: 2 warps, unrolled by 4), with a halo in every step and in
            # the tail loop only (triton_conv.SCAN_HALO_TAIL)
            "scan_2_warps": {name: as_launched(16, 128, True, 4, bias=False, warps=2, UNROLL=4, halo=halo,
                                               HALO_TAIL=tail)
                             for name, halo, tail in (("q", False, False), ("q_halo", True, False),
                                                      ("q_halo_tail", True, True))},
            # q with the sequence masks by uniform branches (triton_conv.SCAN_BRANCH_MASKS), and with the sigmoid in
            # flush-to-zero approximations too (triton_conv.FTZ_SIGMOID)
            "scan_branch": {"q_branch": as_launched(16, 128, True, 4, bias=False, warps=2, UNROLL=4, BRANCH=True),
                            "q_branch_ftz": as_launched(16, 128, True, 4, bias=False, warps=2, UNROLL=4, BRANCH=True,
                                                        FTZ=True)}}


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description="gdn-cp's Triton kernels compiled for sm_90 here, as the CPU tests "
                                     "check them (tests/ops/test_triton_compile.py): registers, spills, tile loops")
    parser.add_argument("--out", required=True, help="JSON file for the report")
    with open(parser.parse_args().out, "w") as f:
        json.dump(tests_report(), f)
