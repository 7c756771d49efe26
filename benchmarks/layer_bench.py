#!/usr/bin/env python
"""GDN layer core benchmark: forward+backward time, compute vs communication wait, peak memory and
bytes sent per token, per CP mode, over tokens and cp.

What is timed: ``gdn_cp.modes.gdn_core`` (causal conv + SiLU + gated delta rule, the part of the GDN
layer that context parallelism changes) forward and backward on one packed THD micro-batch,
rank-local zigzag rows in and out, the CP plan built once before timing (a per-micro-batch cost
shared by every layer; see ``route_build.py``).

Sweep (defaults): T_global in {8K, 32K, 128K}, cp in {1, 2, 4}, modes chunkwise / headwise /
all_gather, the Qwen3.5-9B GDN shape at TP=1 (16 key heads, 32 value heads, head dims 128, conv
W=4), bf16 activations on CUDA (fp32 on the CPU), one micro-batch of ``--num-sequences`` packed
sequences of mixed lengths per T (``gdn_cp.testing.packings.packed_boundaries``; lengths are multiples of
2*max(cp), so every cp uses the same boundaries).

Order (FLA's Triton autotune runs once per kernel key, in one process where it can: the GDN
kernels' key holds the head count and V but not T; the conv's holds the channels and ceil(T/1024)):

1. one process (cp=1): a warm-up of the full shape at ``--tune-tokens`` (so that T picks the GDN
   configs); every cp=1 case: T for each T, and for each cp>1 the contiguous T/cp slice of the T
   packing with the most sequence pieces (the per-rank work of chunkwise at CP=cp: it gives
   compute(CP=1, T/N) / compute(CP=N, T)); then warm-ups at the exact shapes the ranks will meet:
   chunkwise's halo conv and state-summary scans (V = Dk+Dv) at each T/cp, headwise's heads/cp at
   each T;
2. one pool of max(cp) ranks (``gdn_cp.testing.ranks.RankPool``: gloo ranks on one GPU, NCCL
   with one rank per GPU when there are enough GPUs, gloo on the CPU): every (T, cp, mode) with
   cp > 1, T ascending, ranks outside the cp group idle. On gloo groups chunkwise runs gdn-cp's
   halo + state-summary exchange around FLA's per-rank kernels (warmed in step 1); on NCCL groups
   it runs FLA's cp_context, whose CP-only kernels autotune on the first chunkwise case here. The
   path taken is recorded per case (``chunkwise_path``).

A cold Triton cache makes this expensive (about a minute per conv key and a few per GDN head
shape on an H200, FLA 0.4.2): carry the cache between runs (``TRITON_CACHE_DIR``,
``FLA_CACHE_RESULTS=1``), or use ``--fast-autotune`` (first working config, flagged in the JSON).

Per case, on every rank: ``--warmup`` untimed iterations, then up to ``--iters`` timed ones
(cuda synchronize + barrier before each, cuda synchronize after; stops early once ``--case-budget``
seconds of timed iterations are spent, at least 2); wall = median over iterations of the slowest
rank's time. Peak memory: ``torch.cuda.max_memory_allocated`` over the timed iterations (reset
after warm-up; includes the case's inputs), max over ranks. Compute: the sum of CUDA kernel
durations (memcpy/memset excluded) in one more iteration under ``torch.profiler`` (CUDA activity
only), max over ranks; comm/wait = wall - compute. Bytes per token: bytes this rank handed to
gdn-cp's collectives (``gdn_cp.comm.comm_stats``) per fwd+bwd divided by T_local, max over ranks;
FLA's own halo/state exchange (chunkwise on the FLA backend) is not in it, so ``dist_bytes_per_token``
also counts every ``torch.distributed`` collective the rank called (input sizes).

Robustness: ``--time-limit`` seconds after start no new case starts; a running case is abandoned
``--grace`` seconds after that (its ranks are killed). The JSON is written atomically after every
case (and on SIGTERM/SIGINT), with per-case errors: a failing case records its traceback and the
sweep goes on (a hung pool is killed and respawned). Headwise with heads not divisible by cp is
recorded as ``refused`` with the library's ValueError.

    python benchmarks/layer_bench.py --quick --out /tmp/layer.json      # CPU smoke run (~15 s)
    python benchmarks/layer_bench.py --out $OUT/layer_bench.json        # GPU sweep
    python benchmarks/plot_layer.py $OUT/layer_bench.json               # re-plot (CPU)
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    RESULTS_DIR,
    format_table,
    import_gdn_cp,
    machine_info,
    now_iso,
    setup_logging,
    versions,
    write_json,
)

import_gdn_cp()

import torch  # noqa: E402

from gdn_cp.testing.packings import packed_boundaries  # noqa: E402
from gdn_cp.testing.ranks import RankError, RankPool  # noqa: E402

logger = logging.getLogger("benchmarks.layer_bench")

DEFAULT_TOKENS = (8 * 1024, 32 * 1024, 128 * 1024)
DEFAULT_CP = (1, 2, 4)
DEFAULT_MODES = ("chunkwise", "headwise", "all_gather")
QWEN35_9B = dict(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, conv_width=4)
QUICK = dict(tokens=(256, 512), cp=(1, 2), num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16,
             num_sequences=5, iters=2, case_budget=5.0)
RATIO_TARGET = 0.9
GIB = float(2**30)

NOTES = [
    "wall: median over timed iterations of the slowest rank's fwd+bwd time (cuda synchronize + barrier "
    "before each iteration, synchronize after).",
    "compute: sum of CUDA kernel durations (memcpy/memset excluded) in one profiled fwd+bwd, max over "
    "ranks; comm/wait = wall - compute. With several gloo ranks on one GPU, kernels of different ranks "
    "time-share the GPU and gloo stages every collective through the host: comm/wait is not a network "
    "figure, and compute can include time-slicing with other ranks.",
    "bytes_per_token: bytes this rank handed to gdn-cp's collectives per fwd+bwd / T_local (max over "
    "ranks; the send buffers, including rows a rank keeps). FLA's internal halo/state exchange (chunkwise "
    "with FLA's cp_context, NCCL groups) is NOT counted there; dist_bytes_per_token counts the input "
    "tensors of every torch.distributed collective the rank called, FLA's included.",
    "peak_gib: torch.cuda.max_memory_allocated over the timed iterations (reset after warm-up), including "
    "the case's inputs; peak_delta_gib subtracts what was allocated before the timed iterations.",
    "cp=1 runs the same local core whatever the mode (mode 'cp1'); cp1 cases with 'slice_of' are the "
    "contiguous T/cp slice (most sequence pieces) of the T packing: the per-rank work of chunkwise.",
    "chunkwise_compute_ratio = compute(CP=1, T/N slice) / compute(CP=N, T) (target >= 0.9).",
]


# ---------------------------------------------------------------------------------------------
# small helpers (main process)
# ---------------------------------------------------------------------------------------------

def parse_tokens(text: str) -> int:
    t = text.strip().lower()
    mult = 1
    if t.endswith("k"):
        mult, t = 1024, t[:-1]
    elif t.endswith("m"):
        mult, t = 1024 * 1024, t[:-1]
    value = int(float(t) * mult)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"tokens must be positive, got {text!r}")
    return value


def fmt_tokens(t: int) -> str:
    if t % (1024 * 1024) == 0:
        return f"{t // (1024 * 1024)}M"
    if t % 1024 == 0:
        return f"{t // 1024}K"
    return str(t)


def contiguous_slice(cu: list[int], t_global: int, cp: int, rank: int) -> list[int]:
    """Boundaries of rank ``rank``'s contiguous rows [r*T/cp, (r+1)*T/cp) of packing ``cu`` (local
    offsets, empty pieces dropped)."""
    part = t_global // cp
    lo, hi = rank * part, (rank + 1) * part
    inner = sorted({c - lo for c in cu if lo < c < hi})
    return [0] + inner + [part]


def busiest_slice(cu: list[int], t_global: int, cp: int) -> tuple[int, list[int]]:
    """The rank whose contiguous slice has the most sequence pieces (first on ties), and its slice."""
    best = max(range(cp), key=lambda r: (len(contiguous_slice(cu, t_global, cp, r)), -r))
    return best, contiguous_slice(cu, t_global, cp, best)


def _gpu_info_smi() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=15,
        )
        return out.stdout.strip() or None
    except Exception:  # noqa: BLE001
        return None


def _pkg_version(name: str) -> str | None:
    try:
        import importlib.metadata as md

        return md.version(name)
    except Exception:  # noqa: BLE001
        return None


# ---------------------------------------------------------------------------------------------
# rank side (runs in the pool's processes; module-level functions, pickled by name)
# ---------------------------------------------------------------------------------------------

_DIST_BYTES: dict = {"on": False, "bytes": 0, "calls": {}}


def _install_dist_counter() -> None:
    """Count the input bytes of every torch.distributed collective called while ``_DIST_BYTES['on']``
    (FLA calls them through ``torch.distributed.<name>`` at call time, like gdn-cp)."""
    import functools

    import torch.distributed as dist

    if getattr(dist, "_layer_bench_counted", False):
        return
    inputs = {  # name -> index of the tensor this rank sends (positional), keyword name
        "all_gather_into_tensor": (1, "input_tensor"),
        "all_gather_single": (1, "input"),
        "reduce_scatter_tensor": (1, "input"),
        "reduce_scatter_single": (1, "input"),
        "all_to_all_single": (1, "input"),
        "all_reduce": (0, "tensor"),
        "all_gather": (1, "tensor"),
        "broadcast": (0, "tensor"),
    }
    for name, (pos, kw) in inputs.items():
        orig = getattr(dist, name, None)
        if orig is None:
            continue

        def wrapped(*args, __orig=orig, __name=name, __pos=pos, __kw=kw, **kwargs):
            if _DIST_BYTES["on"]:
                t = args[__pos] if len(args) > __pos else kwargs.get(__kw)
                if isinstance(t, torch.Tensor):
                    _DIST_BYTES["bytes"] += t.numel() * t.element_size()
                _DIST_BYTES["calls"][__name] = _DIST_BYTES["calls"].get(__name, 0) + 1
            return __orig(*args, **kwargs)

        functools.update_wrapper(wrapped, orig)
        setattr(dist, name, wrapped)
        # Modules that bound the function at import (gdn_cp.comm binds all_gather_single /
        # all_gather_into_tensor) call it directly: rebind those references too. The harness's
        # shims wrap with functools.update_wrapper, so follow __wrapped__ to find every identity.
        identities = []
        f = orig
        while f is not None and f not in identities:
            identities.append(f)
            f = getattr(f, "__wrapped__", None)
        for mod_name, mod in list(sys.modules.items()):
            if mod is None or not mod_name.startswith(("gdn_cp", "fla")):
                continue
            for attr, value in list(vars(mod).items()):
                if any(value is i for i in identities):
                    setattr(mod, attr, wrapped)
    dist._layer_bench_counted = True


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _max_over(group, value: float, ctx, device: torch.device) -> float:
    """Max of ``value`` over the group's ranks (the ranks agree on iteration counts with it)."""
    if group is None:
        return value
    import torch.distributed as dist

    dev = device if ctx.backend == "nccl" else torch.device("cpu")
    t = torch.tensor([float(value)], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _kernel_stats(prof) -> dict:
    """Sum (and union) of CUDA kernel durations in a finished profile; memcpy/memset excluded."""
    spans = []
    method = None
    try:
        fd, path = tempfile.mkstemp(suffix=".json", prefix="layer_bench_trace_")
        os.close(fd)
        try:
            prof.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
        finally:
            try:
                os.unlink(path)
            except OSError:
                pass
        events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
        for e in events:
            if isinstance(e, dict) and e.get("ph") == "X" and e.get("cat") == "kernel":
                spans.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))))
        method = "chrome_trace cat=kernel"
    except Exception:  # noqa: BLE001 - fall back to the profiler's events
        spans = []
        from torch.autograd import DeviceType

        for e in prof.events():
            if getattr(e, "device_type", None) != DeviceType.CUDA:
                continue
            name = str(e.name)
            if name.startswith(("Memcpy", "Memset", "ProfilerStep")) or "memcpy" in name.lower():
                continue
            spans.append((float(e.time_range.start), float(e.time_range.end)))
        method = "profiler events device_type=CUDA"
    total = sum(b - a for a, b in spans)
    union = 0.0
    end = None
    for a, b in sorted(spans):
        if end is None or a > end:
            union += b - a
            end = b
        elif b > end:
            union += b - end
            end = b
    return {"compute_ms": total / 1e3, "kernel_union_ms": union / 1e3, "kernels": len(spans), "method": method}


