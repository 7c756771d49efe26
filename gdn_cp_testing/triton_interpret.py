"""gdn-cp's Triton glue kernels run by Triton's interpreter on the CPU, against the plain-torch glue.

Run as ``TRITON_INTERPRET=1 python3 -m gdn_cp_testing.triton_interpret`` (the variable must be set before
Triton is imported, hence a process of its own: tests/ops/test_triton_glue.py starts it). Prints one JSON
object: per case, the relative L2 error of each output and gradient. fp32 and fp16 only: the interpreter
rounds fp32 -> bf16 by truncation (seen with Triton 3.9), so bf16's rounding points are checked on a GPU
(tests/gpu/test_fused_glue_gpu.py); fp16 rounds as a GPU does, which checks where the kernels round.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from gdn_cp.layout import Boundaries
from gdn_cp.ops.fused.glue import _conv_silu_split, _gates

W = 4
CONV_CASES = (  # (dtype, halo, k heads, v heads, Dk, Dv, qk l2norm, cu, two-pass chunk rows | one-pass form, programs
    # [, copies of each key head written: q and k as a kernel without grouped value heads reads them[, conv width]])
    ("float32", True, 1, 2, 16, 16, True, (0, 5, 5, 17, 18, 33), 16384),
    ("float32", True, 1, 1, 16, 16, True, (0, 2, 15, 33), 7),  # chunks of 7 rows: their W-1 overlap, the halo
    ("float16", True, 1, 3, 32, 16, True, (0, 2, 20), 16384),
    ("float16", False, 1, 1, 16, 24, False, (0, 1, 2, 3, 20), 16384),
    ("float32", True, 1, 2, 16, 16, True, (0, 5, 5, 17, 18, 33), "one_pass 2"),  # spans of 32: 2 programs, 2 tiles
    ("float32", True, 1, 1, 16, 16, True, (0, 2, 15, 33), "one_pass 2048"),  # 1 program, the tail past T
    ("float16", True, 1, 3, 32, 16, True, (0, 2, 20), "one_pass 4"),  # 3 v heads: one program per head
    ("float16", False, 1, 1, 16, 24, False, (0, 1, 2, 3, 17, 20, 50), "one_pass 2"),  # rows 50: a span boundary
    ("float32", True, 1, 2, 16, 16, True, (0, 5, 5, 17, 18, 33), "scan 16"),  # spans of 16 rows: 3 programs
    ("float16", False, 1, 3, 16, 24, False, (0, 1, 2, 3, 17, 20, 50), "scan 16"),  # 3 heads: a program's 2nd masked
    ("float32", True, 1, 2, 16, 16, True, (0, 5, 5, 17, 18, 33), 7, 2),  # q, k written twice a head, their
    ("float16", False, 1, 3, 16, 24, True, (0, 1, 2, 3, 17, 20, 50), "one_pass 2", 3),  # gradients summed in the
    ("float32", True, 1, 2, 16, 16, True, (0, 5, 5, 17, 18, 33), "scan 16", 2),  # kernels that read them
    ("float32", True, 1, 2, 16, 16, True, (0, 5, 5, 17, 18, 33), 7, 1, 3),  # narrower convs: the taps past W are
    ("float16", True, 1, 3, 16, 16, True, (0, 2, 20), "one_pass 2", 1, 3),  # zeros, the halo W-1 rows, the tap
    ("float32", True, 1, 2, 16, 16, True, (0, 5, 5, 17, 18, 33), "scan 16", 1, 2),  # sums only W of the four
    # row 0's sequence 1 row long: the forward's second launch (rows 0..W-2, with the halo) and the halo's gradient
    # where row 1 starts another sequence
    ("float32", True, 1, 2, 16, 16, True, (0, 1, 15, 33), "scan 16", 2),
    # the halo apart (triton_conv.HALO_ROWS_APART and SCAN_HALO_TAIL on; off by default): the forward's rows 0..W-2
    # again with the halo, the scan's rows below 8 in a loop of their own (the only one that reads the halo)
    ("float32", True, 1, 2, 16, 16, True, (0, 5, 5, 17, 18, 33), "scan 16 apart"),
    ("float16", True, 1, 3, 16, 16, True, (0, 1, 15, 33), "scan 16 apart", 2),
    ("float32", True, 1, 2, 16, 16, True, (0, 2, 5), "scan 16 apart"),  # 5 rows: every step in the halo's loop
    # the scan's masks by branches (triton_conv.SCAN_BRANCH_MASKS; off by default): an empty sequence, starts inside
    # spans and on their edges, one-row sequences (a first and a last row at once), the halo in every step and in the
    # tail loop, q and k repeated, a narrower conv
    ("float32", True, 1, 2, 16, 16, True, (0, 5, 5, 17, 18, 33), "scan 16 branch"),
    ("float16", False, 1, 3, 16, 24, False, (0, 1, 2, 3, 16, 17, 20, 32, 50), "scan 16 branch"),
    ("float16", True, 1, 3, 16, 16, True, (0, 1, 15, 33), "scan 16 apart branch", 2),
    ("float32", True, 1, 2, 16, 16, True, (0, 5, 5, 17, 18, 33), "scan 16 branch", 1, 2),
)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def backward_family(chunk) -> str:
    """Which backward a conv case's ``chunk`` runs: ``two_pass``, ``one_pass`` or ``scan``."""
    return "two_pass" if isinstance(chunk, int) else chunk.split()[0]


