#!/usr/bin/env python
"""What each FLA lever is worth on one GPU: the GDN core call and the gated norm, each way, timed and
checked on the same inputs (forward + backward, CUDA events, median of ``--iters`` after a compile
pass and ``--warmup`` untimed iterations; peak memory above the inputs; relative L2 of the output and
of every input gradient against the first way, and against fp64 on a shorter slice).

GDN core (``chunk_gated_delta_rule`` after the conv, Qwen3.5-9B heads: 16 key / 32 value heads of
dim 128, packed THD rows, l2norm in the kernel), from the layer's raw inputs (q, k at the key heads,
v, the gate input ``alpha`` and the beta logits, A_log, dt_bias):

- ``expanded``: gates computed outside (``g = -exp(A_log) * softplus(alpha + dt_bias)`` in fp32,
  ``sigmoid(beta)``), q/k repeated to the value heads (``repeat_interleave``): FLA 0.4's only way,
  and stock megatron-core's;
- ``grouped``: the same with q/k at the key heads (FLA >= 0.5's grouped value heads);
- ``grouped_gates_in_kernel``: also ``use_gate_in_kernel`` (A_log, dt_bias) and
  ``use_beta_sigmoid_in_kernel`` (FLA >= 0.5).

Gated norm (``[T*Hv, Dv]``, z a strided view of a wider in_proj output as in the layer):

- ``torch``: megatron-core's ``_apply_gated_norm`` without torch.compile: torch's RMSNorm, then
  ``* silu(z.float())``, cast back;
- ``fla_fused``: FLA's ``rms_norm_gated`` (one kernel each way).

A way the installed FLA does not offer is recorded as skipped. Run on the device machine through
``benchmarks/gpu_suite.sh`` (stage ``levers``), e.g. ``GDN_CP_STAGES=levers GDN_CP_STACK=fla060``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import import_gdn_cp, machine_info, now_iso, write_json  # noqa: E402

import_gdn_cp()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gdn_cp.testing.metrics import rel_l2  # noqa: E402

GIB = float(2**30)


def _timed(step, warmup: int, iters: int) -> dict:
    """Median / p10 / p90 ms of ``step()`` (fwd+bwd) with CUDA events, and its peak memory above
    what was allocated before (GiB)."""
    step()  # compile / autotune
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    q = lambda f: times[min(len(times) - 1, int(f * (len(times) - 1) + 0.5))]  # noqa: E731
    return {"median_ms": q(0.5), "p10_ms": q(0.1), "p90_ms": q(0.9), "iters": iters,
            "peak_extra_gib": (torch.cuda.max_memory_allocated() - base) / GIB}


# ---------------------------------------------------------------------------------------------
# the GDN core call
# ---------------------------------------------------------------------------------------------

def gdn_inputs(t: int, hk: int, hv: int, d: int, dtype, seed: int = 0) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s, scale=1.0: (torch.randn(*s, device="cuda", generator=gen) * scale)  # noqa: E731
    cu = [0, t // 3, t // 3 + t // 4, t]  # packed: three sequences
    return {
        "q": r(t, hk, d).to(dtype), "k": r(t, hk, d).to(dtype), "v": r(t, hv, d).to(dtype),
        "alpha": r(t, hv).to(dtype), "beta": r(t, hv).to(dtype),
        "A_log": torch.log(torch.empty(hv, device="cuda").uniform_(1, 16, generator=gen)),
        "dt_bias": r(hv, scale=0.5), "do": r(t, hv, d).to(dtype), "cu": cu,
    }


LEAVES = ("q", "k", "v", "alpha", "beta", "A_log", "dt_bias")


def gdn_way(name: str, inp: dict, fn, ratio: int):
    """``step() -> (o, {leaf: grad})`` for one way of calling FLA's kernel."""
    cu = torch.tensor(inp["cu"], device="cuda", dtype=torch.int32)
    leaves = {k: inp[k].detach().clone().requires_grad_(True) for k in LEAVES}

    def step():
        for t in leaves.values():
            t.grad = None
        q, k = leaves["q"], leaves["k"]
        kw = {}
        if name == "expanded":
            q, k = q.repeat_interleave(ratio, dim=1), k.repeat_interleave(ratio, dim=1)
        if name == "grouped_gates_in_kernel":
            g, beta = leaves["alpha"], leaves["beta"]
            kw = dict(use_gate_in_kernel=True, A_log=leaves["A_log"], dt_bias=leaves["dt_bias"],
                      use_beta_sigmoid_in_kernel=True)
        else:
            g = -leaves["A_log"].exp() * F.softplus(leaves["alpha"].float() + leaves["dt_bias"])
            beta = leaves["beta"].sigmoid()
        o, _ = fn(q.unsqueeze(0), k.unsqueeze(0), leaves["v"].unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
                  use_qk_l2norm_in_kernel=True, cu_seqlens=cu, **kw)
        o = o.squeeze(0)
        (o.float() * inp["do"].float()).sum().backward()
        return o.detach(), {k: v.grad.detach().clone() for k, v in leaves.items()}

    return step