def _make_inputs(t_local: int, dims: dict, dtype: torch.dtype, device: torch.device, seed: int):
    """Random rank-local inputs on ``device`` (generated there: no host-side T_global tensors)."""
    import torch.nn.functional as F

    hk, hv, dk, dv, w = (dims[k] for k in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_width"))
    c = 2 * hk * dk + hv * dv
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size, dt=dtype, scale=1.0):
        return (torch.randn(*size, generator=gen, device=device, dtype=torch.float32) * scale).to(dt)

    leaves = {
        "qkv": randn(t_local, c),
        "g": (-F.softplus(randn(t_local, hv, dt=torch.float32)) * 0.3),
        "beta": torch.sigmoid(randn(t_local, hv, dt=torch.float32)).to(dtype),
    }
    params = {"conv_weight": randn(c, w, scale=0.5), "conv_bias": randn(c, scale=0.1)}
    dout = randn(t_local, hv, dv)
    for t in (*leaves.values(), *params.values()):
        t.requires_grad_(True)
    return leaves, params, dout


def _case_device(ctx, spec) -> torch.device:
    if spec["device"] == "cuda":
        return ctx.device if ctx.device.type == "cuda" else torch.device("cuda", 0)
    return torch.device("cpu")


def rank_info(ctx, spec) -> dict:
    """Device and library versions as a rank sees them."""
    info = {"rank": ctx.rank, "dist_backend": ctx.backend, "device": str(ctx.device),
            "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if spec["device"] == "cuda" and torch.cuda.is_available():
        dev = _case_device(ctx, spec)
        props = torch.cuda.get_device_properties(dev)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / GIB, 1),
                    capability=list(torch.cuda.get_device_capability(dev)), gpu_count=torch.cuda.device_count())
    if spec["backend"] == "fla":
        from gdn_cp.ops.fla import fla_available, fla_import_error, fla_version, has_cp_context

        info.update(fla=fla_version(), fla_available=fla_available(), fla_error=fla_import_error(),
                    fla_cp_context=has_cp_context() if fla_available() else False)
    info["triton"] = _pkg_version("triton")
    info["fast_autotune"] = os.environ.get("GDN_CP_TEST_FAST_AUTOTUNE") == "1"
    return info


