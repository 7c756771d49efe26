#!/usr/bin/env python
"""FlashQLA on the GPU, one question per case, each answer a JSON row written as soon as it is known.

For the FlashQLA backend (gdn_cp.ops.flashqla) on one GPU: what is installed, how close it is to FLA and to
the reference, what its first calls cost (TileLang compiles each kernel variant on first use) and what
chunkwise's state summary costs on it. Cases, in run order (``--cases`` picks some):

- ``versions``: flash-qla, TileLang, torch, Triton, FLA, nvcc, the GPU; what the FlashQLA probe found;
  FLA's registered kernel backends (FLA >= 0.6 dispatches ``chunk_gated_delta_rule`` to FlashQLA);
- ``accuracy``: 16 key / 32 value heads, head dim 128, bf16, T=8K (one sequence), with an initial and
  a final state: output, final state and every gradient of gdn-cp's FlashQLA backend and FLA backend
  against the reference backend in fp32 on the GPU, and FlashQLA against FLA (relative L2);
- ``summary``: chunkwise's state summary ``[M | S_ext]`` of a slice one sequence covers and continues
  on both sides (T=8K): from FlashQLA scans (gdn-cp's generic path: values ``[0 | v]`` in two
  128-wide calls), from FLA's scan (256 wide), from FlashQLA's own prepare-h kernel (``fused_gdr_h``
  with every chunk warmed up: S_ext and M in one pass, forward only, in bf16; what its inter-card
  context exchanges), against the reference's fp32 summary; time of each.

Run 2026-12-02d (``benchmarks/results/runs/run_2026-12-02d/flashqla_probe.jsonl``) also had cases since
removed, each answered elsewhere now: the core's timing (``benchmarks/layer_full.py --backend flashqla``),
mixed-length packings, head dims and value heads per key head (the FlashQLA backend's tests in
``tests/gpu/test_flashqla_backend.py`` and ``tests/ops/test_flashqla_backend.py``;
``benchmarks/flashqla_heads.py``), FlashQLA's auto_cp off (``GDN_CP_FLASHQLA_AUTO_CP``) and FLA 0.6's
dispatch to FlashQLA (``docs/flashqla.md``); their code is in git history.

Every row carries the TileLang kernels compiled during its case (name and seconds, from TileLang's
kernel cache) and the case's wall time; a case that fails is a row with its error, and the next one
runs. Rows are appended to ``--out`` (JSON lines) one by one, so a time-out keeps what finished.

    python3 -m benchmarks.flashqla_probe --out $OUT/flashqla_probe.jsonl          # on the GPU machine
    GDN_CP_STAGES=flashqla bash benchmarks/gpu_suite.sh                           # with the .tl pack
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from .common import RESULTS_DIR, now_iso

logger = logging.getLogger("benchmarks.flashqla_probe")

CASES = ("versions", "accuracy", "summary")
REALISTIC = dict(hk=16, hv=32, dk=128, dv=128)
DEVICE = "cuda"  # a CPU smoke test (tests/test_flashqla_probe_smoke.py) runs the cases on a flash_qla stand-in
COMPILES: list[dict] = []  # TileLang kernels compiled so far (name, seconds), appended by the hook


# ---------------------------------------------------------------------------------------------
# plumbing: rows, compile events, timing
# ---------------------------------------------------------------------------------------------

class Rows:
    """JSON lines appended one by one (flushed: a killed run keeps every finished row)."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, row: dict) -> None:
        row = {"benchmark": "flashqla_probe", "date": now_iso(), **row}
        line = json.dumps(row, default=str)
        with open(self.path, "a") as f:
            f.write(line + "\n")
        print(line, flush=True)


def hook_tilelang_compiles() -> str:
    """Record every kernel TileLang compiles (a miss of its kernel cache) in :data:`COMPILES`.
    Best effort (TileLang's internals): returns what was hooked, or why not."""
    try:
        import tilelang.cache.kernel_cache as kc
        from tilelang.utils.language import get_prim_func_name
    except Exception as err:  # noqa: BLE001
        return f"not hooked ({type(err).__name__}: {err})"
    original = kc.JITKernel

    def compiled(func, *args, **kwargs):
        t0 = time.perf_counter()
        kernel = original(func, *args, **kwargs)
        COMPILES.append({"kernel": get_prim_func_name(func, "<unknown>"), "s": round(time.perf_counter() - t0, 2)})
        return kernel

    kc.JITKernel = compiled
    return "tilelang.cache.kernel_cache.JITKernel (each call is a kernel-cache miss: a compile)"


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _timer():
    """``(start(), stop() -> ms)``: CUDA events on the GPU, the host clock elsewhere (smoke tests)."""
    if DEVICE != "cuda":
        box = []
        return (lambda: box.append(time.perf_counter())), (lambda: (time.perf_counter() - box[0]) * 1e3)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def stop():
        end.record()
        _sync()
        return start.elapsed_time(end)

    return start.record, stop


