"""How the benchmarks measure: one place for timing, statistics, profile splits and token counts.

- :func:`timed_steps`: ``warmup`` untimed then ``iters`` timed calls of a step (CUDA events on a GPU, ``perf_counter``
  on the CPU), each after a caller's ``before()`` (a device synchronize and a barrier: ranks start together);
- :func:`quantile` / :func:`iteration_stats`: median and p10 / p90 of the per-iteration maximum over ranks;
- :func:`spans_from_trace` / :func:`split_busy_time`: a profiled iteration's GPU time split into compute, NCCL
  (communication or waiting), memcpy and idle, summing to the CUDA-event wall; :func:`idle_causes`: the idle's;
- :func:`parse_tokens` / :func:`fmt_tokens`: ``32K`` <-> 32768.

Torch is imported where a GPU is timed, not with this module. DESIGN's rules for a number worth printing apply:
warm-up first (compile and autotune in a pass of their own), >= 20 timed iterations, the maximum over ranks, never
time subtracted across iterations."""

from __future__ import annotations

import math
import time
from typing import Callable, Optional, Sequence

__all__ = ["CATEGORIES", "GIB", "fmt_tokens", "idle_causes", "iteration_stats", "parse_tokens", "quantile",
           "spans_from_trace", "split_busy_time", "timed_steps"]

GIB = float(2**30)