def rank_tune(ctx, spec) -> dict | None:
    """One untimed fwd+bwd at cp=1 for a head shape: compiles and autotunes its kernels."""
    if ctx.rank != 0:
        return None
    from gdn_cp.layout import RouteCache
    from gdn_cp.modes import GDNShape, gdn_core
    from gdn_cp.ops import get_backend

    device = _case_device(ctx, spec)
    dims = spec["dims"]
    shape = GDNShape(dims["num_k_heads"], dims["num_v_heads"], dims["head_k_dim"], dims["head_v_dim"])
    cu = spec["cu"]
    backend = get_backend(spec["backend"])
    if spec.get("kind") == "summary":
        return _tune_summary(backend, shape, cu[-1], dims["conv_width"], getattr(torch, spec["dtype"]), device,
                             spec["seed"])
    plan = RouteCache().plan(torch.tensor(cu, dtype=torch.int32, device=device), 1, 0)
    leaves, params, dout = _make_inputs(plan.t_local, dims, getattr(torch, spec["dtype"]), device, spec["seed"])
    t0 = time.perf_counter()
    o = gdn_core(leaves["qkv"], leaves["g"], leaves["beta"], params["conv_weight"], params["conv_bias"],
                 shape=shape, mode="chunkwise", plan=plan, group=None, backend=backend)
    o.backward(dout)
    _sync(device)
    return {"seconds": time.perf_counter() - t0}


def _tune_summary(backend, shape, n: int, conv_width: int, dtype, device, seed: int) -> dict:
    """What chunkwise's own halo/state path (gloo groups) adds at ``n`` rows per rank, fwd+bwd: the
    conv from a halo (a compile variant; the conv's autotune key holds ceil(n/1024)), the state
    summary of a piece that spans a whole rank (v' = [0 | v], V = Dk+Dv: its own autotune key) and
    of a last piece (final state), and the first piece's scan from an initial state."""
    import torch.nn.functional as F

    gen = torch.Generator(device=device).manual_seed(seed)
    hk, hv, dk, dv = shape.num_k_heads, shape.num_v_heads, shape.head_k_dim, shape.head_v_dim

    def randn(*size, dt=dtype):
        return torch.randn(*size, generator=gen, device=device, dtype=torch.float32).to(dt).requires_grad_(True)

    t0 = time.perf_counter()
    c = shape.conv_dim
    x, w, b, halo = randn(n, c), randn(c, conv_width), randn(c), randn(conv_width - 1, c)
    y = backend.causal_conv1d(x, w, b, cu_seqlens=[0, n], halo=halo, activation="silu")
    y.float().sum().backward()
    # (V, initial state, final state) as chunkwise calls them: a whole-slice piece's summary,
    # a last piece's summary, the first piece's scan from the composed state
    for v_dim, with_h0, with_final in ((dk + dv, True, True), (dv, False, True), (dv, True, False)):
        q, k, v = randn(n, hk, dk), randn(n, hk, dk), randn(n, hv, v_dim)
        g = (-F.softplus(torch.randn(n, hv, generator=gen, device=device)) * 0.3).requires_grad_(True)
        beta = torch.sigmoid(torch.randn(n, hv, generator=gen, device=device)).to(dtype).requires_grad_(True)
        h0 = torch.randn(1, hv, dk, v_dim, generator=gen, device=device).requires_grad_(True) if with_h0 else None
        o, final = backend.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=[0, n], initial_state=h0,
                                                  output_final_state=with_final, use_qk_l2norm=shape.qk_l2norm)
        loss = o.float().sum() + (final.float().sum() if final is not None else 0.0)
        loss.backward()
    _sync(device)
    return {"seconds": time.perf_counter() - t0}