def time_fwd_bwd(step, warmup: int, iters: int) -> dict:
    """``step()`` (one forward + backward): first call (compiles), then ``warmup`` untimed and ``iters``
    timed with CUDA events; ms median, p10, p90, peak GiB above what was allocated before."""
    _sync()
    t0 = time.perf_counter()
    step()
    _sync()
    first = time.perf_counter() - t0
    for _ in range(warmup):
        step()
    _sync()
    cuda = DEVICE == "cuda"
    base = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        start, stop = _timer()
        start()
        step()
        times.append(stop())
    times.sort()
    q = statistics.quantiles(times, n=10) if len(times) >= 2 else [times[0]] * 9
    return {"first_call_s": round(first, 2), "median_ms": round(statistics.median(times), 3),
            "p10_ms": round(q[0], 3), "p90_ms": round(q[-1], 3), "iters": iters, "warmup": warmup,
            "peak_gib": round((torch.cuda.max_memory_allocated() - base) / 2**30, 3) if cuda else None}


def gdr_inputs(cu: list[int], hk: int, hv: int, dk: int, dv: int, *, seed: int = 0, states: bool = True) -> dict:
    """bf16 q, k [T, hk, dk], v [T, hv, dv], beta; fp32 g (log decay, FLA's convention: close to 0)
    and initial states; the output / final-state cotangents."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    T, n = cu[-1], len(cu) - 1
    dev, bf = torch.device(DEVICE), torch.bfloat16

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=dev)

    t = {"q": rnd(T, hk, dk).to(bf), "k": rnd(T, hk, dk).to(bf), "v": rnd(T, hv, dv).to(bf),
         "g": F.logsigmoid(rnd(T, hv) + 3.0), "beta": torch.sigmoid(rnd(T, hv)).to(bf),
         "do": rnd(T, hv, dv).to(bf)}
    if states:
        t["h0"], t["dht"] = rnd(n, hv, dk, dv) * 0.1, rnd(n, hv, dk, dv)
    return t


_GRADS = ("q", "k", "v", "g", "beta", "h0")


def run_backend(backend, t: dict, cu: list[int], *, dtype=None) -> dict:
    """One forward + backward of ``backend.chunk_gated_delta_rule`` (with the states where ``t`` has
    them); outputs and gradients in fp32 (inputs cast to ``dtype`` first when given)."""
    leaves = {k: t[k].detach().to(dtype or t[k].dtype if k not in ("g", "h0") else torch.float32).requires_grad_(True)
              for k in _GRADS if k in t}
    states = "h0" in leaves
    o, fs = backend.chunk_gated_delta_rule(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                                           cu_seqlens=cu, initial_state=leaves.get("h0"), output_final_state=states)
    loss = (o.float() * t["do"].float()).sum() + ((fs * t["dht"]).sum() if states else 0)
    loss.backward()
    out = {"o": o.detach().float(), **({"final": fs.detach().float()} if states else {})}
    out.update({f"d{k}": v.grad.detach().float() for k, v in leaves.items()})
    return out


def rel_errors(got: dict, want: dict) -> dict:
    from gdn_cp.ops.accuracy import rel_l2

    return {k: float(f"{rel_l2(got[k], want[k]):.3e}") for k in want if k in got}


def _versions() -> dict:
    from gdn_cp_testing.results import stack_versions

    v = stack_versions()
    try:
        out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=20).stdout
        v["nvcc"] = out.strip().splitlines()[-1] if out else None
    except Exception as err:  # noqa: BLE001
        v["nvcc"] = f"unavailable ({err})"
    return v


# ---------------------------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------------------------

def case_versions(args) -> list[dict]:
    from gdn_cp.ops.fla.detect import gdn_kernel_backends
    from gdn_cp.ops.flashqla.detect import features, stack_report

    cache = os.environ.get("TILELANG_CACHE_DIR")
    files = sum(len(f) for _, _, f in os.walk(cache)) if cache and os.path.isdir(cache) else None
    return [{"versions": _versions(), "flashqla_features": features().__dict__, "flashqla_stack": stack_report(),
             "fla_kernel_backends": gdn_kernel_backends(), "tilelang_cache_dir": cache,
             "tilelang_cache_files_at_start": files, "compile_hook": args.compile_hook}]


def _accuracy(cu: list[int], dims: dict, *, with_fla: bool = True, seed: int = 0) -> dict:
    from gdn_cp.ops import get_backend
    from gdn_cp.ops.fla.detect import fla_available

    t = gdr_inputs(cu, **dims, seed=seed)
    ref = run_backend(get_backend("reference"), t, cu, dtype=torch.float32)  # fp32 math on the bf16-rounded inputs
    t0 = time.perf_counter()
    fq = run_backend(get_backend("flashqla"), t, cu)
    row = {"T": cu[-1], "sequences": len(cu) - 1, **dims, "flashqla_first_call_s": round(time.perf_counter() - t0, 2),
           "flashqla_vs_reference": rel_errors(fq, ref)}
    if with_fla and fla_available():
        fla = run_backend(get_backend("fla"), t, cu)
        row.update(fla_vs_reference=rel_errors(fla, ref), flashqla_vs_fla=rel_errors(fq, fla))
    return row


def case_accuracy(args) -> list[dict]:
    return [_accuracy([0, args.realistic_t], REALISTIC)]


def case_summary(args) -> list[dict]:
    """[M | S_ext] of a slice one sequence covers (continuing on both sides)."""
    from gdn_cp.modes.chunkwise import transition_summary
    from gdn_cp.ops import get_backend
    from gdn_cp.ops.fla.detect import fla_available

    reference = get_backend("reference")

    T = args.realistic_t
    cu = [0, T]
    t = gdr_inputs(cu, **REALISTIC, states=False)
    dk = REALISTIC["dk"]
    want = reference.chunk_state_summary(t["k"].float(), t["v"].float(), t["g"], t["beta"].float(), cu_seqlens=cu)[0]
    rows = []

    def judge(name, got, seconds, **extra):
        from gdn_cp.ops.accuracy import rel_l2

        rows.append({"T": T, "how": name, **REALISTIC, "M_rel_l2": float(f"{rel_l2(got[..., :dk], want[..., :dk]):.3e}"),
                     "S_ext_rel_l2": float(f"{rel_l2(got[..., dk:], want[..., dk:]):.3e}"), **seconds, **extra})

    def timed(fn):
        return time_fwd_bwd(fn, 2, max(5, args.iters // 4))  # forward only here: no backward in fn

    scans = {"flashqla_scans": get_backend("flashqla")}
    if fla_available():
        scans["fla_scan"] = get_backend("fla")
    for name, backend in scans.items():
        n0 = len(COMPILES)
        try:
            with torch.no_grad():
                got = transition_summary(t["q"], t["k"], t["v"], t["g"], t["beta"], cu, backend, torch.float32, True)
                res = timed(lambda: transition_summary(t["q"], t["k"], t["v"], t["g"], t["beta"], cu, backend,
                                                        torch.float32, True))
            judge(name, got, res, compiles=COMPILES[n0:])
        except Exception as err:  # noqa: BLE001
            rows.append({"how": name, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc(limit=8)})
    n0 = len(COMPILES)
    try:
        with torch.no_grad():
            got = _fused_gdr_h_summary(t, cu)
            res = timed(lambda: _fused_gdr_h_summary(t, cu))
        judge("flashqla_fused_gdr_h", got, res, compiles=COMPILES[n0:],
              note="FlashQLA's prepare-h kernel with every chunk warmed up: forward only (no backward exists), "
                   "S_ext and M in the activations' dtype")
    except Exception as err:  # noqa: BLE001
        rows.append({"how": "flashqla_fused_gdr_h", "error": f"{type(err).__name__}: {err}",
                     "traceback": traceback.format_exc(limit=8)})
    with torch.no_grad():
        res = timed(lambda: reference.chunk_state_summary(t["k"].float(), t["v"].float(), t["g"], t["beta"].float(),
                                                          cu_seqlens=cu))
    rows.append({"T": T, "how": "reference_tree_fp32", **REALISTIC, **res})
    return rows


def _fused_gdr_h_summary(t: dict, cu: list[int]) -> torch.Tensor:
    """``[Hv, Dk, Dk+Dv]`` from FlashQLA's own kernels: l2norm(k), chunk-local cumsum of g, the
    chunk's triangular solve, then ``fused_gdr_h`` in its cp mode with every chunk warmed up (the
    whole sequence's M), as FlashQLA's inter-card context computes it."""
    import importlib

    chunk = importlib.import_module("flash_qla.ops.gated_delta_rule.chunk")
    utils = importlib.import_module("flash_qla.ops.utils")
    l2 = importlib.import_module("flash_qla.utils").l2norm_fwd
    size = chunk.CHUNK_SIZE
    cu_dev = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    k, _ = l2(t["k"].unsqueeze(0).contiguous())
    g = utils.chunk_local_cumsum(g=t["g"].unsqueeze(0).contiguous(), cu_seqlens=cu_dev, chunk_size=size)
    beta = t["beta"].unsqueeze(0).contiguous()
    a = chunk.kkt_solve(k=k, b=beta, cu_seqlens=cu_dev, chunk_size=size)
    warm = torch.full((len(cu) - 1, t["v"].shape[1]), math.ceil(cu[-1] / size), dtype=torch.int32, device=DEVICE)
    _, ht, mt = chunk.fused_gdr_h(k=k, v=t["v"].unsqueeze(0).contiguous(), a=a, g=g, b=beta, initial_state=None,
                                  output_final_state=True, output_h=False, cu_seqlens=cu_dev, num_warmup_chunks=warm)
    return torch.cat([mt[0].float(), ht[0].float()], dim=-1)


CASE_FUNCS = {"versions": case_versions, "accuracy": case_accuracy, "summary": case_summary}


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    out_default = Path(os.environ["OUT"]) / "flashqla_probe.jsonl" if os.environ.get("OUT") else \
        RESULTS_DIR / "flashqla_probe.jsonl"
    p.add_argument("--out", type=Path, default=out_default, help=f"JSON lines, appended (default {out_default})")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list, in run order (default: all: {','.join(CASES)})")
    p.add_argument("--realistic-t", type=int, default=8192, help="T of the accuracy / summary cases (default 8192)")
    p.add_argument("--iters", type=int, default=20, help="timed fwd+bwd (default 20)")
    p.add_argument("--time-limit", type=float, default=540.0, help="no new case after this many seconds (default 540)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASE_FUNCS]
    if unknown:
        print(f"flashqla_probe: error: --cases {','.join(unknown)}: choose from {','.join(CASES)}", file=sys.stderr)
        return 2
    rows = Rows(args.out)
    if DEVICE == "cuda" and not torch.cuda.is_available():
        rows.add({"case": "versions", "error": f"torch {torch.__version__} sees no CUDA GPU: nothing to probe"})
        return 1
    from gdn_cp.ops.flashqla.detect import flashqla_problem

    problem = flashqla_problem()
    args.compile_hook = hook_tilelang_compiles() if problem is None else "not hooked (FlashQLA cannot run)"
    t_start = time.monotonic()
    failed = 0
    for case in cases:
        elapsed = time.monotonic() - t_start
        if elapsed > args.time_limit:
            rows.add({"case": case, "skipped": f"time limit ({elapsed:.0f} s > --time-limit {args.time_limit:g})"})
            continue
        if problem is not None and case != "versions":
            rows.add({"case": case, "skipped": f"the FlashQLA backend cannot run here: {problem}"})
            continue
        n0, t0 = len(COMPILES), time.perf_counter()
        logger.info("case %s ...", case)
        try:
            out = CASE_FUNCS[case](args)
            for i, row in enumerate(out):
                rows.add({"case": case, "part": i, **row})
        except Exception as err:  # noqa: BLE001 - record it, go on with the next case
            failed += 1
            rows.add({"case": case, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc(limit=12)})
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        rows.add({"case": case, "summary": True, "seconds": round(time.perf_counter() - t0, 1),
                  "compiled": COMPILES[n0:], "compile_s": round(sum(c["s"] for c in COMPILES[n0:]), 1)})
    rows.add({"case": "all", "summary": True, "seconds": round(time.monotonic() - t_start, 1),
              "kernels_compiled": len(COMPILES), "compile_s": round(sum(c["s"] for c in COMPILES), 1)})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
