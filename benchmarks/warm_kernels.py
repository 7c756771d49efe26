#!/usr/bin/env python
"""Compile and autotune FLA's kernels for a GDN shape in parallel processes, before a benchmark.

Why: a fresh process compiles FLA 0.4.2's Triton kernels serially (minutes per head shape on an
H200), and a CP benchmark meets several shapes: every head at CP=1 / chunkwise / all_gather, 1/cp
of the heads for headwise and stock headwise, and the conv at two channel counts. Compiled
kernels land in ``TRITON_CACHE_DIR`` and autotune results too (``FLA_CACHE_RESULTS=1``), which
later processes read. Here each (op, heads) variant gets its own process, spread over the GPUs,
so the compile work runs side by side instead of one after another. Nothing is timed.

    python3 -m benchmarks.warm_kernels --cp 2 --tokens 32K          # Qwen3.5-9B GDN shape, bf16

Each variant runs the FLA backend's op forward + backward on packed (varlen) rows, as every
gdn-cp mode and stock megatron-core's THD path call it (stock's SBHD path calls FLA without
boundaries: other kernel keys, not warmed here).
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time

from .common import REPO_ROOT
from .measure import parse_tokens

logger = logging.getLogger("benchmarks.warm_kernels")

QWEN = dict(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, conv_width=4)


def variants(cp: int, dims: dict) -> list[dict]:
    """The distinct kernel shapes a CP=cp run meets: all heads, and 1/cp of them (headwise)."""
    out = []
    for share in sorted({1, cp}):
        hk, hv = dims["num_k_heads"] // share, dims["num_v_heads"] // share
        if hk < 1 or dims["num_k_heads"] % share or dims["num_v_heads"] % share:
            continue
        channels = 2 * hk * dims["head_k_dim"] + hv * dims["head_v_dim"]
        out.append({"op": "gdn", "hk": hk, "hv": hv, "share": share})
        if hk != hv:  # stock megatron-core repeats q/k to the value heads (and FLA < 0.5 needs it)
            out.append({"op": "gdn", "hk": hv, "hv": hv, "share": share})
        out.append({"op": "conv", "channels": channels, "share": share})
        out.append({"op": "norm", "hv": hv, "share": share})  # the fused gated RMSNorm
    return out


def _run_variant(spec: dict) -> None:
    """In the child: one op forward + backward on packed rows (two sequences, so varlen)."""
    import torch

    from gdn_cp.layout import Boundaries
    from gdn_cp.ops import get_backend

    fla = get_backend("fla")
    dev = torch.device("cuda", spec["gpu"])
    torch.cuda.set_device(dev)
    dtype = getattr(torch, spec["dtype"])
    t = spec["tokens"]
    gen = torch.Generator(device=dev).manual_seed(0)
    cu = Boundaries([0, t // 2, t])
    if spec["op"] == "norm":
        from gdn_cp.ops.fla.norm import fused_gated_rms_norm

        fn = fused_gated_rms_norm()
        if fn is None:
            return
        n, d = t * spec["hv"], spec["head_v_dim"]
        x = torch.randn(n, d, device=dev, dtype=dtype, generator=gen, requires_grad=True)
        z = torch.randn(n, d, device=dev, dtype=dtype, generator=gen, requires_grad=True)
        w = torch.ones(d, device=dev, dtype=dtype, requires_grad=True)
        y = fn(x, z, w, 1e-5)
    elif spec["op"] == "conv":
        c, w = spec["channels"], spec["conv_width"]
        x = torch.randn(t, c, device=dev, dtype=dtype, generator=gen, requires_grad=True)
        weight = (0.5 * torch.randn(c, w, device=dev, dtype=dtype, generator=gen)).requires_grad_()
        y = fla.causal_conv1d(x, weight, None, cu_seqlens=cu, activation="silu")
    else:
        hk, hv, dk, dv = spec["hk"], spec["hv"], spec["head_k_dim"], spec["head_v_dim"]

        def leaf(*size, scale=1.0):
            return (scale * torch.randn(*size, device=dev, dtype=dtype, generator=gen)).requires_grad_()

        q, k, v = leaf(t, hk, dk), leaf(t, hk, dk), leaf(t, hv, dv)
        g = (-0.1 * torch.rand(t, hv, device=dev, generator=gen)).requires_grad_()
        beta = torch.rand(t, hv, device=dev, dtype=dtype, generator=gen).requires_grad_()
        y, _ = fla.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)
    y.float().square().mean().backward()
    torch.cuda.synchronize(dev)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cp", type=int, required=True, help="CP size of the run to warm for (its 1/cp head share)")
    ap.add_argument("--tokens", type=parse_tokens, default=parse_tokens("8K"), help="rows per warm call (default 8K)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="activation dtype")
    ap.add_argument("--timeout", type=float, default=400, help="seconds before the warm processes are killed")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.child:
        _run_variant(eval(args.child))  # noqa: S307 - our own repr from the parent below
        return 0

    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        print("warm_kernels: no CUDA device; nothing to warm", file=sys.stderr)
        return 2
    procs = []
    t0 = time.monotonic()
    for i, v in enumerate(variants(args.cp, QWEN)):
        spec = dict(v, gpu=i % gpus, dtype=args.dtype, tokens=args.tokens, **QWEN)
        cmd = [sys.executable, "-m", "benchmarks.warm_kernels", "--cp", str(args.cp), "--child", repr(spec)]
        procs.append((spec, subprocess.Popen(cmd, env=dict(os.environ), cwd=REPO_ROOT)))
        logger.info("warming %s on cuda:%d", v, spec["gpu"])
    rc = 0
    for spec, p in procs:
        try:
            code = p.wait(timeout=max(1.0, args.timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            code = "timeout"
        logger.info("%s %s: %s after %.0f s", spec["op"],
                    {k: spec[k] for k in ("hk", "hv", "channels") if k in spec},
                    "ok" if code == 0 else f"FAILED ({code})", time.monotonic() - t0)
        rc = rc or (0 if code == 0 else 1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
