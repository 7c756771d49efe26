#!/usr/bin/env python
"""gdn-cp's Triton conv glue kernels (:mod:`gdn_cp.ops.fused.triton_conv`) alone, against the memory floor, in
one short GPU call (seconds after autotuning): a kernel change is timed here before the layer times it
(``benchmarks/layer_full.py``), which decides (run 2026-12-05a: two forms faster here were slower there).

Per row count: the median forward and backward of ``conv_silu_split_triton`` (CUDA events, ``--iters`` each
after 3 warm-up calls that autotune; ``*_gpu_ms``: the kernels' own time, torch.profiler's, which the events exceed
where the host launches slower than the GPU runs; ``tuned``: the configs autotuning chose). The floor is the bytes each direction
must move (forward: read x, write q/k/v; backward: read x and the output gradients, write dx) at the bandwidth a
plain device copy reaches on the same GPU.

Shapes: a CP=2 rank's chunkwise rows of Qwen3.5-9B's GDN layer (16 key / 32 value heads of 128, conv width 4
without a bias, as Megatron's GDN builds it; ``--conv-bias`` adds one; q/k l2-normalized), bf16, x a strided view
of in_proj's output as in the layer, eight mixed-length sequences.

    python3 -m benchmarks.glue_kernels --out $OUT/glue_kernels.json                 # on the GPU machine
    python3 -m benchmarks.glue_kernels --rows 16K --profile   # under ncu --profile-from-start off (the GPU machine)
    TRITON_INTERPRET=1 python3 -m benchmarks.glue_kernels --device cpu --rows 64 --heads 1,2 --head-dim 16 --iters 1
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import statistics
from unittest import mock

import torch

from benchmarks.common import machine_info, now_iso, versions, write_json
from benchmarks.measure import parse_tokens, timed_steps
from gdn_cp.layout import Boundaries
from gdn_cp.ops.fused.split import as_words

logger = logging.getLogger("benchmarks.glue_kernels")

MIXED8 = (0.31, 0.04, 0.17, 0.09, 0.22, 0.02, 0.10, 0.05)  # fractions of the rows (as layer_full's mixed8)


def _inputs(rows: int, hk: int, hv: int, dim: int, device: str, dtype: torch.dtype):
    """``(x [rows, C] view of [rows, C + 2*Hv + Hv*D], weight [C, 4], bias, positions, douts)``."""
    gen = torch.Generator(device="cpu").manual_seed(rows)
    c = 2 * hk * dim + hv * dim
    proj = torch.randn(rows, c + hv * dim + 2 * hv, generator=gen).to(device=device, dtype=dtype)
    cu = [min(rows, c) for c in itertools.accumulate((max(1, int(rows * f)) for f in MIXED8[:-1]), initial=0)] + [rows]
    weight = (0.5 * torch.randn(c, 4, generator=gen)).to(device=device, dtype=dtype)
    bias = (0.1 * torch.randn(c, generator=gen)).to(device=device, dtype=dtype)
    douts = [torch.randn(rows, h, dim, generator=gen).to(device=device, dtype=dtype) for h in (hk, hk, hv)]
    return proj[:, :c], weight, bias, Boundaries(sorted(set(cu))).positions(device), douts


def copy_bandwidth_gbs(device: str, nbytes: int) -> float:
    """The bandwidth a plain copy of ``nbytes`` reaches (read + write), GB/s: the floor's yardstick."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = statistics.median(timed_steps(lambda: dst.copy_(src), 3, 10, torch.device(device)))
    return 2 * nbytes / ms / 1e6


def column_copy_ms(rows: int, shape, device: str, iters: int) -> dict:
    """z's gradient into its columns of in_proj's (``[rows, (2*Hk + 2*Hv)*D + 2*Hv]``, z's ``Hv*D`` after q|k|v, as
    :func:`_inputs` lays in_proj's output out): torch's element copy (``narrow``) against
    :func:`gdn_cp.ops.fused.split.copy_columns`' 8-byte words (``wide``: the same bits; None where the shape's columns
    are not 8-byte aligned, as copy_columns then copies element by element)."""
    hk, hv, dim = shape[:3]
    z_at, z_width = (2 * hk + hv) * dim, hv * dim
    grad, buffer = (torch.randn(rows, n, device=device).to(torch.bfloat16) for n in (z_width, z_at + z_width + 2 * hv))
    columns = buffer[:, z_at:z_at + z_width]
    pairs = {"narrow": (columns, grad), "wide": (as_words(columns), as_words(grad))}  # wide: None where unaligned
    return {name: statistics.median(timed_steps(lambda d=d, s=s: d.copy_(s), 3, iters, torch.device(device)))
            if d is not None and s is not None else None for name, (d, s) in pairs.items()}