def conv_case(dtype: str, halo: bool, hk: int, hv: int, dk: int, dv: int, norm: bool, cu, chunk: int, repeat: int = 1,
              width: int = W, check_layout: bool = True) -> dict:
    """One case through the kernels against the plain glue. ``repeat``: q and k written that many times a head
    (``kv_repeat``); ``width``: the conv's taps (Megatron's default 4; the kernels take 1-4). ``check_layout``: also
    whether dx is written into in_proj-like rows (one more forward and backward; ``_ConvSiluSplit.backward``
    allocates dx the same way for every form, so the session checks it once per :func:`backward_family`)."""
    from gdn_cp.ops.fused import triton_conv
    from gdn_cp.ops.fused.triton_conv import conv_silu_split_triton

    family = backward_family(chunk)
    form = {"one_pass": family == "one_pass", "scan": family == "scan"}
    words = chunk.split() if isinstance(chunk, str) else []
    triton_conv.HALO_ROWS_APART = triton_conv.SCAN_HALO_TAIL = "apart" in words  # the halo apart (off by default)
    triton_conv.SCAN_BRANCH_MASKS = "branch" in words  # the scan's masks by branches (off by default)
    if form["scan"]:  # spans of that many rows
        triton_conv._SCAN_SPAN = int(chunk.split()[1])
    elif form["one_pass"]:  # spans of 16 rows (the interpreter's tile) or more, about `programs` of them per group
        triton_conv._SPAN, triton_conv._ONE_PASS_PROGRAMS = 16, int(chunk.split()[1])
    else:
        triton_conv._SPAN, triton_conv._CHUNK = 64, chunk
    dt = getattr(torch, dtype)
    t, c = cu[-1], 2 * hk * dk + hv * dv
    gen = torch.Generator().manual_seed(t + c)
    rows = torch.randn(t, c + 7, generator=gen).to(dt).requires_grad_(True)  # x is a strided view, as in a layer
    weight = (0.5 * torch.randn(c, width, generator=gen)).to(dt).requires_grad_(True)
    bias = (0.1 * torch.randn(c, generator=gen)).to(dt).requires_grad_(True)
    h = torch.randn(width - 1, c, generator=gen).to(dt).requires_grad_(True) if halo else None
    leaves = [rows, weight, bias] + ([h] if halo else [])
    rest = (weight, bias, Boundaries(list(cu)).positions("cpu"), h, hk, hv, dk, dv, norm, 1e-6, repeat)
    x = rows[:, 3:3 + c]
    got, want = conv_silu_split_triton(x, *rest, **form), _conv_silu_split(x, *rest)
    douts = [torch.randn(o.shape, generator=gen).to(dt) for o in want]
    names = ["q", "k", "v", "dx", "dweight", "dbias"] + (["dhalo"] if halo else [])
    grads = torch.autograd.grad(got, leaves, douts)
    pairs = list(zip(got, want)) + list(zip(grads, torch.autograd.grad(want, leaves, douts)))
    same = {}
    if form["scan"]:  # dx and the halo's gradient: the one-pass backward's bits (the tap sums: fp32 order only)
        plain = torch.autograd.grad(conv_silu_split_triton(x, *rest, one_pass=True), leaves, douts)
        same = {"dx_dhalo_equal_one_pass": all(torch.equal(grads[i], plain[i]) for i in ([0, 3] if halo else [0]))}
    layout = ({"dx_laid_out_like_x": _written_into_rows(lambda x: conv_silu_split_triton(x, *rest, **form),
                                                        rows, [3, c, 4], douts)} if check_layout else {})
    return {**same, **layout, "family": family,
            "case": f"conv {dtype} halo={halo} heads={hk}/{hv} dims={dk}/{dv} l2norm={norm} cu={list(cu)} chunk={chunk}"
                    + (f" repeat={repeat}" if repeat > 1 else "") + (f" width={width}" if width != W else ""),
            "contiguous": all(o.is_contiguous() for o in got),
            "errors": {n: _rel(a, b) for n, (a, b) in zip(names, pairs)}}