def rank_case(ctx, spec) -> dict:
    """One (cp, T, mode) case on this rank. Ranks outside the cp group idle."""
    cp = spec["cp"]
    if ctx.rank >= cp:
        return {"idle": True}
    import torch.distributed as dist

    from gdn_cp.comm import comm_stats, reset_comm_stats
    from gdn_cp.layout import RouteCache
    from gdn_cp.modes import GDNShape, gdn_core
    from gdn_cp.ops import get_backend

    _install_dist_counter()
    device = _case_device(ctx, spec)
    group = None if cp == 1 else ctx.group(cp)
    rank = ctx.rank
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    dims = spec["dims"]
    shape = GDNShape(dims["num_k_heads"], dims["num_v_heads"], dims["head_k_dim"], dims["head_v_dim"])
    cu_t = torch.tensor(spec["cu"], dtype=torch.int32, device=device)
    plan = RouteCache().plan(cu_t, cp, rank)
    t_local = plan.t_local
    leaves, params, dout = _make_inputs(t_local, dims, getattr(torch, spec["dtype"]), device,
                                        spec["seed"] * 1000 + rank)
    backend = get_backend(spec["backend"])
    mode = spec["mode"] if cp > 1 else "chunkwise"  # cp=1: every mode is the local core

    def step():
        for t in (*leaves.values(), *params.values()):
            t.grad = None
        o = gdn_core(leaves["qkv"], leaves["g"], leaves["beta"], params["conv_weight"], params["conv_bias"],
                     shape=shape, mode=mode, plan=plan, group=group, backend=backend)
        o.backward(dout)

    def barrier():
        if group is not None:
            dist.barrier(group=group)

    out = {"rank": rank, "t_local": t_local}
    if mode == "chunkwise" and cp > 1:
        out["chunkwise_path"] = ("fla cp_context" if backend.native_cp_core(group) is not None
                                 else "gdn-cp halo + state-summary exchange")
    # warm-up (compiles/autotunes on first use of a shape)
    _sync(device)
    barrier()
    t0 = time.perf_counter()
    for i in range(spec["warmup"]):
        try:
            step()
        except ValueError as err:  # raised before any collective, on every rank alike
            if i == 0:
                return {**out, "refused": f"{type(err).__name__}: {err}"}
            raise
    _sync(device)
    out["warmup_s"] = time.perf_counter() - t0

    # timed iterations (peak memory and collective bytes measured over them)
    for t in (*leaves.values(), *params.values()):
        t.grad = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        out["allocated_before_gib"] = torch.cuda.memory_allocated(device) / GIB
    reset_comm_stats()
    _DIST_BYTES.update(on=False, bytes=0, calls={})
    times = []
    spent = 0.0
    while len(times) < spec["iters"]:
        _sync(device)
        barrier()
        _DIST_BYTES["on"] = True
        t = time.perf_counter()
        step()
        _sync(device)
        dt = time.perf_counter() - t
        _DIST_BYTES["on"] = False
        times.append(dt * 1e3)
        spent = _max_over(group, spent + dt, ctx, device)  # every rank takes the same decision
        if len(times) >= 2 and spent > spec["case_budget"]:
            break
    n = len(times)
    out["iter_ms"] = times
    stats = comm_stats()
    out["bytes_by_op"] = {k: v / n for k, v in stats.items() if not k.endswith(":calls")}
    out["calls_by_op"] = {k[: -len(":calls")]: v / n for k, v in stats.items() if k.endswith(":calls")}
    out["bytes_per_token"] = sum(out["bytes_by_op"].values()) / t_local
    out["dist_bytes_per_token"] = _DIST_BYTES["bytes"] / n / t_local
    out["dist_calls"] = {k: v / n for k, v in _DIST_BYTES["calls"].items()}
    if device.type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB

    # one profiled iteration: kernel time
    if device.type == "cuda" and spec["profile"]:
        from torch.profiler import ProfilerActivity, profile

        _sync(device)
        barrier()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            step()
            _sync(device)
            out["profiled_wall_ms"] = (time.perf_counter() - t) * 1e3
        barrier()
        out.update(_kernel_stats(prof))
    return out


# ---------------------------------------------------------------------------------------------
# main process: pools, the sweep, the report
# ---------------------------------------------------------------------------------------------

class _Stop(Exception):
    pass


def _on_signal(signum, frame):  # noqa: ARG001
    raise _Stop(f"signal {signum}")