def timed_steps(step: Callable[[], object], warmup: int, iters: int, device,
                before: Optional[Callable[[], None]] = None) -> list[float]:
    """ms of each of ``iters`` calls of ``step`` after ``warmup`` untimed ones; ``before()`` runs ahead of every
    call, untimed (e.g. a device synchronize and a barrier). ``device``: a ``torch.device``."""
    import torch

    before = before or (lambda: None)
    for _ in range(warmup):
        before()
        step()
    times = []
    for _ in range(iters):
        before()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default), q in [0, 1]."""
    if not values:
        raise ValueError("quantile of no values")
    s = sorted(values)
    lo = math.floor(pos := q * (len(s) - 1))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def iteration_stats(per_rank_ms: Sequence[Sequence[float]]) -> dict:
    """Statistics of the per-iteration maximum over ranks. ``per_rank_ms[r][i]``: rank r's time of iteration i
    (every rank ran the same iterations, separated by a barrier). An iteration takes as long as its slowest rank."""
    n = {len(t) for t in per_rank_ms}
    if len(n) != 1 or 0 in n:
        raise ValueError(f"every rank must report the same non-zero number of iterations, got {sorted(n)}")
    iter_max = [max(ts) for ts in zip(*per_rank_ms)]
    return {"median_ms": quantile(iter_max, 0.5), "p10_ms": quantile(iter_max, 0.1), "p90_ms": quantile(iter_max, 0.9),
            "iters": len(iter_max), "iter_max_ms": iter_max, "per_rank_median_ms": [quantile(t, 0.5) for t in per_rank_ms]}


def parse_tokens(text: str) -> int:
    """'32K' -> 32768, '1M' -> 1048576, '512' -> 512."""
    t = str(text).strip().lower()
    mult = {"k": 1024, "m": 1024 * 1024}.get(t[-1:], 1)
    t = t[:-1] if mult > 1 else t
    try:
        value = int(float(t) * mult)
    except ValueError:
        raise ValueError(f"tokens must look like 8K, 32K, 128K or 4096, got {text!r}") from None
    if value <= 0:
        raise ValueError(f"tokens must be positive, got {text!r}")
    return value


def fmt_tokens(t: int) -> str:
    return f"{t // 1048576}M" if t % 1048576 == 0 else f"{t // 1024}K" if t % 1024 == 0 else str(t)


# ---- profile split ----

CATEGORIES = ("compute", "nccl", "memcpy")  # attribution priority, highest first


def split_busy_time(spans: dict[str, Sequence[tuple[float, float]]], wall: float) -> dict:
    """Split ``wall`` (the CUDA-event time of the same profiled iterations) into exclusive parts.

    ``spans[category]``: ``(start, end)`` of every GPU activity of that category ("compute" kernels, "nccl"
    kernels, "memcpy" = memcpy/memset), in one clock. Each instant is given to the highest-priority category busy
    then: compute, else nccl (communication or waiting for a slower rank: NCCL kernels spin while they wait), else
    memcpy; idle = wall minus the union of all busy intervals. So ``compute + nccl + memcpy + idle == wall`` (idle
    clamped at 0 when the trace's busy time exceeds the event wall by clock skew). Also returns the plain
    (overlapping) sums per category as ``*_total``."""
    unknown = set(spans) - set(CATEGORIES)
    if unknown:
        raise ValueError(f"span categories must be among {CATEGORIES}, got {sorted(unknown)}")
    # one sweep over every start (+1) and end (-1): the stretch up to the next one goes to the first
    # category (in priority order) with a span open over it
    edges = sorted((t, step, CATEGORIES.index(cat)) for cat, ss in spans.items() for a, b in ss if b > a
                   for t, step in ((a, 1), (b, -1)))
    out = {cat: 0.0 for cat in CATEGORIES}
    open_spans, last = [0] * len(CATEGORIES), None
    for t, step, i in edges:
        owner = next((c for c, n in zip(CATEGORIES, open_spans) if n), None)
        if owner is not None:
            out[owner] += t - last
        open_spans[i] += step
        last = t
    busy = sum(out.values())
    out.update({f"{cat}_total": sum(b - a for a, b in spans.get(cat, ())) for cat in CATEGORIES})
    return {**out, "busy": busy, "idle": max(0.0, wall - busy), "wall": wall}


def _category(event: dict) -> str | None:
    cat = str(event.get("cat", "")).lower()
    name = str(event.get("name", "")).lower()
    if cat in ("gpu_memcpy", "gpu_memset") or name.startswith(("memcpy", "memset")):
        return "memcpy"
    if cat == "kernel":
        return "nccl" if "nccl" in name else "compute"
    return None


def spans_from_trace(trace) -> tuple[dict, dict]:
    """GPU activity of a chrome trace by category (us), and kernel time by name."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    spans: dict[str, list] = {c: [] for c in CATEGORIES}
    by_name: dict[str, float] = {}
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        cat = _category(e)
        if cat is None:
            continue
        ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
        spans[cat].append((ts, ts + dur))
        key = f"{cat}: {str(e.get('name'))[:NAME_CHARS]}"
        by_name[key] = by_name.get(key, 0.0) + dur
    return spans, by_name


def idle_causes(trace, iters: int, top: int = 6) -> dict:
    """The idle time of ``iters`` timed iterations by cause, ms per iteration. A gap in the GPU's work waited on the
    host where the call that launched the work after it (a CUDA runtime / driver event, linked by ``correlation``)
    came after the GPU had drained: on a synchronize whose call spans any of the gap (``sync``) or on the host's own
    work (``launch``, by the work launched late: ``late``); else on the GPU (``device``; ``unlinked``: no launch
    call). Gaps with the timing's own ``cudaEventSynchronize`` in them (between iterations) are left out."""
    events = [e for e in (trace.get("traceEvents", []) if isinstance(trace, dict) else trace)
              if isinstance(e, dict) and e.get("ph") == "X"]
    calls = [e for e in events if str(e.get("cat", "")).lower() in ("cuda_runtime", "cuda_driver")]
    launched = {c["args"]["correlation"]: float(c["ts"]) for c in calls if "correlation" in c.get("args", {})}
    syncs = [(float(c["ts"]), float(c["ts"]) + float(c.get("dur", 0.0)), "eventsync" in str(c.get("name")).lower())
             for c in calls if "synchronize" in str(c.get("name")).lower()]
    out, late, busy_end = dict.fromkeys(("sync", "launch", "device", "unlinked"), 0.0), {}, None
    for e in sorted((e for e in events if _category(e)), key=lambda e: float(e["ts"])):
        ts, at = float(e["ts"]), launched.get(e.get("args", {}).get("correlation"))
        then = ts if at is None else at  # the work's launch call, or the work
        between = [last for t0, t1, last in syncs if busy_end is not None and t0 <= then and t1 >= busy_end]
        if busy_end is not None and ts > busy_end and not any(between):
            cause = "unlinked" if at is None else "device" if at < busy_end else "sync" if between else "launch"
            out[cause] += ts - busy_end
            if cause == "launch":
                name = f"{_category(e)}: {str(e.get('name'))[:NAME_CHARS]}"
                late[name] = late.get(name, 0.0) + ts - busy_end
        busy_end = max(busy_end or 0.0, ts + float(e.get("dur", 0.0)))
    return {**{k: v / 1e3 / iters for k, v in out.items()},
            "late": [[k, v / 1e3 / iters] for k, v in sorted(late.items(), key=lambda kv: -kv[1])[:top]]}


NAME_CHARS = 240
"""A kernel's name in a profile's keys: long enough for the functor of torch's templated kernels (``elementwise_kernel<
... direct_copy_kernel_cuda ...>``, a copy, against an add or a fill), which the first 90 characters hide."""
CLASS_CHARS = 90
"""The part of a name :func:`kernel_class` matches (as when keys held 90 characters: the classes of earlier runs)."""

# Kernel classes of a layer's profile, in the order a kernel is matched (first match wins), so that a row
# says where its time goes against the floor (the GEMMs): what each class's names look like in a CUDA trace
# of megatron-core's GatedDeltaNet on FLA / FlashQLA / TransformerEngine.
KERNEL_CLASSES = (
    ("communication", ("nccl",)),
    ("gemm", ("nvjet", "gemm", "cutlass", "xmma", "cublas", "sm90_", "sm100_")),
    ("conv", ("causal_conv", "conv1d")),
    ("gdn", ("chunk_", "gdr", "kkt", "solve_tril", "_inverse_kernel", "recompute_w_u", "fused_recurrent", "cumsum",
             "prepare_h", "wy_", "l2norm", "group_reduce", "main_kernel", "tilelang", "delta_rule")),
    ("norm", ("rms", "layer_norm", "layernorm", "_norm")),
    ("gdn-cp glue", ("gdn_cp_glue",)),  # gdn-cp's Triton kernels: conv + SiLU + split + l2 norm, gates
    ("compiled glue", ("triton_",)),  # torch.compile's kernels: gdn-cp's fused conv / split / l2 norm / gates
    ("elementwise + copies", ()),  # everything else: elementwise, copy, cat, fill, reduce
)
# (``_inverse_kernel``: FLA's solve_tril merges, ``merge_16x16_to_64x64_inverse_kernel``; rows before run 2026-12-07a
# count them, 0.32 ms a 16K-row slice, under "elementwise + copies")
CLASS_NAMES = tuple(c for c, _ in KERNEL_CLASSES) + ("memcpy", "idle")


def kernel_class(key: str) -> str:
    """The class of one ``spans_from_trace`` key (``"compute: <kernel name>"``, ``"nccl: ..."``, ``"memcpy: ..."``)."""
    cat, _, name = key.partition(": ")
    if cat == "memcpy":
        return "memcpy"
    name = name[:CLASS_CHARS].lower()
    for cls, marks in KERNEL_CLASSES:
        if not marks or any(m in name for m in marks):
            return cls
    return KERNEL_CLASSES[-1][0]


def kernel_classes(by_name: dict, idle_us: float, iters: int) -> dict:
    """ms per iteration by :data:`CLASS_NAMES` class (kernel durations summed by class; ``idle`` from
    the profile split), every class present (0.0 where none ran)."""
    out = {c: 0.0 for c in CLASS_NAMES}
    for key, us in by_name.items():
        out[kernel_class(key)] += us / 1e3 / iters
    out["idle"] = idle_us / 1e3 / iters
    return out