def _written_into_rows(consumer, rows, sizes, douts) -> bool:
    """Whether ``consumer``'s gradient for group 1 of ``split_columns(rows, sizes)`` is that group's columns of
    one in_proj-shaped buffer (what split_columns' backward then returns: no copy, no concatenation)."""
    from gdn_cp.ops.fused.split import split_columns

    group = split_columns(rows, sizes)[1]
    grad = torch.autograd.grad(consumer(group), [group], douts)[0]
    return (grad._base is not None and tuple(grad._base.shape) == tuple(rows.shape)
            and grad.data_ptr() - grad._base.data_ptr() == sizes[0] * grad.element_size())


NORM_CASES = (("float32", 37, 3, 16, 32, True), ("float16", 20, 2, 24, 256, True), ("float32", 37, 3, 16, 32, False))
# (dtype, T, heads, head dim, rows per backward program, dz into in_proj's gradient): 111 rows in 4 programs (the
# weight's gradient summed over them), rows past a tile


def norm_case(dtype: str, t: int, heads: int, dim: int, span: int, in_place: bool) -> dict:
    """gdn-cp's gated RMSNorm against FLA's math in plain torch (fp32 inside, rounded once), z a strided view
    of in_proj-like rows."""
    from gdn_cp.ops.fused import triton_norm
    from gdn_cp.ops.fused.triton_norm import gated_rms_norm_triton

    triton_norm._SPAN = span
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(t * heads)
    eps = 1e-6
    o = torch.randn(t, heads, dim, generator=gen).to(dt).requires_grad_(True)
    rows = torch.randn(t, heads * dim + 9, generator=gen).to(dt).requires_grad_(True)
    weight = (1 + 0.2 * torch.randn(dim, generator=gen)).to(dt).requires_grad_(True)

    def plain(o, z, weight):
        of, zf = o.float(), z.float()
        y = of * torch.rsqrt((of * of).mean(-1, keepdim=True) + eps) * weight.float() * (zf * torch.sigmoid(zf))
        return y.to(o.dtype).reshape(-1, dim)

    z = rows[:, 4:4 + heads * dim].reshape(t, heads, dim)
    got, want = gated_rms_norm_triton(o, z, weight, eps, in_place), plain(o, z, weight)
    dy = torch.randn(want.shape, generator=gen).to(dt)
    leaves = [o, rows, weight]
    pairs = [(got, want)] + list(zip(torch.autograd.grad(got, leaves, dy), torch.autograd.grad(want, leaves, dy)))
    return {"case": f"norm {dtype} T={t} heads={heads} dim={dim} span={span} dz_in_place={in_place}",
            "dz_into_rows": _written_into_rows(lambda g: gated_rms_norm_triton(o, g.reshape(t, heads, dim), weight, eps,
                                                                               in_place),
                                               rows, [4, heads * dim, 5], dy),
            "errors": {n: _rel(a, b) for n, (a, b) in zip(["y", "do", "drows", "dweight"], pairs)}}