class Sweep:
    def __init__(self, args):
        self.args = args
        self.t0 = time.monotonic()
        self.cases: list[dict] = []
        self.tune: list[dict] = []
        self.pools: list[dict] = []
        self.rank_info: dict = {}
        self.report: dict = {}
        self.pool = None
        self.pool_world = 0
        self.kills = 0
        self.fatal: str | None = None

    # -- time ---------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def hard_left(self) -> float:
        return self.args.time_limit + self.args.grace - self.elapsed()

    def may_start(self) -> bool:
        return self.elapsed() < self.args.time_limit and self.hard_left() > 5

    # -- pools ----------------------------------------------------------------------------------
    def _env(self) -> dict:
        return {"GDN_CP_TEST_FAST_AUTOTUNE": "1" if self.args.fast_autotune else "0",
                "GDN_CP_TEST_PG_TIMEOUT": str(self.args.pg_timeout)}

    def open_pool(self, world: int):
        self.close_pool()
        backend = "gloo" if (self.args.device == "cpu" or world == 1) else None
        timeout = max(10.0, min(self.args.case_timeout, self.hard_left()))
        t = time.perf_counter()
        logger.info("spawning %d rank(s) (%s)", world, backend or "auto backend")
        # a failed start kills its own ranks before raising
        self.pool = RankPool(world, device=self.args.device, backend=backend, timeout_s=timeout, env=self._env())
        self.pool_world = world
        rec = {"world": world, "backend": self.pool.backend, "one_gpu": self.pool.one_gpu,
               "startup_s": round(time.perf_counter() - t, 2)}
        self.pools.append(rec)
        logger.info("pool of %d up in %.1fs (backend %s, one GPU: %s)", world, rec["startup_s"],
                    self.pool.backend, self.pool.one_gpu)
        infos = self.pool.run(rank_info, self.spec_base())
        self.rank_info.setdefault(f"world{world}", infos[0])
        rec["rank0"] = infos[0]
        if self.args.backend == "fla" and not infos[0].get("fla_available"):
            self.fatal = f"FLA backend unavailable in the ranks ({infos[0].get('fla_error')}); nothing can run"
            raise RuntimeError(self.fatal)
        return self.pool

    def close_pool(self, kill: bool = False) -> None:
        pool, self.pool = self.pool, None
        if pool is None:
            return
        if kill or pool.broken:
            self.kills += 1
            pool.kill()
        else:
            try:
                pool.close()
            except Exception:  # noqa: BLE001
                pool.kill()

    def ensure_pool(self, world: int):
        if self.pool is not None and self.pool_world == world and not self.pool.broken:
            return self.pool
        if self.pool is not None and self.pool.broken:
            self.close_pool(kill=True)
        if self.kills > self.args.max_respawns:
            raise RuntimeError(f"{self.kills} rank pools were killed (hang or crash); --max-respawns "
                               f"{self.args.max_respawns} reached, not starting another")
        return self.open_pool(world)

    # -- specs ----------------------------------------------------------------------------------
    def spec_base(self) -> dict:
        a = self.args
        return {"device": a.device, "backend": a.backend, "dtype": a.dtype, "seed": a.seed,
                "dims": dict(num_k_heads=a.num_k_heads, num_v_heads=a.num_v_heads, head_k_dim=a.head_k_dim,
                             head_v_dim=a.head_v_dim, conv_width=a.conv_width),
                "warmup": a.warmup, "iters": a.iters, "case_budget": a.case_budget, "profile": not a.no_profile}

    # -- records --------------------------------------------------------------------------------
    def write(self, finished: bool = False, stopped: str | None = None) -> None:
        self.report.update(
            fatal=self.fatal,
            finished=finished,
            stopped=stopped,
            elapsed_s=round(self.elapsed(), 1),
            updated=now_iso(),
            rank_info=self.rank_info,
            pools=self.pools,
            tune=self.tune,
            cases=self.cases,
            summary=summarize(self.cases),
        )
        write_json(self.args.out, self.report)

    def run_case(self, case: dict) -> None:
        label = f"cp={case['cp']} T={fmt_tokens(case['t_global'])} {case['mode']}" + (
            f" (slice of T={fmt_tokens(case['slice_of']['t_global'])})" if case.get("slice_of") else "")
        if not self.may_start():
            case.update(status="skipped", error=f"time limit: not started ({self.elapsed():.0f}s elapsed, "
                                                f"--time-limit {self.args.time_limit:g}s)")
            self.cases.append(case)
            return
        if self.fatal:
            case.update(status="error", error=self.fatal)
            self.cases.append(case)
            return
        oom = self.oom_risk(case)
        if oom:
            case.update(status="skipped", error=oom)
            self.cases.append(case)
            logger.warning("[%5.0fs] %s: %s", self.elapsed(), label, oom)
            self.write()
            return
        t = time.perf_counter()
        logger.info("[%5.0fs] %s ...", self.elapsed(), label)
        try:
            pool = self.ensure_pool(case["pool_world"])
            pool.timeout_s = max(5.0, min(self.args.case_timeout, self.hard_left()))
            spec = {**self.spec_base(), "cp": case["cp"], "mode": case["mode"], "cu": case["cu"]}
            outs = pool.run(rank_case, spec, raise_on_error=False)
            fill_case(case, outs)
        except BaseException as err:  # noqa: BLE001 - record, go on (re-raise only on a stop signal)
            case.update(status="error", error=f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
            if self.pool is not None and self.pool.broken:
                logger.warning("rank pool broken (%s): killing it", self.pool.broken)
                self.close_pool(kill=True)
            if isinstance(err, (_Stop, KeyboardInterrupt)):
                case["elapsed_s"] = round(time.perf_counter() - t, 2)
                self.cases.append(case)
                raise
        case["elapsed_s"] = round(time.perf_counter() - t, 2)
        self.cases.append(case)
        logger.info("[%5.0fs] %s: %s", self.elapsed(), label, case_line(case))
        self.write()

    def oom_risk(self, case: dict) -> str | None:
        """Why an all_gather case would not fit the one GPU its gloo ranks share (None: run it)."""
        if self.args.no_oom_guard or case["mode"] != "all_gather" or self.args.device != "cuda":
            return None
        pool = next((p for p in self.pools if p.get("world") == case["pool_world"]), None)
        if pool is not None and not pool.get("one_gpu"):
            return None
        gpu_gib = (self.rank_info.get("world1") or {}).get("gpu_memory_gib")
        ref = _find(self.cases, cp=1, t_global=case["t_global"], slice_of=None)
        if not gpu_gib or ref is None or ref.get("peak_gib") is None:
            return None
        est = case["cp"] * (ref["peak_gib"] + 1.0)  # every rank runs the whole core; + context/buffers
        if est > 0.92 * gpu_gib:
            return (f"not run: all_gather at cp={case['cp']} runs the full T={case['t_global']} core on every rank; "
                    f"est. {est:.0f} GiB on one {gpu_gib:.0f} GiB GPU (cp x (cp=1 peak {ref['peak_gib']:.1f} GiB + 1)); "
                    f"--no-oom-guard runs it anyway")
        return None

    def run_tune(self, name: str, dims: dict, cu: list[int], kind: str = "core") -> None:
        if self.fatal:
            self.tune.append({"shape": name, "status": "error", "error": self.fatal})
            return
        if not self.may_start():
            self.tune.append({"shape": name, "status": "skipped"})
            return
        t = time.perf_counter()
        logger.info("[%5.0fs] autotune/compile warm-up: %s ...", self.elapsed(), name)
        rec = {"shape": name, "dims": dims, "t": cu[-1]}
        try:
            pool = self.ensure_pool(1)
            pool.timeout_s = max(5.0, min(self.args.case_timeout, self.hard_left()))
            out = pool.run(rank_tune, {**self.spec_base(), "dims": dims, "cu": cu, "kind": kind})
            rec.update(status="ok", seconds=round(out[0]["seconds"], 2))
        except BaseException as err:  # noqa: BLE001
            rec.update(status="error", error=f"{type(err).__name__}: {err}")
            if self.pool is not None and self.pool.broken:
                self.close_pool(kill=True)
            if isinstance(err, (_Stop, KeyboardInterrupt)):
                self.tune.append(rec)
                raise
        rec["elapsed_s"] = round(time.perf_counter() - t, 2)
        self.tune.append(rec)
        logger.info("[%5.0fs] warm-up %s: %s", self.elapsed(), name, rec.get("status"))
        self.write()


def fill_case(case: dict, outs: list) -> None:
    failures = {i: o for i, o in enumerate(outs) if isinstance(o, RankError)}
    if failures:
        body = "\n".join(str(e) for e in failures.values())
        case.update(status="error", error=body)
        return
    ranks = [o for o in outs if isinstance(o, dict) and not o.get("idle")]
    refused = [o["refused"] for o in ranks if "refused" in o]
    if refused:
        case.update(status="refused", error=refused[0])
        return
    n = min(len(o["iter_ms"]) for o in ranks)
    per_iter_max = [max(o["iter_ms"][i] for o in ranks) for i in range(n)]
    case.update(
        status="ok",
        error=None,
        iters=n,
        wall_ms=statistics.median(per_iter_max),
        wall_ms_iters=per_iter_max,
        wall_ms_per_rank=[statistics.median(o["iter_ms"]) for o in ranks],
        warmup_s=max(o["warmup_s"] for o in ranks),
        bytes_per_token=max(o["bytes_per_token"] for o in ranks),
        bytes_per_token_per_rank=[o["bytes_per_token"] for o in ranks],
        dist_bytes_per_token=max(o["dist_bytes_per_token"] for o in ranks),
        bytes_by_op=ranks[0]["bytes_by_op"],
        calls_by_op=ranks[0]["calls_by_op"],
        dist_calls=ranks[0]["dist_calls"],
    )
    if "chunkwise_path" in ranks[0]:
        case["chunkwise_path"] = ranks[0]["chunkwise_path"]
    if all("peak_gib" in o for o in ranks):
        case.update(
            peak_gib=max(o["peak_gib"] for o in ranks),
            peak_gib_per_rank=[o["peak_gib"] for o in ranks],
            peak_gib_sum_ranks=sum(o["peak_gib"] for o in ranks),  # what ranks sharing one GPU need
            peak_delta_gib=max(o["peak_gib"] - o["allocated_before_gib"] for o in ranks),
            peak_reserved_gib=max(o["peak_reserved_gib"] for o in ranks),
        )
    else:
        case.update(peak_gib=None, peak_gib_per_rank=None, peak_delta_gib=None)
    if all("compute_ms" in o for o in ranks):
        compute = [o["compute_ms"] for o in ranks]
        case.update(
            compute_ms=max(compute),
            compute_ms_mean=statistics.fmean(compute),
            compute_ms_per_rank=compute,
            kernel_union_ms=max(o["kernel_union_ms"] for o in ranks),
            kernels=ranks[0]["kernels"],
            kernel_method=ranks[0]["method"],
            profiled_wall_ms=max(o["profiled_wall_ms"] for o in ranks),
            comm_wait_ms=case["wall_ms"] - max(compute),
        )
    else:
        case.update(compute_ms=None, compute_ms_per_rank=None, comm_wait_ms=None)


def _num(v, fmt="{:.2f}"):
    return "-" if v is None else fmt.format(v)


def case_line(case: dict) -> str:
    if case["status"] != "ok":
        first = (case.get("error") or "").strip().splitlines()
        return f"{case['status']}: {first[-1] if first else ''}"[:300]
    return (f"wall {case['wall_ms']:.2f} ms, compute {_num(case.get('compute_ms'))} ms, "
            f"peak {_num(case.get('peak_gib'), '{:.2f}')} GiB, {case['bytes_per_token']:.0f} B/token "
            f"(all collectives {case['dist_bytes_per_token']:.0f}), warm-up {case['warmup_s']:.1f}s, {case['iters']} iters")


def _find(cases, **kw):
    for c in cases:
        if c.get("status") == "ok" and all(c.get(k) == v for k, v in kw.items()):
            return c
    return None


def summarize(cases: list[dict]) -> dict:
    """Chunkwise compute ratio, compute efficiency per mode, all_gather memory vs T, bytes/token."""
    ratios, eff, ag_mem, bytes_tok = [], [], [], {}
    for c in cases:
        if c.get("status") != "ok" or c["cp"] == 1:
            continue
        cp, T, mode = c["cp"], c["t_global"], c["mode"]
        full1 = _find(cases, cp=1, t_global=T, slice_of=None)
        if mode == "chunkwise":
            ref = next((x for x in cases if x.get("status") == "ok" and x["cp"] == 1 and x.get("slice_of")
                        and x["slice_of"]["t_global"] == T and x["slice_of"]["cp"] == cp), None)
            row = {"cp": cp, "t_global": T, "t_local": T // cp, "compute_ratio": None, "compute_ratio_mean": None,
                   "wall_ratio": None, "target": RATIO_TARGET, "meets_target": None}
            if ref is not None:
                row["wall_ratio"] = ref["wall_ms"] / c["wall_ms"]
                if ref.get("compute_ms") and c.get("compute_ms"):
                    row["compute_ratio"] = ref["compute_ms"] / c["compute_ms"]
                    row["compute_ratio_mean"] = ref["compute_ms"] / c["compute_ms_mean"]
                    row["meets_target"] = row["compute_ratio"] >= RATIO_TARGET
            ratios.append(row)
        if full1 is not None:
            e = {"mode": mode, "cp": cp, "t_global": T,
                 "wall_speedup": full1["wall_ms"] / c["wall_ms"],
                 "compute_efficiency": None}
            if full1.get("compute_ms") and c.get("compute_ms"):
                e["compute_efficiency"] = full1["compute_ms"] / (cp * c["compute_ms"])
            eff.append(e)
        if mode == "all_gather":
            ag_mem.append({"cp": cp, "t_global": T, "peak_gib": c.get("peak_gib"),
                           "peak_delta_gib": c.get("peak_delta_gib"),
                           "cp1_peak_gib": full1.get("peak_gib") if full1 else None})
        bytes_tok.setdefault(f"{mode} cp={cp}", {})[str(T)] = {
            "gdn_cp": c["bytes_per_token"], "all_collectives": c["dist_bytes_per_token"]}
    return {"chunkwise_compute_ratio": ratios, "speedup_vs_cp1": eff, "all_gather_peak_memory": ag_mem,
            "bytes_per_token": bytes_tok}


def table_rows(report: dict) -> tuple[list[str], list[list]]:
    ratio = {(r["cp"], r["t_global"]): r for r in report.get("summary", {}).get("chunkwise_compute_ratio", [])}
    headers = ["cp", "T", "mode", "status", "wall ms", "compute ms", "comm/wait ms", "peak GiB", "B/token",
               "B/token all", "cw ratio"]
    rows = []
    for c in report.get("cases", []):
        T = fmt_tokens(c["t_global"]) + (f" (1/{c['slice_of']['cp']} of {fmt_tokens(c['slice_of']['t_global'])})"
                                          if c.get("slice_of") else "")
        if c.get("status") != "ok":
            rows.append([c["cp"], T, c["mode"], c.get("status"), "-", "-", "-", "-", "-", "-", "-"])
            continue
        r = ratio.get((c["cp"], c["t_global"])) if c["mode"] == "chunkwise" else None
        rr = "-"
        if r is not None:
            v = r["compute_ratio"] if r["compute_ratio"] is not None else r["wall_ratio"]
            rr = "-" if v is None else (f"{v:.3f}" + ("" if r["compute_ratio"] is not None else " (wall)"))
        rows.append([c["cp"], T, c["mode"], "ok", c["wall_ms"], _num(c.get("compute_ms")),
                     _num(c.get("comm_wait_ms")), _num(c.get("peak_gib"), "{:.3f}"),
                     f"{c['bytes_per_token']:.0f}", f"{c['dist_bytes_per_token']:.0f}", rr])
    return headers, rows


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description="GDN core forward+backward per CP mode vs tokens and cp: wall, kernel compute, "
                    "comm/wait, peak memory, bytes/token. Writes JSON (after every case) and a PNG.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--quick", action="store_true",
                    help="CPU smoke run: T 256 512, cp 1 2, 2/4 heads of dim 16, reference backend, fp32")
    ap.add_argument("--tokens", type=parse_tokens, nargs="+", default=None,
                    help="T_global values (8K, 32K, 128K accepted); default 8K 32K 128K")
    ap.add_argument("--cp", type=int, nargs="+", default=None, help="cp sizes (cp=1 always runs); default 1 2 4")
    ap.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), choices=DEFAULT_MODES)
    ap.add_argument("--num-sequences", type=int, default=8, help="packed sequences per micro-batch (2 are empty slots)")
    ap.add_argument("--num-k-heads", type=int, default=None, help="default 16 (Qwen3.5-9B GDN, TP=1)")
    ap.add_argument("--num-v-heads", type=int, default=None, help="default 32")
    ap.add_argument("--head-k-dim", type=int, default=None, help="default 128")
    ap.add_argument("--head-v-dim", type=int, default=None, help="default 128")
    ap.add_argument("--conv-width", type=int, default=QWEN35_9B["conv_width"])
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--backend", choices=("auto", "fla", "reference"), default="auto",
                    help="auto: fla on CUDA, reference on the CPU")
    ap.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32", "float64"), default="auto",
                    help="activation dtype; auto: bfloat16 on CUDA, float32 on the CPU (g is always float32)")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations per case (default 5; 2 quick)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed iterations per case")
    ap.add_argument("--case-budget", type=float, default=None,
                    help="stop timing a case after this many seconds of timed iterations (>= 2 iterations); "
                         "default 30 (5 quick)")
    ap.add_argument("--time-limit", type=float, default=420.0,
                    help="seconds after start when no new case starts (results so far are kept)")
    ap.add_argument("--grace", type=float, default=40.0,
                    help="seconds after --time-limit when a running case is abandoned (ranks killed)")
    ap.add_argument("--case-timeout", type=float, default=480.0,
                    help="most seconds one case (or a pool start) may take before its ranks are killed")
    ap.add_argument("--pg-timeout", type=float, default=120.0,
                    help="process-group timeout of the ranks (s): how long ranks wait in a collective for a "
                         "rank that failed before the case errors out")
    ap.add_argument("--no-oom-guard", action="store_true",
                    help="run all_gather even when cp x its cp=1 peak at the same T would not fit the one GPU "
                         "the ranks share (a rank that runs out of memory leaves the others waiting in a "
                         "collective until --pg-timeout)")
    ap.add_argument("--max-respawns", type=int, default=2, help="rank pools respawned after a hang/crash")
    ap.add_argument("--tune-tokens", type=parse_tokens, default=parse_tokens("32K"),
                    help="T of the cp=1 autotune/compile warm-up per head shape (FLA's autotune key has no T)")
    ap.add_argument("--no-tune", action="store_true", help="skip the per-shape autotune warm-up")
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled iteration (no compute time)")
    ap.add_argument("--fast-autotune", action="store_true",
                    help="test knob GDN_CP_TEST_FAST_AUTOTUNE=1: first working Triton config, no tuning "
                         "(kernels compile faster; timings are NOT representative). Default: it is forced off")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/layer_bench.json)")
    ap.add_argument("--plot", type=Path, default=None, help="PNG path (default: --out with .png)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--list", action="store_true", help="print the planned steps and cases, run nothing")
    ap.add_argument("-v", "--verbose", action="store_true")
    return ap


