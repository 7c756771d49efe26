"""The main job: a real context-parallel run of the GDN core on whatever is here.

It spawns ``cp`` ranks (gloo on CPU by default; NCCL with one rank per GPU when there
are enough GPUs), and on each:

1. builds the routes for a realistic packed micro-batch and runs zigzag -> contiguous ->
   zigzag, checking the round trip is bit-exact;
2. runs every mode's forward + backward on the same packed batch and compares output,
   input gradients and conv-weight gradients with CP=1 on the same inputs.

Rank 0 prints one table; the process exits non-zero if any check fails.
"""

from __future__ import annotations

import datetime
import logging
import random
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .comm import all_gather_rows, route_all_to_all
from .layout import CONTIGUOUS, ZIGZAG, RouteCache, build_natural_order
from .modes import GDNShape, gdn_core, local_core
from .modes.spec import MODE_NAMES
from .ops import get_backend

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobConfig:
    cp_sizes: tuple[int, ...] = (2, 4)
    modes: tuple[str, ...] = MODE_NAMES
    num_sequences: int = 37
    tokens_per_rank: int = 1024
    shape: GDNShape = GDNShape(num_k_heads=4, num_v_heads=8, head_k_dim=32, head_v_dim=32)
    conv_width: int = 4
    dtype: str = "float32"
    device: str = "cpu"
    backend: str = "reference"
    dist_backend: str = "gloo"
    seed: int = 0


def packed_boundaries(num_sequences: int, t_global: int, cp: int, seed: int) -> list[int]:
    """Mixed lengths (short and long), each a multiple of 2*cp, summing to ``t_global``;
    a couple of empty padding slots are included."""
    rng = random.Random(seed)
    unit = 2 * cp
    units = t_global // unit
    weights = [rng.choice([1, 1, 2, 3, 8, 20]) * rng.random() + 0.05 for _ in range(num_sequences)]
    lengths = [max(0, int(units * w / sum(weights))) for w in weights]
    for i in rng.sample(range(num_sequences), k=min(2, num_sequences)):
        lengths[i] = 0  # empty padding slots
    lengths[max(range(num_sequences), key=lambda i: lengths[i])] += units - sum(lengths)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n * unit)
    return cu