def gates_case(dtype: str) -> dict:
    from gdn_cp.ops.fused.triton_gates import gates_triton

    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(7)
    t, hv = 70, 6
    rows = (3 * torch.randn(t, 2 * hv + 5, generator=gen)).to(dt)
    rows[0, 1] = 30.0  # softplus above its threshold
    rows.requires_grad_(True)
    a_log = torch.randn(hv, generator=gen).to(dt).requires_grad_(True)
    dt_bias = torch.randn(hv, generator=gen).to(dt).requires_grad_(True)
    alpha, b = rows[:, 1:1 + hv], rows[:, 1 + hv:1 + 2 * hv]
    got, want = gates_triton(alpha, b, -a_log.exp(), dt_bias), _gates(alpha, b, -a_log.exp(), dt_bias)
    douts = [torch.randn(want[0].shape, generator=gen), torch.randn(want[1].shape, generator=gen).to(dt)]
    leaves = [rows, a_log, dt_bias]
    pairs = list(zip(got, want)) + list(zip(torch.autograd.grad(got, leaves, douts),
                                            torch.autograd.grad(want, leaves, douts)))
    return {"case": f"gates {dtype}", "dtypes_match": all(a.dtype == b.dtype for a, b in pairs),
            "errors": {n: _rel(a, b) for n, (a, b) in zip(["g", "beta", "drows", "dA_log", "ddt_bias"], pairs)}}


def patch_triton_language_once_per_launch() -> bool:
    """Triton's interpreter patches ``triton.language`` again at every nested ``@triton.jit`` call
    (``inspect.getmembers`` of four modules, ~0.25 ms: a quarter of this run's CPU time, the scan's steps calling
    helpers), though the launch that runs it patched the same modules already; here a nested call whose modules the
    running launch patched skips it, which changes nothing but the time (the device call drops the patch it makes).
    Only for the interpreter as read (Triton 3.7: ``GridExecutor``, ``_patch_lang``); False, and nothing changed,
    elsewhere."""
    from triton.runtime import interpreter

    if not (hasattr(interpreter, "GridExecutor") and callable(getattr(interpreter, "_patch_lang", None))):
        return False
    patch_lang, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    patched: list = []  # per running launch: the modules it patched (None until its own first call)

    def langs(fn) -> set:
        return {id(v) for v in fn.__globals__.values() if v is interpreter.tl or v is interpreter.tl.core}

    def patch_once(fn):
        if patched and patched[-1] is not None and langs(fn) <= patched[-1]:
            return None  # a nested call: the launch's patch is in force (the device call drops what this returns)
        scope = patch_lang(fn)
        if patched and patched[-1] is None:
            patched[-1] = langs(fn)  # the launch's own call
        return scope

    def launch_patching_once(self, *args, **kwargs):
        patched.append(None)
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = launch_patching_once
    return True


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="every case through Triton's interpreter, as JSON on stdout")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1 (before Triton is imported): the kernels then run on the CPU")
    print("triton.language patched once per launch:", patch_triton_language_once_per_launch(), file=sys.stderr)
    torch.manual_seed(0)
    families = [backward_family(c[8]) for c in CONV_CASES]  # c[8]: the chunk rows or form
    cases = [conv_case(*c, check_layout=families.index(f) == i) for i, (c, f) in enumerate(zip(CONV_CASES, families))]
    cases += [gates_case(d) for d in ("float32", "float16")]
    cases += [norm_case(*c) for c in NORM_CASES]
    if args.out is not None:
        args.out.write_text(json.dumps(cases))
    print(json.dumps(cases))


if __name__ == "__main__":
    main()