def resolve_args(args) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    if args.quick:
        args.device = "cpu" if args.device == "auto" else args.device
        args.backend = "reference" if args.backend == "auto" else args.backend
        args.tokens = args.tokens or list(QUICK["tokens"])
        args.cp = args.cp or list(QUICK["cp"])
        for k in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "iters", "case_budget"):
            if getattr(args, k) is None:
                setattr(args, k, QUICK[k])
        if args.num_sequences == 8:
            args.num_sequences = QUICK["num_sequences"]
    else:
        args.tokens = args.tokens or list(DEFAULT_TOKENS)
        args.cp = args.cp or list(DEFAULT_CP)
        for k in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"):
            if getattr(args, k) is None:
                setattr(args, k, QWEN35_9B[k])
        args.iters = 5 if args.iters is None else args.iters
        args.case_budget = 30.0 if args.case_budget is None else args.case_budget
    if args.device == "auto":
        args.device = "cuda" if cuda else "cpu"
    if args.device == "cuda" and not cuda:
        raise SystemExit("--device cuda but torch.cuda.is_available() is False")
    if args.backend == "auto":
        args.backend = "fla" if args.device == "cuda" else "reference"
    if args.backend == "fla" and args.device != "cuda":
        raise SystemExit("the fla backend needs --device cuda")
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    args.cp = sorted(set(args.cp) | {1})
    if any(c < 1 for c in args.cp):
        raise SystemExit(f"cp sizes must be >= 1, got {args.cp}")
    args.tokens = sorted(set(args.tokens))
    unit = 2 * max(args.cp)
    bad = [t for t in args.tokens if t % unit]
    if bad:
        raise SystemExit(f"--tokens {bad} are not multiples of 2*max(cp)={unit}")
    if args.num_v_heads % args.num_k_heads:
        raise SystemExit("--num-v-heads must be a multiple of --num-k-heads")
    args.iters = max(1, args.iters)
    args.warmup = max(1, args.warmup)
    args.out = Path(args.out) if args.out else RESULTS_DIR / "layer_bench.json"
    args.plot = Path(args.plot) if args.plot else args.out.with_suffix(".png")
    return args