def _inputs(cfg: JobConfig, t_global: int, device):
    gen = torch.Generator().manual_seed(cfg.seed)
    dtype = getattr(torch, cfg.dtype)
    s = cfg.shape

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=gen) * scale).to(dtype).to(device)

    return {
        "qkv": randn(t_global, s.conv_dim),
        "g": (-F.softplus(torch.randn(t_global, s.num_v_heads, generator=gen)) * 0.3)
        .to(torch.float64 if dtype == torch.float64 else torch.float32)
        .to(device),
        "beta": torch.sigmoid(torch.randn(t_global, s.num_v_heads, generator=gen)).to(dtype).to(device),
        "conv_weight": randn(s.conv_dim, cfg.conv_width, scale=0.5),
        "conv_bias": randn(s.conv_dim, scale=0.1),
        "dout": randn(t_global, s.num_v_heads, s.head_v_dim),
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _rank_job(rank: int, cp: int, cfg: JobConfig, port: int, results) -> None:
    torch.set_num_threads(1)
    device = torch.device(cfg.device)
    if device.type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(
        cfg.dist_backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cp,
        timeout=datetime.timedelta(seconds=300),
    )
    group = dist.group.WORLD
    try:
        report = {"rank": rank}
        t_global = cfg.tokens_per_rank * cp
        cu = packed_boundaries(cfg.num_sequences, t_global, cp, cfg.seed)
        cache = RouteCache()
        cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
        t0 = time.perf_counter()
        plan = cache.plan(cu_t, cp, rank)
        z2c, c2z = plan.route(ZIGZAG, CONTIGUOUS), plan.route(CONTIGUOUS, ZIGZAG)
        report["route_build_ms"] = (time.perf_counter() - t0) * 1e3
        report["route_summary"] = z2c.summary() if rank == 0 else ""
        report["cu"] = cu
        own = build_natural_order(cu, cp, rank).own_rows.to(device)
        rows = own.to(torch.float64).unsqueeze(1)
        back = route_all_to_all(route_all_to_all(rows, z2c, c2z, group), c2z, z2c, group)
        report["round_trip_exact"] = bool(torch.equal(back, rows))

        backend = get_backend(cfg.backend)
        data = _inputs(cfg, t_global, device)
        names = ("qkv", "g", "beta", "conv_weight", "conv_bias")
        full = {k: data[k].clone().requires_grad_(True) for k in names}
        _sync(device)
        t0 = time.perf_counter()
        o_ref = local_core(
            full["qkv"], full["g"], full["beta"], full["conv_weight"], full["conv_bias"],
            shape=cfg.shape, cu_seqlens=cu, backend=backend,
        )
        o_ref.backward(data["dout"])
        _sync(device)
        report["cp1_s"] = time.perf_counter() - t0
        per_mode = {}
        for mode in cfg.modes:
            leaves = {k: data[k][own].clone().requires_grad_(True) for k in ("qkv", "g", "beta")}
            params = {k: data[k].clone().requires_grad_(True) for k in ("conv_weight", "conv_bias")}
            dist.barrier(group)
            _sync(device)
            t0 = time.perf_counter()
            try:
                o = gdn_core(
                    leaves["qkv"], leaves["g"], leaves["beta"], params["conv_weight"], params["conv_bias"],
                    shape=cfg.shape, mode=mode, plan=plan, group=group, backend=backend,
                )
                o.backward(data["dout"][own])
            except ValueError as err:  # e.g. headwise with heads not divisible by cp
                per_mode[mode] = {"error": str(err)}
                continue
            _sync(device)
            elapsed = time.perf_counter() - t0
            errs = {"out": _rel(o.detach(), o_ref.detach()[own])}
            for k in ("qkv", "g", "beta"):
                errs[k] = _rel(leaves[k].grad, full[k].grad[own])
            for k in ("conv_weight", "conv_bias"):
                total = all_gather_rows(params[k].grad.reshape(1, -1), group).sum(0)  # sum over CP ranks
                errs[k] = _rel(total, full[k].grad.reshape(-1))
            per_mode[mode] = {"errors": errs, "seconds": elapsed}
        report["modes"] = per_mode
        report["plan_hits_after_first"] = cache.plan(cu_t, cp, rank) is plan
        results.put(report)
    except BaseException as err:  # report, don't hang the parent
        import traceback

        results.put({"rank": rank, "failure": f"{type(err).__name__}: {err}\n{traceback.format_exc()}"})
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(cfg: JobConfig, tolerance: float | None = None, echo=print) -> bool:
    """Run the job for every cp size; print a table; return True when every check passed."""
    import torch.multiprocessing as mp

    tol = tolerance if tolerance is not None else default_tolerance(cfg)
    ok = True
    ctx = mp.get_context("spawn")
    for cp in cfg.cp_sizes:
        echo(f"== cp={cp}: spawning {cp} ranks ({cfg.dist_backend}, {cfg.device}, backend={cfg.backend}, {cfg.dtype})")
        results = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_rank_job, args=(r, cp, cfg, port, results)) for r in range(cp)]
        for p in procs:
            p.start()
        reports = [results.get(timeout=900) for _ in range(cp)]
        for p in procs:
            p.join(timeout=60)
        reports.sort(key=lambda r: r["rank"])
        failures = [r for r in reports if "failure" in r]
        if failures:
            echo(f"rank {failures[0]['rank']} failed:\n{failures[0]['failure']}")
            ok = False
            continue
        r0 = reports[0]
        lengths = [b - a for a, b in zip(r0["cu"][:-1], r0["cu"][1:])]
        echo(
            f"packed micro-batch: {len(lengths)} sequences (lengths {min(lengths)}..{max(lengths)}, "
            f"{lengths.count(0)} empty slots), T_global={r0['cu'][-1]}"
        )
        echo("\n".join(r0["route_summary"].splitlines()[:4]))
        echo(f"  ... {len(r0['route_summary'].splitlines()) - 4} send/recv pieces; build {r0['route_build_ms']:.2f} ms")
        exact = all(r["round_trip_exact"] for r in reports)
        hits = all(r["plan_hits_after_first"] for r in reports)
        echo(f"zigzag -> contiguous -> zigzag round trip bit-exact on all ranks: {exact}; cached plan reused: {hits}")
        ok &= exact and hits
        echo(f"CP=1 reference forward+backward: {r0['cp1_s']:.3f} s")
        echo(f"{'mode':<11} {'out':>9} {'d_qkv':>9} {'d_g':>9} {'d_beta':>9} {'d_convw':>9} {'d_convb':>9} {'time s':>8}  ok")
        for mode in cfg.modes:
            if "error" in r0["modes"][mode]:
                echo(f"{mode:<11} refused: {r0['modes'][mode]['error']}")
                continue
            errs = {k: max(r["modes"][mode]["errors"][k] for r in reports) for k in r0["modes"][mode]["errors"]}
            secs = max(r["modes"][mode]["seconds"] for r in reports)
            good = all(v <= tol for v in errs.values())
            ok &= good
            cols = " ".join(f"{errs[k]:>9.1e}" for k in ("out", "qkv", "g", "beta", "conv_weight", "conv_bias"))
            echo(f"{mode:<11} {cols} {secs:>8.3f}  {'yes' if good else 'NO'}")
    echo(f"max relative error allowed: {tol:g} ({cfg.dtype}); result: {'PASS' if ok else 'FAIL'}")
    return ok


def auto_config(**overrides) -> JobConfig:
    """CPU + gloo + reference by default. With CUDA: the GPU, FLA when installed, NCCL when
    there is a GPU per rank (else gloo ranks sharing the GPU)."""
    cfg = JobConfig(**overrides)
    if "device" in overrides or not torch.cuda.is_available():
        return cfg
    from .ops.fla import fla_available

    choice = {"device": "cuda"}
    if "backend" not in overrides:
        choice["backend"] = "fla" if fla_available() else "reference"
    if "dist_backend" not in overrides:
        choice["dist_backend"] = "nccl" if torch.cuda.device_count() >= max(cfg.cp_sizes) else "gloo"
    logger.info("CUDA found (%d GPU(s)): %s", torch.cuda.device_count(), choice)
    return JobConfig(**{**cfg.__dict__, **choice})


def default_tolerance(cfg: JobConfig) -> float:
    """Max relative error allowed against CP=1 on the same backend and dtype.

    CP cuts sequences at other places than CP=1, so the kernels' chunking (and rounding)
    differs: fp64 agrees to ~1e-12, fp32 to ~1e-6 on the reference backend; FLA's fp32 path
    uses TF32 dots and bf16 rounds at 8 bits.
    """
    if cfg.dtype == "float64":
        return 1e-10
    if cfg.dtype == "bfloat16":
        return 5e-2
    return 1e-4 if cfg.backend == "reference" else 1e-2
