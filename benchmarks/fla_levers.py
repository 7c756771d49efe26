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
  ``use_beta_sigmoid_in_kernel`` (FLA >= 0.5): against ``grouped``, the worth of the lever "gates in
  the kernel" (gdn-cp computes them outside: the layer-level lever would live in the core's contract);
- ``grouped_flash_qla``: ``grouped`` dispatched by FLA (>= 0.6) to its FlashQLA backend (``flash_qla``
  on TileLang; FLA turns it on by default whenever it imports). Every other way runs with
  ``FLA_FLASH_QLA=0`` (FLA's Triton kernels), this one with ``FLA_FLASH_QLA=1``, and the row counts
  the calls that reached ``flash_qla`` (0 means FLA refused it and ran Triton).

Gated norm (``[T*Hv, Dv]``, z a strided view of a wider in_proj output as in the layer):

- ``torch``: megatron-core's ``_apply_gated_norm`` without torch.compile: torch's RMSNorm, then
  ``* silu(z.float())``, cast back (the local spec's out_norm);
- ``fla_fused``: FLA's ``rms_norm_gated`` (one kernel each way);
- ``te`` / ``te_zero_centered``: the same as ``torch`` with TransformerEngine's RMSNorm (the te
  spec's ``TENorm``; ``zero_centered_gamma=True`` scales by 1 + weight, its weight here is w - 1 so
  that every way computes the same function);
- ``fla_fused_zero_centered``: ``fla_fused`` with the weight ``w0 + 1`` formed in the step (what the
  glue does for a zero-centered TE norm), gradients into ``w0``.

A way the installed FLA does not offer is recorded as skipped. Run on the device machine through
``benchmarks/gpu_suite.sh`` (stage ``levers``), e.g. ``GDN_CP_STAGES=levers GDN_CP_STACK=fla060``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from gdn_cp.ops.accuracy import rel_l2

from .common import machine_info, now_iso, write_json
from .measure import GIB, quantile, timed_steps


def _timed(step, warmup: int, iters: int) -> dict:
    """Median / p10 / p90 ms of ``step()`` (fwd+bwd) with CUDA events, and its peak memory above
    what was allocated before (GiB)."""
    step()  # compile / autotune
    timed_steps(step, warmup, 0, torch.device("cuda"))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = timed_steps(step, 0, iters, torch.device("cuda"))
    return {"median_ms": quantile(times, 0.5), "p10_ms": quantile(times, 0.1), "p90_ms": quantile(times, 0.9),
            "iters": iters, "peak_extra_gib": (torch.cuda.max_memory_allocated() - base) / GIB}


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
        if name == "grouped_gates_in_kernel":  # grouped and grouped_flash_qla: the gates outside
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
    from gdn_cp.ops import get_backend

    reference = get_backend("reference")

    leaves = {k: inp[k].detach().double().requires_grad_(True) for k in LEAVES}
    g = -leaves["A_log"].exp() * F.softplus(leaves["alpha"] + leaves["dt_bias"])
    o, _ = reference.chunk_gated_delta_rule(leaves["q"], leaves["k"], leaves["v"], g, leaves["beta"].sigmoid(),
                                            cu_seqlens=inp["cu"], use_qk_l2norm=True)
    (o * inp["do"].double()).sum().backward()
    return o.detach(), {k: v.grad.detach() for k, v in leaves.items()}


GDN_WAYS = ("expanded", "grouped", "grouped_gates_in_kernel", "grouped_flash_qla")


def gdn_ways_offered(found, backends: list[dict]) -> dict[str, str | None]:
    """Per GDN way: None when this FLA offers it, else why not (``found``: ``detect.features()``;
    ``backends``: ``detect.gdn_kernel_backends()``)."""
    no_gva = None if found.grouped_value_heads else "this FLA has no grouped value heads (FLA >= 0.5)"
    gates = None if found.gate_in_kernel and found.beta_sigmoid_in_kernel else \
        "this FLA has no use_gate_in_kernel / use_beta_sigmoid_in_kernel (FLA >= 0.5)"
    qla = next((b for b in backends if b["name"] == "flash_qla"), None)
    if qla is None:
        flash_qla = "this FLA registers no FlashQLA backend (FLA >= 0.6)"
    elif not qla["available"]:
        flash_qla = ("flash_qla is not importable here (pip package flash-qla 0.1.3 + tilelang >= 0.1.12, "
                     "JIT-compiled with nvcc; not carried to the GPU machine)")
    else:
        flash_qla = None
    return {"expanded": None, "grouped": no_gva, "grouped_gates_in_kernel": no_gva or gates,
            "grouped_flash_qla": no_gva or flash_qla}


class _FlashQLACalls:
    """Counts calls that reach ``flash_qla.chunk_gated_delta_rule`` (FLA's FlashQLA backend imports
    the module and calls that attribute), and sets ``FLA_FLASH_QLA`` for the way being timed."""

    def __init__(self):
        self.calls = 0
        self.module = None
        if importlib.util.find_spec("flash_qla") is not None:
            try:
                self.module = importlib.import_module("flash_qla")
                inner = self.module.chunk_gated_delta_rule

                def counted(*a, **kw):
                    self.calls += 1
                    return inner(*a, **kw)

                self.module.chunk_gated_delta_rule = counted
            except Exception:  # noqa: BLE001 - the way then reports 0 calls
                self.module = None

    @staticmethod
    def switch(on: bool) -> None:
        os.environ["FLA_FLASH_QLA"] = "1" if on else "0"


def run_gdn(args, found) -> list[dict]:
    import fla.ops.gated_delta_rule as fla_gdr

    from gdn_cp.ops.fla.detect import gdn_kernel_backends

    fn = fla_gdr.chunk_gated_delta_rule
    hk, hv, d = 16, 32, 128
    ways = list(GDN_WAYS)
    why_not = gdn_ways_offered(found, gdn_kernel_backends())
    qla = _FlashQLACalls()
    rows = []
    big = gdn_inputs(args.tokens, hk, hv, d, torch.bfloat16)
    small = gdn_inputs(args.check_tokens, hk, hv, d, torch.bfloat16, seed=1)
    ref64 = gdn_fp64(small, hv // hk)
    first = None
    for way in ways:
        row = {"lever": "gdn_core", "way": way, "T": args.tokens, "heads": [hk, hv], "dim": d, "dtype": "bfloat16"}
        if why_not[way]:
            rows.append({**row, "status": "skipped", "why": why_not[way]})
            print(_line(rows[-1]), flush=True)
            continue
        qla.switch(way == "grouped_flash_qla")
        qla.calls = 0
        try:
            step = gdn_way(way, big, fn, hv // hk)
            o, grads = step()
            row.update(_timed(step, args.warmup, args.iters))
            row["flash_qla_calls"] = qla.calls
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
        step = None
        torch.cuda.empty_cache()
    qla.switch(False)
    return rows


# ---------------------------------------------------------------------------------------------
# the gated norm
# ---------------------------------------------------------------------------------------------

NORM_WAYS = ("torch", "fla_fused", "te", "te_zero_centered", "fla_fused_zero_centered")


def norm_ways_offered(found, te_error: str | None) -> dict[str, str | None]:
    """Per gated-norm way: None when it can run here, else why not."""
    fused = None if found.fused_gated_norm else "this FLA has no rms_norm_gated"
    return {"torch": None, "fla_fused": fused, "te": te_error, "te_zero_centered": te_error,
            "fla_fused_zero_centered": fused}


def _te_rmsnorm():
    """TransformerEngine's RMSNorm class, or the reason it is not importable."""
    if importlib.util.find_spec("transformer_engine") is None:
        return None, "TransformerEngine is not importable (gpu_suite.sh puts .site-te on PYTHONPATH)"
    try:
        return importlib.import_module("transformer_engine.pytorch").RMSNorm, None
    except Exception as err:  # noqa: BLE001
        return None, f"importing transformer_engine.pytorch failed: {type(err).__name__}: {err}"


def norm_fp64(x, z, w, eps: float, do):
    """``x / rms(x) * w * silu(z)`` in fp64 and its gradients (x, z, w): the reference of every way."""
    x, z, w = (t.detach().double().requires_grad_(True) for t in (x, z, w))
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w * F.silu(z)
    y.backward(do.double())
    return y.detach(), {"dx": x.grad, "dz": z.grad, "dw": w.grad}


def run_norm(args, found) -> list[dict]:
    from gdn_cp.ops.fla.norm import gated_rms_norm

    hv, d, eps = 32, 128, 1e-5
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(2)
    te_norm_cls, te_error = _te_rmsnorm()
    why_not = norm_ways_offered(found, te_error)

    def inputs(t):
        wide = torch.randn(t, hv * d * 2, device="cuda", generator=gen).to(torch.bfloat16)  # z inside in_proj's out
        return {"x": torch.randn(t * hv, d, device="cuda", generator=gen).to(torch.bfloat16),
                # w = 1 + k/64: exact in bf16, and so is w - 1 (a zero-centered norm's weight): one function
                "z_wide": wide, "w": (1 + (6.4 * torch.randn(d, device="cuda", generator=gen)).round() / 64
                                      ).clamp(0.5, 1.5).to(torch.bfloat16),
                "do": torch.randn(t * hv, d, device="cuda", generator=gen).to(torch.bfloat16), "t": t}

    def way(name, inp):
        zero_centered = name.endswith("zero_centered")
        if name.startswith("te"):
            norm = te_norm_cls(d, eps=eps, zero_centered_gamma=zero_centered, params_dtype=torch.bfloat16)
        else:
            norm = torch.nn.RMSNorm(d, eps=eps, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():  # every way computes x / rms(x) * w * silu(z): a zero-centered weight holds w - 1
            norm.weight.copy_(inp["w"].float() - 1 if zero_centered else inp["w"])
        x = inp["x"].detach().clone().requires_grad_(True)
        zw = inp["z_wide"].detach().clone().requires_grad_(True)

        def step():
            x.grad = zw.grad = norm.weight.grad = None
            z = zw[:, : hv * d].reshape(-1, d)
            if name.startswith("fla_fused"):
                w = norm.weight + 1 if zero_centered else norm.weight
                y = gated_rms_norm(x, z, w, eps)
            else:  # megatron-core's _apply_gated_norm: the norm, then * act(z) in fp32, cast back
                y = (norm(x) * F.silu(z.float())).to(x.dtype)
            y.backward(inp["do"])
            return y.detach(), {"dx": x.grad.clone(), "dz": zw.grad[:, : hv * d].reshape(-1, d).clone(),
                                "dw": norm.weight.grad.clone()}

        return step

    big, small = inputs(args.tokens), inputs(args.check_tokens)
    ref = norm_fp64(small["x"], small["z_wide"][:, : hv * d].reshape(-1, d), small["w"], eps, small["do"])
    first = None
    for name in NORM_WAYS:
        row = {"lever": "gated_norm", "way": name, "T": args.tokens, "rows": args.tokens * hv, "dim": d,
               "dtype": "bfloat16", "eps": eps}
        if why_not[name]:
            rows.append({**row, "status": "skipped", "why": why_not[name]})
            print(_line(rows[-1]), flush=True)
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