def gdn_fp64(inp: dict, ratio: int):
    """The same math in fp64 with gdn-cp's reference backend (per-sequence scan)."""
    from gdn_cp.ops import reference

    leaves = {k: inp[k].detach().double().requires_grad_(True) for k in LEAVES}
    g = -leaves["A_log"].exp() * F.softplus(leaves["alpha"] + leaves["dt_bias"])
    o, _ = reference.chunk_gated_delta_rule(leaves["q"], leaves["k"], leaves["v"], g, leaves["beta"].sigmoid(),
                                            cu_seqlens=inp["cu"], use_qk_l2norm=True)
    (o * inp["do"].double()).sum().backward()
    return o.detach(), {k: v.grad.detach() for k, v in leaves.items()}


def run_gdn(args, found) -> list[dict]:
    import fla.ops.gated_delta_rule as fla_gdr

    fn = fla_gdr.chunk_gated_delta_rule
    hk, hv, d = 16, 32, 128
    ways = ["expanded", "grouped", "grouped_gates_in_kernel"]
    offered = {"expanded": True, "grouped": found.grouped_value_heads,
               "grouped_gates_in_kernel": found.grouped_value_heads and found.gate_in_kernel
               and found.beta_sigmoid_in_kernel}
    rows = []
    big = gdn_inputs(args.tokens, hk, hv, d, torch.bfloat16)
    small = gdn_inputs(args.check_tokens, hk, hv, d, torch.bfloat16, seed=1)
    ref64 = gdn_fp64(small, hv // hk)
    first = None
    for way in ways:
        row = {"lever": "gdn_core", "way": way, "T": args.tokens, "heads": [hk, hv], "dim": d, "dtype": "bfloat16"}
        if not offered[way]:
            rows.append({**row, "status": "skipped", "why": "this FLA does not offer it"})
            continue
        try:
            step = gdn_way(way, big, fn, hv // hk)
            o, grads = step()
            row.update(_timed(step, args.warmup, args.iters))
            if first is None:
                first = (o, grads)
            row["rel_l2_vs_first_way"] = {"o": rel_l2(o, first[0]),
                                          **{f"d{k}": rel_l2(grads[k], first[1][k]) for k in grads}}
            so, sg = gdn_way(way, small, fn, hv // hk)()
            row["rel_l2_vs_fp64"] = {"T": args.check_tokens, "o": rel_l2(so, ref64[0]),
                                     **{f"d{k}": rel_l2(sg[k], ref64[1][k]) for k in sg}}
            row["status"] = "ok"
        except Exception as err:  # noqa: BLE001 - recorded, the other ways go on
            row.update(status="error", error=f"{type(err).__name__}: {err}"[:600])
        rows.append(row)
        print(_line(row), flush=True)
        del step
        torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------
# the gated norm
# ---------------------------------------------------------------------------------------------

def run_norm(args, found) -> list[dict]:
    from gdn_cp.ops.fla.norm import gated_rms_norm

    hv, d = 32, 128
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(2)

    def inputs(t):
        wide = torch.randn(t, hv * d * 2, device="cuda", generator=gen).to(torch.bfloat16)  # z inside in_proj's out
        return {"x": torch.randn(t * hv, d, device="cuda", generator=gen).to(torch.bfloat16),
                "z_wide": wide, "w": (1 + 0.1 * torch.randn(d, device="cuda", generator=gen)).to(torch.bfloat16),
                "do": torch.randn(t * hv, d, device="cuda", generator=gen).to(torch.bfloat16), "t": t}

    def way(name, inp):
        norm = torch.nn.RMSNorm(d, eps=1e-5, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            norm.weight.copy_(inp["w"])
        x = inp["x"].detach().clone().requires_grad_(True)
        zw = inp["z_wide"].detach().clone().requires_grad_(True)

        def step():
            x.grad = zw.grad = norm.weight.grad = None
            z = zw[:, : hv * d].reshape(-1, d)
            if name == "torch":
                y = (norm(x) * F.silu(z.float())).to(x.dtype)
            else:
                y = gated_rms_norm(x, z, norm.weight, 1e-5)
            y.backward(inp["do"])
            return y.detach(), {"dx": x.grad.clone(), "dz": zw.grad.clone(), "dw": norm.weight.grad.clone()}

        return step

    def fp64(inp):
        x = inp["x"].double().requires_grad_(True)
        zw = inp["z_wide"].double().requires_grad_(True)
        w = inp["w"].double().requires_grad_(True)
        z = zw[:, : hv * d].reshape(-1, d)
        y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-5) * w * F.silu(z)
        y.backward(inp["do"].double())
        return y.detach(), {"dx": x.grad, "dz": zw.grad, "dw": w.grad}

    big, small = inputs(args.tokens), inputs(args.check_tokens)
    ref = fp64(small)
    first = None
    for name in ("torch", "fla_fused"):
        row = {"lever": "gated_norm", "way": name, "T": args.tokens, "rows": args.tokens * hv, "dim": d,
               "dtype": "bfloat16"}
        if name == "fla_fused" and not found.fused_gated_norm:
            rows.append({**row, "status": "skipped", "why": "this FLA has no rms_norm_gated"})
            continue
        try:
            step = way(name, big)
            y, grads = step()
            row.update(_timed(step, args.warmup, args.iters))
            first = first or (y, grads)
            row["rel_l2_vs_first_way"] = {"y": rel_l2(y, first[0]), **{k: rel_l2(grads[k], first[1][k]) for k in grads}}
            sy, sg = way(name, small)()
            row["rel_l2_vs_fp64"] = {"T": args.check_tokens, "y": rel_l2(sy, ref[0]),
                                     **{k: rel_l2(sg[k], ref[1][k]) for k in sg}}
            row["status"] = "ok"
        except Exception as err:  # noqa: BLE001
            row.update(status="error", error=f"{type(err).__name__}: {err}"[:600])
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def _line(row: dict) -> str:
    if row.get("status") != "ok":
        return f"{row['lever']:<10} {row['way']:<24} {row.get('status')}: {row.get('error') or row.get('why')}"
    worst = max(v for k, v in row["rel_l2_vs_fp64"].items() if k != "T")
    return (f"{row['lever']:<10} {row['way']:<24} {row['median_ms']:8.3f} ms (p10 {row['p10_ms']:.3f}, p90 "
            f"{row['p90_ms']:.3f}), peak +{row['peak_extra_gib']:.3f} GiB, worst rel-L2 vs fp64 {worst:.2e}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384, help="rows per call (default 16384: a CP=2 slice of 32K)")
    ap.add_argument("--check-tokens", type=int, default=1024, help="rows of the fp64 check (default 1024)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--levers", default="gdn_core,gated_norm")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("fla_levers: needs a CUDA GPU", file=sys.stderr)
        return 2
    from gdn_cp.ops.fla.detect import features, stack_report

    found = features()
    if found.import_error:
        print(f"fla_levers: {found.import_error}", file=sys.stderr)
        return 2
    t0 = time.time()
    rows = []
    out = {"benchmark": "fla_levers", "date": now_iso(), "machine": machine_info(), "stack": stack_report(),
           "gpu": torch.cuda.get_device_name(0), "knobs": vars(args) | {"out": str(args.out)}, "rows": rows}
    levers = args.levers.split(",")
    if "gdn_core" in levers:
        rows += run_gdn(args, found)
        write_json(args.out, out)
    if "gated_norm" in levers:
        rows += run_norm(args, found)
    out["seconds"] = round(time.time() - t0, 1)
    write_json(args.out, out)
    return 0 if all(r["status"] in ("ok", "skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