def _tune_first(values, tune_t):
    """``values`` ascending, ``tune_t`` first when present: FLA's autotune key has no T, so the first
    call of a head shape picks its configs (and FLA_CACHE_RESULTS keeps them): make it ``tune_t``."""
    vals = sorted(set(values))
    return ([tune_t] if tune_t in vals else []) + [v for v in vals if v != tune_t]


def plan_cases(args) -> tuple[list[dict], list[dict]]:
    """(phase-1 steps: tune jobs and cp=1 cases, multi-rank cases), in run order.

    Phase 1 runs in one process: a warm-up of the full shape at ``--tune-tokens``, the cp=1 cases
    (T, and the T/cp slices for chunkwise's ratio), then warm-ups at the exact shapes the ranks
    will meet (the conv's autotune key holds ceil(T/1024), the GDN kernels' the head count and V):
    headwise's heads/cp at each T; chunkwise's halo conv and state-summary scans at each T/cp.
    """
    unit_cp = max(args.cp)
    packings = {T: packed_boundaries(args.num_sequences, T, unit_cp, args.seed) for T in args.tokens}
    dims = dict(num_k_heads=args.num_k_heads, num_v_heads=args.num_v_heads, head_k_dim=args.head_k_dim,
                head_v_dim=args.head_v_dim, conv_width=args.conv_width)
    cp1 = []
    for T in args.tokens:
        cp1.append({"phase": "cp1", "pool_world": 1, "cp": 1, "t_global": T, "t_local": T, "mode": "cp1",
                    "slice_of": None, "cu": packings[T]})
        for cp in args.cp:
            if cp == 1 or "chunkwise" not in args.modes:
                continue
            rank, cu = busiest_slice(packings[T], T, cp)
            cp1.append({"phase": "cp1", "pool_world": 1, "cp": 1, "t_global": T // cp, "t_local": T // cp,
                        "mode": "cp1", "slice_of": {"t_global": T, "cp": cp, "rank": rank}, "cu": cu})
    cp1.sort(key=lambda c: (c["t_global"], c["slice_of"] is not None))

    tune = []
    do_tune = not args.no_tune and (args.backend == "fla" or args.quick)  # quick: exercise the path
    if do_tune:
        unit = 2 * unit_cp
        tune_t = min(args.tune_tokens, max(args.tokens)) if args.quick else args.tune_tokens
        tune_t = max(unit, tune_t - tune_t % unit)
        tune.append({"tune": "all heads", "kind": "core", "dims": dims,
                     "cu": packed_boundaries(args.num_sequences, tune_t, unit_cp, args.seed)})
        multi_cp = [cp for cp in args.cp if cp > 1]
        if "chunkwise" in args.modes and multi_cp:
            locals_ = _tune_first([T // cp for T in args.tokens for cp in multi_cp], tune_t)
            for n in locals_:
                tune.append({"tune": f"chunkwise halo conv + state scans, {fmt_tokens(n)} rows", "kind": "summary",
                             "dims": dims, "cu": [0, n]})
        if "headwise" in args.modes:
            for cp in multi_cp:
                if args.num_k_heads % cp or args.num_v_heads % cp:
                    continue
                hdims = {**dims, "num_k_heads": args.num_k_heads // cp, "num_v_heads": args.num_v_heads // cp}
                for T in _tune_first(args.tokens, tune_t):
                    tune.append({"tune": f"headwise cp={cp} heads, T={fmt_tokens(T)}", "kind": "core",
                                 "dims": hdims, "cu": packings[T]})
    steps = tune[:1] + cp1 + tune[1:]
    multi = []
    world = max(args.cp)
    for T in args.tokens:
        for cp in args.cp:
            if cp == 1:
                continue
            for mode in args.modes:
                multi.append({"phase": "multi", "pool_world": world, "cp": cp, "t_global": T, "t_local": T // cp,
                              "mode": mode, "slice_of": None, "cu": packings[T]})
    return steps, multi


def main(argv=None) -> int:
    args = resolve_args(build_parser().parse_args(argv))
    setup_logging(args.verbose)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, _on_signal)
    steps, multi = plan_cases(args)
    cp1 = [st for st in steps if "tune" not in st]
    if args.list:
        print(f"{args.device}/{args.backend}/{args.dtype}, shape Hk={args.num_k_heads} Hv={args.num_v_heads} "
              f"Dk={args.head_k_dim} Dv={args.head_v_dim} W={args.conv_width}; phase 1 (one process):")
        for st in steps:
            if "tune" in st:
                print(f"  warm-up   {st['tune']}")
            else:
                of = f" (1/{st['slice_of']['cp']} of T={fmt_tokens(st['slice_of']['t_global'])})" if st["slice_of"] else ""
                print(f"  case      cp=1 T={fmt_tokens(st['t_global'])}{of}")
        print(f"phase 2 (pool of {max(args.cp)} ranks):")
        for c in multi:
            print(f"  case      cp={c['cp']} T={fmt_tokens(c['t_global'])} {c['mode']}")
        return 0
    sweep = Sweep(args)
    from gdn_cp.ops.fla import fla_version

    sweep.report = {
        "benchmark": "layer",
        "date": now_iso(),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "machine": {**machine_info(), "nvidia_smi": _gpu_info_smi() if args.device == "cuda" else None},
        "versions": versions({"fla": fla_version(), "triton": _pkg_version("triton"),
                              "torch_cuda": torch.version.cuda}),
        "config": {
            "tokens": args.tokens, "cp": args.cp, "modes": args.modes, "num_sequences": args.num_sequences,
            "shape": dict(num_k_heads=args.num_k_heads, num_v_heads=args.num_v_heads, head_k_dim=args.head_k_dim,
                          head_v_dim=args.head_v_dim, conv_width=args.conv_width),
            "device": args.device, "backend": args.backend, "dtype": args.dtype, "iters": args.iters,
            "warmup": args.warmup, "case_budget_s": args.case_budget, "time_limit_s": args.time_limit,
            "grace_s": args.grace, "tune_tokens": None if args.no_tune else args.tune_tokens,
            "profile": not args.no_profile, "fast_autotune": args.fast_autotune, "seed": args.seed,
            "quick": args.quick, "padding_unit": 2 * max(args.cp),
            "packings": {str(T): packed_boundaries(args.num_sequences, T, max(args.cp), args.seed)
                         for T in args.tokens},
        },
        "notes": NOTES,
    }
    logger.info("layer bench: T %s, cp %s, modes %s, %s/%s/%s, out %s", [fmt_tokens(t) for t in args.tokens],
                args.cp, args.modes, args.device, args.backend, args.dtype, args.out)
    stopped = None
    try:
        sweep.write()
        for step in steps:
            if "tune" in step:
                sweep.run_tune(step["tune"], step["dims"], step["cu"], step["kind"])
            else:
                sweep.run_case(step)
        sweep.close_pool()
        for case in multi:
            sweep.run_case(case)
    except _Stop as err:
        stopped = str(err)
        logger.warning("stopped by %s: writing what was collected", stopped)
    finally:
        for s in (signal.SIGTERM, signal.SIGINT):  # finish writing whatever comes
            signal.signal(s, signal.SIG_IGN)
        sweep.close_pool(kill=stopped is not None)
        done = {id(c) for c in sweep.cases}
        for case in cp1 + multi:  # never started
            if id(case) not in done:
                case.update(status="skipped", error=f"not started ({stopped or 'sweep ended'})")
                sweep.cases.append(case)
        sweep.write(finished=stopped is None, stopped=stopped)
    headers, rows = table_rows(sweep.report)
    print(format_table(headers, rows), flush=True)
    ratios = sweep.report["summary"]["chunkwise_compute_ratio"]
    for r in ratios:
        if r["compute_ratio"] is not None:
            print(f"chunkwise cp={r['cp']} T={fmt_tokens(r['t_global'])}: compute(CP=1, T/{r['cp']}) / "
                  f"compute(CP={r['cp']}, T) = {r['compute_ratio']:.3f} (target >= {RATIO_TARGET}: "
                  f"{'met' if r['meets_target'] else 'NOT met'})", flush=True)
    legend = ("B/token: bytes handed to gdn-cp's collectives per fwd+bwd / T_local (FLA's own halo/state "
              "exchange, chunkwise with FLA's cp_context on NCCL, is not in it); 'B/token all': every "
              "torch.distributed collective. 'cw ratio': compute(CP=1,T/N)/compute(CP=N,T) (target >= 0.9).")
    print(legend, flush=True)
    md = args.out.with_suffix(".md")
    try:
        md.write_text(format_table(headers, rows, markdown=True) + "\n\n" + legend + "\n")
    except OSError as err:
        logger.warning("markdown table not written: %s", err)
    print(f"JSON: {args.out} (table: {md})", flush=True)
    if not args.no_plot:
        try:
            from plot_layer import plot_report

            if plot_report(sweep.report, args.plot):
                print(f"plot: {args.plot}", flush=True)
        except Exception as err:  # noqa: BLE001 - a plot must never lose the results
            logger.warning("plot failed: %s", err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