SWITCHES = {"scan_branch": ("SCAN_BRANCH_MASKS",), "scan_tail": ("SCAN_HALO_TAIL",), "scan_ftz": ("FTZ_SIGMOID",),
            "scan_tail_branch": ("SCAN_HALO_TAIL", "SCAN_BRANCH_MASKS"), "scan_branch_ftz": ("SCAN_BRANCH_MASKS", "FTZ_SIGMOID")}
"""The scan with triton_conv's flags (off by default) on for its rows: form name -> the flags."""
BACKWARD_FORMS = {"one_pass": {"one_pass": True}, "scan": {"scan": True}, **dict.fromkeys(SWITCHES, {"scan": True})}
"""The backward's forms beside the two-pass one (triton_conv.ConvForm's fields): one pass (``triton_norm_dz_copy``'s), the
scan (the default's), and the scan with the flags of :data:`SWITCHES`."""


def switched(name: str):
    """A context in which triton_conv's flags of form ``name`` (:data:`SWITCHES`) are on."""
    from gdn_cp.ops.fused import triton_conv

    return mock.patch.multiple(triton_conv, **dict.fromkeys(SWITCHES[name], True)) if name in SWITCHES else contextlib.nullcontext()


def gpu_ms(calls) -> float:
    """Kernel time per call of ``calls`` (torch.profiler's CUDA kernels summed): what the GPU spends, where CUDA events
    time the host's pace once launches are slower than kernels (run 2026-12-07j: a backward of 0.51 ms of kernels timed
    0.73 by events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for call in calls:
            call()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA") / 1e3 / len(calls)


def time_kernels(rows: int, shape, device: str, iters: int, profile: bool = False, **form) -> dict:
    """The kernels at ``rows``: median forward / backward ms, the backward in ``form`` (:data:`BACKWARD_FORMS`; none:
    two passes). ``profile``: instead, one backward between cudaProfilerStart / Stop, after autotuning (``ncu
    --profile-from-start off``)."""
    from gdn_cp.ops.fused import triton_conv

    hk, hv, dim, with_bias, with_halo = shape
    x, weight, bias, positions, douts = _inputs(rows, hk, hv, dim, device, torch.bfloat16)
    halo = torch.randn(weight.shape[1] - 1, x.shape[1], device=device).to(torch.bfloat16) if with_halo else None
    leaves = [x.detach().requires_grad_(True), weight.requires_grad_(True)] + [
        t.requires_grad_(True) for t in ((bias if with_bias else None), halo) if t is not None]

    def forward():
        return triton_conv.conv_silu_split_triton(leaves[0], leaves[1], bias if with_bias else None, positions, halo,
                                                  hk, hv, dim, dim, True, 1e-6, **form)

    def backward(outs):
        return torch.autograd.grad(outs, leaves, douts)

    for _ in range(3 if device == "cuda" else 0):  # autotuning, then warm (the interpreter: nothing to warm)
        backward(forward())
    if profile:
        outs = forward()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        backward(outs)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        return {"rows": rows, "profiled": form}
    outs = [None]

    def fresh_outputs():  # untimed, ahead of each timed backward
        outs[0] = forward()

    fwd_ms = timed_steps(forward, 0, iters, torch.device(device))
    bwd_ms = timed_steps(lambda: backward(outs[0]), 0, iters, torch.device(device), before=fresh_outputs)
    timed = {"rows": rows, "fwd_ms": statistics.median(fwd_ms), "bwd_ms": statistics.median(bwd_ms)}
    if device == "cuda":  # the kernels' own time, 5 calls each
        outs = [forward() for _ in range(5)]
        timed.update(fwd_gpu_ms=gpu_ms([forward] * 5), bwd_gpu_ms=gpu_ms([lambda o=o: backward(o) for o in outs]))
    return timed


def parse_args(argv=None) -> tuple[argparse.Namespace, dict]:
    """The command's arguments, and the backward forms (:data:`BACKWARD_FORMS`) that ``--forms`` names."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--rows", default="16K,64K", help="comma list of row counts per rank (16K: a CP=2 rank of 32K tokens)")
    p.add_argument("--heads", default="16,32", help="key,value heads per rank (default: Qwen3.5-9B's at chunkwise)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--forms", default="one_pass,scan",
                   help="comma list of the backward forms to time beside the two-pass one (BACKWARD_FORMS)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the interpreter's dry run")
    p.add_argument("--conv-bias", action="store_true", help="the conv with a bias (Megatron's GDN has none by default)")
    p.add_argument("--halo", action="store_true", help="the rows continue a sequence from the previous rank (a "
                   "chunkwise rank past the first): the conv reads the W-1 rows before them, and their gradient")
    p.add_argument("--profile", action="store_true", help="one backward per row count and form (BACKWARD_FORMS) "
                   "between cudaProfilerStart/Stop, nothing timed (under ncu)")
    p.add_argument("--out", help="JSON file for the rows")
    args = p.parse_args(argv)
    forms = {name: BACKWARD_FORMS[name] for name in args.forms.split(",") if name in BACKWARD_FORMS}
    unknown = sorted(set(args.forms.split(",")) - set(BACKWARD_FORMS))
    if unknown or not forms:
        p.error(f"--forms {args.forms}: unknown {unknown or 'none given'}; choose from {', '.join(BACKWARD_FORMS)}")
    if args.profile and args.device != "cuda":
        p.error("--profile needs --device cuda: ncu profiles CUDA kernels")
    return args, forms


