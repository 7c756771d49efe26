#!/usr/bin/env python
"""Which per-rank head counts FlashQLA compiles, and gdn-cp's FlashQLA backend on every count (GPU).

Two questions, each case in a process of its own (TileLang compiles per head count; cases run side by
side, ``--jobs`` at a time), one JSON row per case appended to ``--out`` as it ends:

- ``cumsum H``: FlashQLA's ``chunk_local_cumsum`` (the one kernel whose fragment holds every value head)
  alone, for value heads H (``--cumsum-heads``): compiles and equals ``torch.cumsum`` per chunk, or the error;
- ``backend Hk/Hv``: gdn-cp's FlashQLA backend (``chunk_gated_delta_rule``: odd value-head counts padded,
  :func:`gdn_cp.ops.flashqla.spec.padded_value_heads`) forward + backward on 3 packed sequences (bf16,
  head dim 128, initial and final states), against the reference backend in fp32 on the same GPU
  (``--shapes``): relative L2 of the output, the final state and every gradient, and the first call's time.

    python3 -m benchmarks.flashqla_heads --out $OUT/flashqla_heads.jsonl      # on the GPU machine, .tl carried
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CUMSUM_HEADS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32)
SHAPES = ("1/1", "1/2", "1/3", "1/4", "2/6", "3/3", "3/9", "4/4", "4/12", "8/16", "16/32")


def cumsum_case(h: int) -> dict:
    import torch
    from flash_qla.ops.utils.cumsum import chunk_local_cumsum

    g = -torch.rand(1, 300, h, device="cuda")
    cu = torch.tensor([0, 100, 300], dtype=torch.int32, device="cuda")
    got = chunk_local_cumsum(g, 64, cu_seqlens=cu)
    want = torch.cat([torch.cat([c.cumsum(1) for c in g[:, a:b].split(64, dim=1)], 1) for a, b in ((0, 100), (100, 300))], 1)
    return {"max_abs_err": float((got - want).abs().max())}


def backend_case(hk: int, hv: int) -> dict:
    import torch
    import torch.nn.functional as F

    from gdn_cp.ops import get_backend
    from gdn_cp.ops.accuracy import rel_l2
    from gdn_cp.ops.flashqla.spec import padded_value_heads

    cu = [0, 700, 701, 2048]
    gen = torch.Generator(device="cuda").manual_seed(hk * 100 + hv)
    t, n = cu[-1], len(cu) - 1
    raw = {"q": torch.randn(t, hk, 128, device="cuda", generator=gen), "k": torch.randn(t, hk, 128, device="cuda", generator=gen),
           "v": torch.randn(t, hv, 128, device="cuda", generator=gen),
           "g": F.logsigmoid(torch.randn(t, hv, device="cuda", generator=gen) + 3.0),
           "beta": torch.sigmoid(torch.randn(t, hv, device="cuda", generator=gen)),
           "h0": 0.1 * torch.randn(n, hv, 128, 128, device="cuda", generator=gen)}
    do = torch.randn(t, hv, 128, device="cuda", generator=gen)
    dfs = torch.randn(n, hv, 128, 128, device="cuda", generator=gen)

    def run(name, dtype):
        leaves = {k: (v.to(dtype) if k in ("q", "k", "v", "beta") else v).detach().requires_grad_(True) for k, v in raw.items()}
        o, fs = get_backend(name).chunk_gated_delta_rule(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                                                         cu_seqlens=cu, initial_state=leaves["h0"], output_final_state=True)
        ((o.float() * do).sum() + (fs * dfs).sum()).backward()
        return {"o": o.float(), "fs": fs, **{f"d{k}": v.grad.float() for k, v in leaves.items()}}

    t0 = time.perf_counter()
    got = run("flashqla", torch.bfloat16)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    want = run("reference", torch.float32)
    return {"padded_value_heads": padded_value_heads(hk, hv), "first_call_s": round(first, 1),
            "errors": {k: rel_l2(got[k], want[k]) for k in want}}


def _child(kind: str, arg: str) -> None:
    try:
        if kind == "cumsum":
            out = cumsum_case(int(arg))
        else:
            hk, hv = map(int, arg.split("/"))
            out = backend_case(hk, hv)
        print(json.dumps({"ok": True, **out}))
    except Exception as e:  # noqa: BLE001 - the error is the answer
        print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {str(e)[:400]}"}))


def _run_case(kind: str, arg: str, timeout: float) -> dict:
    t0 = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "benchmarks.flashqla_heads", "--child", kind, arg],
                              capture_output=True, text=True, timeout=timeout)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        row = json.loads(lines[-1]) if lines else {"ok": False, "error": done.stderr[-600:]}
    except subprocess.TimeoutExpired:
        row = {"ok": False, "error": f"timed out after {timeout:.0f} s (still compiling?)"}
    return {"case": kind, "heads": arg, "wall_s": round(time.perf_counter() - t0, 1), **row}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=False, help="JSON lines, one row per case")
    p.add_argument("--cumsum-heads", default=",".join(map(str, CUMSUM_HEADS)), help="value head counts for the cumsum alone")
    p.add_argument("--shapes", default=",".join(SHAPES), help="Hk/Hv per rank for the backend cases")
    p.add_argument("--jobs", type=int, default=12, help="cases side by side")
    p.add_argument("--timeout", type=float, default=420.0, help="seconds per case")
    p.add_argument("--child", nargs=2, metavar=("KIND", "ARG"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(*args.child)
        return 0
    if args.out is None:
        p.error("--out is required")
    cases = [("cumsum", h) for h in args.cumsum_heads.split(",") if h] + [("backend", s) for s in args.shapes.split(",") if s]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(args.jobs) as pool, args.out.open("a") as f:
        for row in pool.map(lambda c: _run_case(*c, args.timeout), cases):
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