def main(argv=None) -> dict:
    args, forms = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from gdn_cp.ops.fused import triton_launch

    hk, hv = (int(h) for h in args.heads.split(","))
    shape, results = (hk, hv, args.head_dim, args.conv_bias, args.halo), []
    report = {"benchmark": "glue_kernels", "date": now_iso(), "machine": machine_info(), "versions": versions(),
              "device": args.device, "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
              "heads": [hk, hv], "head_dim": args.head_dim, "conv_bias": args.conv_bias, "halo": args.halo,
              "dtype": "bfloat16", "results": results, "forms": forms}
    for rows in (parse_tokens(r) for r in args.rows.split(",")):
        if args.profile:
            for name, form in forms.items():  # 3 launches each (q, k, v)
                with switched(name):
                    results.append(time_kernels(rows, shape, args.device, args.iters, profile=True, **form))
            continue
        c = (2 * hk + hv) * args.head_dim
        gbs = copy_bandwidth_gbs(args.device, rows * c * 2)
        floor = {"fwd_ms": 2 * rows * c * 2 / gbs / 1e6, "bwd_ms": 3 * rows * c * 2 / gbs / 1e6}
        logger.info("%d rows: copy %.0f GB/s, floor fwd %.3f ms, bwd %.3f ms", rows, gbs, floor["fwd_ms"],
                    floor["bwd_ms"])
        row = time_kernels(rows, shape, args.device, args.iters)
        row.update(copy_gbs=gbs, floor=floor, column_copy_ms=column_copy_ms(rows, shape, args.device, args.iters))
        for name, form in forms.items():  # the forward too (the same tile kernel in every form)
            with switched(name):
                timed = time_kernels(rows, shape, args.device, args.iters, **form)
            row.update({f"{key[:3]}_{name}{key[3:]}": v for key, v in timed.items() if key != "rows"})
        results.append(row)
        report["tuned"] = triton_launch.tuned_configs()  # autotuning's picks, every form's and row count's so far
        if args.out:  # each row count as it ends: a stage cut at its time limit keeps the rows before
            write_json(args.out, report)
        logger.info("  fwd %.3f ms  bwd %.3f ms, kernels %s / %s ms (%s)", row["fwd_ms"], row["bwd_ms"],
                    row.get("fwd_gpu_ms"), row.get("bwd_gpu_ms"), ", ".join(
                        f"{name} {row[f'fwd_{name}_ms']:.3f} / {row[f'bwd_{name}_ms']:.3f} ms, kernels "
                        f"{row.get(f'fwd_{name}_gpu_ms')} / {row.get(f'bwd_{name}_gpu_ms')}" for name in forms))
    if args.out:
        write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
