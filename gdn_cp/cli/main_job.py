"""The main job (``gdn-cp run``): a real context-parallel run of the GDN core, checked against CP=1.

For each CP size it spawns ``cp`` ranks (:func:`gdn_cp.cli.launch.run_ranks`: CPU gloo by default;
NCCL with one rank per GPU when there are enough GPUs, gloo ranks sharing one GPU otherwise), and
on every rank:

1. builds the routes of a realistic packed micro-batch and runs zigzag -> contiguous -> zigzag,
   checking that the round trip is bit-exact and that the cached plan is reused;
2. runs every mode's core forward + backward on that micro-batch and compares the output, the
   input gradients and the conv gradients (summed over ranks) with CP=1 on the same inputs.

Each line is printed as soon as every rank is done with its part (the ranks send each part as they
finish it: the routes, the CP=1 reference, then one line per mode), and on a terminal a progress
bar counts the steps (:mod:`gdn_cp.cli.progress`). Modes that cannot run at a CP size (headwise when
the heads do not divide cp) are not started: they are listed as skipped, with the reason; a mode
asked for by name (``--modes``) that cannot run at one of the CP sizes is refused by
:func:`check_job`, before anything is spawned. The job passes when every check of everything that
ran passed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..checks import as_int
from ..comm import nccl_available
from ..layout.packings import packed_boundaries
from ..modes import GDNShape
from ..modes.inputs import core_inputs, core_leaves
from ..modes.spec import MODE_NAMES, get_mode, head_problem
from ..ops.accuracy import cp_vs_cp1_tolerance, max_rel
from ..ops.registry import BACKEND_NAMES, ORACLE, BACKENDS, backend_spec, choose_backend_name, get_backend
from .launch import RankError, run_ranks
from .output import count

__all__ = ["DTYPES", "JobConfig", "JobResult", "auto_config", "check_job", "estimate_rank_bytes", "job_steps", "run_job"]

logger = logging.getLogger(__name__)

DTYPES = ("float32", "float64", "bfloat16")
COLUMNS = ("out", "qkv", "g", "beta", "conv_weight", "conv_bias")
HEADERS = ("out", "d_qkv", "d_g", "d_beta", "d_convw", "d_convb")


@dataclass(frozen=True)
class JobConfig:
    """What ``gdn-cp run`` runs. ``modes=None``: every mode (those that cannot run are skipped)."""

    cp_sizes: tuple[int, ...] = (2, 4)
    modes: Optional[tuple[str, ...]] = None
    num_sequences: int = 37
    tokens_per_rank: int = 1024
    shape: GDNShape = GDNShape(num_k_heads=4, num_v_heads=8, head_k_dim=32, head_v_dim=32)
    conv_width: int = 4
    dtype: str = "float32"
    device: str = "cpu"
    backend: str = "reference"
    dist_backend: str = "gloo"
    seed: int = 0

    @property
    def modes_to_run(self) -> tuple[str, ...]:
        return MODE_NAMES if self.modes is None else self.modes


def auto_config(**overrides) -> JobConfig:
    """CPU + gloo + reference by default. With CUDA (and no ``device`` given): the GPU, the backend
    the registry prefers there (FLA when it imports), NCCL when there is a GPU per rank of the
    largest CP size (else gloo ranks sharing one)."""
    cfg = JobConfig(**overrides)
    if "device" in overrides or not torch.cuda.is_available():
        return cfg
    choice = {"device": "cuda"}
    if "backend" not in overrides:
        choice["backend"] = choose_backend_name("cuda", head_dims=(cfg.shape.head_k_dim, cfg.shape.head_v_dim),
                                                dtype=cfg.dtype)
    if "dist_backend" not in overrides:
        enough = torch.cuda.device_count() >= max(cfg.cp_sizes, default=1)
        choice["dist_backend"] = "nccl" if enough and nccl_available() else "gloo"
    logger.info("CUDA found (%d GPU(s)): %s", torch.cuda.device_count(), choice)
    return JobConfig(**{**cfg.__dict__, **choice})


def check_job(cfg: JobConfig) -> None:
    """ValueError naming the flag, the value and the fix when the job cannot run here; raised
    before any rank is spawned."""
    if not cfg.cp_sizes or any(as_int(c) is None or c < 1 for c in cfg.cp_sizes):
        raise ValueError(f"--cp {cfg.cp_sizes}: every CP size must be an integer >= 1, e.g. --cp 2,4")
    if cfg.modes is not None:
        unknown = [m for m in cfg.modes if m not in MODE_NAMES]
        if unknown or not cfg.modes:
            raise ValueError(f"--modes {','.join(cfg.modes)}: unknown {unknown}; use a comma-separated list "
                             f"of {', '.join(MODE_NAMES)}")
    if cfg.num_sequences < 1:
        raise ValueError(f"--sequences {cfg.num_sequences}: a micro-batch needs at least 1 sequence")
    _check_named_modes(cfg)
    if cfg.tokens_per_rank < 2 or cfg.tokens_per_rank % 2:
        raise ValueError(f"--tokens-per-rank {cfg.tokens_per_rank}: must be even and >= 2 (every sequence "
                         "length is a multiple of 2*cp, so T_global = tokens_per_rank * cp must be too)")
    if cfg.dtype not in DTYPES:
        raise ValueError(f"--dtype {cfg.dtype}: use one of {', '.join(DTYPES)}")
    if cfg.device not in ("cpu", "cuda"):
        raise ValueError(f"--device {cfg.device}: use cpu or cuda")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda: torch {torch.__version__} sees no CUDA GPU (a CPU build of torch, or no "
                         "GPU visible); use --device cpu")
    if cfg.backend not in BACKENDS:
        raise ValueError(f"--backend {cfg.backend}: use one of {', '.join(BACKEND_NAMES)}")
    backend = backend_spec(cfg.backend)
    if cfg.device not in backend.devices:
        raise ValueError(f"--backend {cfg.backend} needs --device {' or '.join(backend.devices)} "
                         f"({backend.devices_why}); use --backend {ORACLE} on the {cfg.device.upper()}")
    problem = backend.problem()
    if problem is not None:
        raise ValueError(f"--backend {cfg.backend}: {problem}; use --backend {ORACLE}")
    if cfg.dist_backend not in ("gloo", "nccl"):
        raise ValueError(f"--dist-backend {cfg.dist_backend}: use gloo or nccl")
    if cfg.dist_backend == "nccl":
        if cfg.device != "cuda":
            raise ValueError("--dist-backend nccl needs --device cuda; use --dist-backend gloo on the CPU")
        if not nccl_available():
            raise ValueError(f"--dist-backend nccl: this torch {torch.__version__} has no NCCL; "
                             "use --dist-backend gloo")
        gpus, need = torch.cuda.device_count(), max(cfg.cp_sizes)
        if gpus < need:
            raise ValueError(f"--dist-backend nccl needs one GPU per rank: --cp {need} needs {need} GPUs, "
                             f"{gpus} visible; use --dist-backend gloo (ranks share a GPU) or a smaller --cp")
    _check_what_every_rank_checks(cfg)
    _check_memory(cfg)


# Host memory of a CPU run, per rank: every rank also computes the CP=1 reference on all T_global rows,
# so it grows with T_global = tokens_per_rank * cp, not with the rank's share. Calibrated on a 2-core
# AMD EPYC VM (torch 2.13.0+cpu, peak RSS of the largest rank): 560 MiB at T_global 2048 and 1125 MiB at
# 8192 (4,8 heads of dim 32, float32), 2.70 GiB at 32768 (every mode); per token 94 KB there, 155-178 KB
# with twice the head dim, twice the heads or float64. The estimate is above each of these.
_RANK_BASE_BYTES = 400 << 20
_PER_TOKEN_FIXED_BYTES = 16 << 10
_PER_TOKEN_ROW_FACTOR = 32  # bytes per byte of a token's q|k|v and output row


def estimate_rank_bytes(cfg: JobConfig, cp: int) -> int:
    """Estimated peak host memory of one CPU rank at CP size ``cp`` (see the calibration above)."""
    shape = cfg.shape
    row = shape.num_k_heads * shape.head_k_dim * 2 + shape.num_v_heads * shape.head_v_dim * 2  # q, k, v, o
    element = max(torch.finfo(getattr(torch, cfg.dtype)).bits // 8, 4)  # the reference backend computes in fp32
    per_token = _PER_TOKEN_FIXED_BYTES + _PER_TOKEN_ROW_FACTOR * row * element
    return _RANK_BASE_BYTES + cfg.tokens_per_rank * cp * per_token


def _available_memory() -> Optional[int]:
    """MemAvailable of /proc/meminfo in bytes (None where there is none: the check is then skipped)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _largest_fit(cfg: JobConfig, cp: int, available: int) -> int:
    """The largest even ``tokens_per_rank`` whose ``cp`` ranks fit in ``available`` bytes (estimate)."""
    per_token = (estimate_rank_bytes(cfg, cp) - _RANK_BASE_BYTES) / (cfg.tokens_per_rank * cp)
    return int((available / cp - _RANK_BASE_BYTES) / (per_token * cp)) // 2 * 2


def _check_memory(cfg: JobConfig) -> None:
    """Refuse, before spawning, a CPU run whose ranks would not fit in this machine's available memory
    (a run of 1M tokens per rank was OOM-killed after 54 s on a 23 GB machine); the message has the
    estimate and the largest --tokens-per-rank that fits."""
    available = _available_memory()
    if cfg.device != "cpu" or available is None:
        return
    for cp in cfg.cp_sizes:
        need = cp * estimate_rank_bytes(cfg, cp)
        if need <= available:
            continue
        fits = min(_largest_fit(cfg, c, available) for c in cfg.cp_sizes)
        fix = (f"use --tokens-per-rank {fits} or less (for every --cp size)" if fits >= 2
               else "use smaller --cp sizes")
        gib = 1 << 30
        raise ValueError(
            f"--tokens-per-rank {cfg.tokens_per_rank} at --cp {cp}: the {cp} ranks would need about "
            f"{need / gib:.1f} GiB of memory (each also computes CP=1 on all T_global={cfg.tokens_per_rank * cp} "
            f"tokens: ~{need / cp / gib:.1f} GiB), and this machine has {available / gib:.1f} GiB available; {fix}"
        )


def _check_what_every_rank_checks(cfg: JobConfig) -> None:
    """What every rank would refuse on its own, said here once, before anything is spawned (a
    refusal inside the ranks is one traceback per rank and exit status 1): the backend's head dims
    and dtypes (its spec's), and the chunkwise halo/state path the setting asks for (``native``:
    the backend's cp context, which the reference backend does not have; the rows per rank that
    context needs: its ``check_native_rows``)."""
    shape, spec = cfg.shape, backend_spec(cfg.backend)
    try:
        spec.check_head_dims(shape.head_k_dim, shape.head_v_dim)
    except ValueError as err:
        raise ValueError(f"--backend {cfg.backend} --head-dim {shape.head_k_dim}: {err}") from None
    try:
        spec.check_dtype(cfg.dtype)
    except ValueError as err:
        raise ValueError(f"--backend {cfg.backend} --dtype {cfg.dtype}: {err}") from None
    sizes = [cp for cp in cfg.cp_sizes
             if cp > 1 and "chunkwise" in cfg.modes_to_run and "chunkwise" not in _skips(cfg, cp)]
    if not sizes:
        return
    from .. import env

    setting = env.read(env.CHUNKWISE_PATH_ENV)
    if setting == "generic":
        return
    native, why = _native_cp_context(cfg)
    if setting == "native" and not native:
        raise ValueError(
            f"chunkwise path 'native' ({env.CHUNKWISE_PATH_ENV}): chunkwise at --cp "
            f"{','.join(map(str, sizes))} would run the backend's cp context, but {why}; unset {env.CHUNKWISE_PATH_ENV} "
            "(auto: the backend's where it can run, else gdn-cp's own exchange), set it to generic, or leave chunkwise out of --modes"
        )
    if native:
        for cp in sizes:
            _check_native_rows(cfg, cp)


def _native_cp_context(cfg: JobConfig) -> tuple[bool, str]:
    """Whether the ranks' chunkwise would run the backend's native cp context (NCCL groups: one rank per
    GPU), and why not."""
    if backend_spec(cfg.backend).native_cp is None:
        others = "; ".join(f"{s.title}'s needs --backend {s.name} on {s.native_cp}"
                           for s in BACKENDS.values() if s.native_cp is not None)
        return False, f"the {cfg.backend} backend has none ({others})"
    if cfg.dist_backend != "nccl":
        return False, (f"--dist-backend {cfg.dist_backend}: FLA's cp context runs on NCCL groups (one rank per GPU); "
                       "gloo ranks take gdn-cp's own exchange")
    why = get_backend(cfg.backend).native_cp_problem()
    return why is None, why or ""


def _check_native_rows(cfg: JobConfig, cp: int) -> None:
    """The backend's cp context takes the job's packing at this CP size (the checks its core makes first)."""
    from ..layout import Boundaries

    cu = Boundaries(packed_boundaries(cfg.num_sequences, cfg.tokens_per_rank * cp, cp, cfg.seed))
    try:
        get_backend(cfg.backend).check_native_rows(cu, cp, cfg.conv_width)
    except ValueError as err:
        raise ValueError(f"--tokens-per-rank {cfg.tokens_per_rank} --sequences {cfg.num_sequences} at --cp {cp} "
                         f"(chunkwise through {backend_spec(cfg.backend).title}'s cp context): {err}") from None


def _check_named_modes(cfg: JobConfig) -> None:
    """A mode named in ``--modes`` must run at every CP size with these heads (TP=1): said here,
    before anything is spawned (:func:`gdn_cp.cli.run.named_modes_problem`, which ``gdn-cp run`` also
    asks before torch is imported)."""
    from .run import named_modes_problem

    problem = named_modes_problem(cfg.modes, cfg.cp_sizes, cfg.shape.num_k_heads, cfg.shape.num_v_heads)
    if problem:
        raise ValueError(problem)


# ------------------------------------------------------------------------------------------
# inside each rank
# ------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rank_job(ctx, cp: int, cfg: JobConfig, modes: tuple[str, ...]) -> dict:
    """One rank of a cp-sized run: round trip, CP=1 answer, then each mode. Each part is sent to the
    parent as it is done (``ctx.emit``: ``routes``, ``reference``, one ``mode`` each), so that its
    line prints at once; the answer is what can only be said at the end."""
    from ..comm import all_gather_rows, barrier, group_backend, route_all_to_all, world_group
    from ..layout import CONTIGUOUS, ZIGZAG, RouteCache
    from ..modes import CallContext, Settings, gdn_core, prepare_mode

    rank, device, group = ctx.rank, ctx.device, world_group()
    t_global = cfg.tokens_per_rank * cp
    cu = packed_boundaries(cfg.num_sequences, t_global, cp, cfg.seed)
    cache = RouteCache()
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    t0 = time.perf_counter()
    plan = cache.plan(cu_t, cp, rank)
    z2c, c2z = plan.route(ZIGZAG, CONTIGUOUS), plan.route(CONTIGUOUS, ZIGZAG)
    build_ms = (time.perf_counter() - t0) * 1e3
    logger.debug("cp=%d: THD cut %s (every packed sequence in 2*cp=%d zigzag parts), %d of %d rows here; %s",
                 cp, plan.split, 2 * cp, plan.t_local, t_global, _leaving_text(z2c, rank))
    own = plan.natural_order().on(device)[2]  # the global rows this rank holds, in its (zigzag) order
    rows = own.to(torch.float64).unsqueeze(1)
    back = route_all_to_all(route_all_to_all(rows, z2c, c2z, group), c2z, z2c, group)
    ctx.emit({"kind": "routes", "cu": cu, "route_summary": z2c.summary() if rank == 0 else "",
              "route_build_ms": build_ms, "round_trip_exact": bool(torch.equal(back, rows))})

    backend = get_backend(cfg.backend)
    data = core_inputs(t_global, cfg.shape, cfg.conv_width, getattr(torch, cfg.dtype), cfg.seed, device)
    full = core_leaves(data)
    _sync(device)
    t0 = time.perf_counter()
    o_ref = gdn_core(full["qkv"], full["g"], full["beta"], full["conv_weight"], full["conv_bias"],
                     shape=cfg.shape, mode="chunkwise", plan=cache.plan(cu, 1, 0), group=None, backend=backend)
    o_ref.backward(data["dout"])
    _sync(device)
    reference = {"kind": "reference", "cp1_s": time.perf_counter() - t0}
    if "chunkwise" in modes:
        call = CallContext(settings=Settings.from_environment(mode="chunkwise"), shape=cfg.shape, plan=plan,
                           group=group, backend=backend)
        reference["chunkwise_path"] = f"{prepare_mode(call).path} ({group_backend(group)} group)"
    ctx.emit(reference)
    for mode in modes:
        logger.debug("cp=%d: %s mode on the %s backend (%s group, %s)", cp, mode, cfg.backend,
                     group_backend(group), cfg.device)
        leaves = core_leaves(data, own)
        barrier(group)
        _sync(device)
        t0 = time.perf_counter()
        o = gdn_core(leaves["qkv"], leaves["g"], leaves["beta"], leaves["conv_weight"], leaves["conv_bias"],
                     shape=cfg.shape, mode=mode, plan=plan, group=group, backend=backend)
        o.backward(data["dout"][own])
        _sync(device)
        elapsed = time.perf_counter() - t0
        errs = {"out": max_rel(o, o_ref[own])}
        for k in ("qkv", "g", "beta"):
            errs[k] = max_rel(leaves[k].grad, full[k].grad[own])
        for k in ("conv_weight", "conv_bias"):  # replicated parameters: gradients sum over CP ranks
            total = all_gather_rows(leaves[k].grad.reshape(1, -1), group).sum(0)
            errs[k] = max_rel(total, full[k].grad.reshape(-1))
        ctx.emit({"kind": "mode", "mode": mode, "errors": errs, "seconds": elapsed})
    return {"plan_hits_after_first": cache.plan(cu_t, cp, rank) is plan}


def _leaving_text(route, rank: int) -> str:
    """``zigzag->contiguous sends 96 of 512 rows to 1 rank in 2 transfers`` (the route decision, logged)."""
    out = [(peer, n) for peer, _g, n, _loc in route.send_transfers if peer != rank]
    return (f"{route.source}->{route.target} sends {sum(n for _, n in out)} rows to "
            f"{count(len({p for p, _ in out}), 'rank')} in {count(len(out), 'transfer')}")


# ------------------------------------------------------------------------------------------
# the parent: one cp size after the other, each line printed when every rank has sent its part
# ------------------------------------------------------------------------------------------
@dataclass
class JobResult:
    """What the job found. ``ok``: every check of what ran passed and nothing asked for by name was
    skipped; ``skipped``: ``(cp, mode, reason)``; ``failures``: one line each; ``runs``: one row per
    (cp, mode) that ran (errors, seconds, ok); ``blocks``: per CP size, what its ranks said of the
    routes and the CP=1 reference."""

    ok: bool = True
    ran: int = 0
    skipped: list[tuple[int, str, str]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    runs: list[dict] = field(default_factory=list)
    blocks: dict[int, dict] = field(default_factory=dict)
    tolerance: Optional[float] = None

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    @property
    def verdict(self) -> str:
        """``result: PASS...`` / ``result: FAIL...``: the line the run ends with."""
        if not self.ok:
            return f"result: FAIL ({count(len(self.failures), 'problem')} listed above)"
        if self.skipped:
            return (f"result: PASS: {count(self.ran, '(cp, mode) run')} that could run passed; "
                    f"{len(self.skipped)} skipped (listed above)")
        return f"result: PASS: {count(self.ran, '(cp, mode) run')} passed"

    def to_json(self, cfg: JobConfig) -> dict:
        """The run as one JSON object (``gdn-cp run --json``)."""
        config = {**cfg.__dict__, "shape": dict(cfg.shape.__dict__), "cp_sizes": list(cfg.cp_sizes),
                  "modes": list(cfg.modes_to_run)}
        return {"config": config, "tolerance": self.tolerance, "ok": self.ok, "verdict": self.verdict,
                "runs": self.runs, "blocks": {str(cp): b for cp, b in self.blocks.items()},
                "skipped": [{"cp": cp, "mode": mode, "reason": why} for cp, mode, why in self.skipped],
                "failures": self.failures}


class _Block:
    """The report of one CP size, printed part by part as the ranks send them (``on_event``): a part
    is printed once every rank has sent it, with the maximum over ranks."""

    def __init__(self, cp: int, modes: tuple[str, ...], skipped: dict[str, str], tol: float, result: JobResult,
                 say: Callable[[str], None], progress=None):
        self.cp, self.modes, self.skipped, self.tol, self.result, self.say = cp, modes, skipped, tol, result, say
        self.progress = progress
        self._parts: dict[tuple, dict[int, dict]] = {}
        self.info = result.blocks.setdefault(cp, {})

    def on_event(self, rank: int, event: dict) -> None:
        key = (event["kind"], event.get("mode"))
        part = self._parts.setdefault(key, {})
        part[rank] = event
        if len(part) == self.cp:
            getattr(self, f"_{event['kind']}")([part[r] for r in range(self.cp)])

    def _routes(self, reports: list[dict]) -> None:
        r0 = reports[0]
        lengths = [b - a for a, b in zip(r0["cu"][:-1], r0["cu"][1:])]
        self.say(f"packed micro-batch: {count(len(lengths), 'sequence')} (lengths {min(lengths)}..{max(lengths)}, "
                 f"{count(lengths.count(0), 'empty slot')}), T_global={r0['cu'][-1]}")
        summary = r0["route_summary"].splitlines()
        self.say("\n".join(summary[:4]))
        self.say(f"  ... {count(max(0, len(summary) - 4), 'more send/recv transfer')}; route build "
                 f"{r0['route_build_ms']:.2f} ms")
        exact = all(r["round_trip_exact"] for r in reports)
        self.say(f"zigzag -> contiguous -> zigzag round trip bit-exact on all ranks: {exact}")
        self.info.update(t_global=r0["cu"][-1], sequences=len(lengths), round_trip_exact=exact,
                         route_build_ms=max(r["route_build_ms"] for r in reports))
        if not exact:
            self.result.failures.append(f"cp={self.cp}: the zigzag -> contiguous -> zigzag round trip is not bit-exact")

    def _reference(self, reports: list[dict]) -> None:
        r0 = reports[0]
        cp1_s = max(r["cp1_s"] for r in reports)
        self.info["cp1_s"] = cp1_s
        self.say(f"CP=1 reference forward+backward: {cp1_s:.3f} s")
        if "chunkwise_path" in r0:
            self.info["chunkwise_path"] = r0["chunkwise_path"]
            self.say(f"halo/state exchange of chunkwise: {r0['chunkwise_path']} (native: the backend's cp context; "
                     "generic: gdn-cp's own)")
        self.say(f"{'mode':<11} " + " ".join(f"{h:>9}" for h in HEADERS) + f" {'time s':>8}  ok")
        for mode in MODE_NAMES:
            if mode in self.skipped:
                self.say(f"{mode:<11} skipped: {self.skipped[mode]}")
        self._step(self.modes[0] if self.modes else "")

    def _mode(self, reports: list[dict]) -> None:
        mode = reports[0]["mode"]
        errs = {k: max(r["errors"][k] for r in reports) for k in COLUMNS}
        secs = max(r["seconds"] for r in reports)
        good = all(v <= self.tol for v in errs.values())  # NaN is never <= tol
        self.result.ran += 1
        self.result.runs.append({"cp": self.cp, "mode": mode, "errors": errs, "seconds": secs, "ok": good})
        if not good:
            bad = ", ".join(f"{k} {v:.1e}" for k, v in errs.items() if not v <= self.tol)
            self.result.failures.append(f"cp={self.cp} {mode}: relative error over {self.tol:g}: {bad}")
        cols = " ".join(f"{errs[k]:>9.1e}" for k in COLUMNS)
        self.say(f"{mode:<11} {cols} {secs:>8.3f}  {'yes' if good else 'NO'}")
        later = self.modes[self.modes.index(mode) + 1:]
        self._step(later[0] if later else "")

    def _step(self, next_mode: str) -> None:
        if self.progress is not None:
            self.progress.step(f"cp={self.cp} {next_mode}" if next_mode else "")

    def finish(self, answers: list[dict]) -> None:
        """What the ranks answered at the end: whether the route cache reused its plan."""
        hits = all(a["plan_hits_after_first"] for a in answers)
        self.info["plan_reused"] = hits
        self.say(f"cached plan reused on every rank: {hits}")
        if not hits:
            self.result.failures.append(f"cp={self.cp}: the route cache did not reuse the plan")


def _skips(cfg: JobConfig, cp: int) -> dict[str, str]:
    """Modes that cannot run at this CP size (TP=1), with the reason, from the mode registry."""
    out = {}
    for mode in cfg.modes_to_run:
        why = head_problem(mode, num_key_heads=cfg.shape.num_k_heads, num_value_heads=cfg.shape.num_v_heads,
                           tp=1, cp=cp)
        if why:
            out[mode] = why
    return out


def job_steps(cfg: JobConfig) -> int:
    """How many steps the job's progress counts: per CP size, its CP=1 reference and each mode that runs."""
    return sum(1 + len([m for m in cfg.modes_to_run if m not in _skips(cfg, cp)]) for cp in cfg.cp_sizes)


def run_job(cfg: JobConfig, tolerance: Optional[float] = None, echo: Callable[[str], None] = print,
            timeout_s: float = 900.0, *, verdict_only: bool = False, progress=None,
            rank_log_level: Optional[int] = None) -> JobResult:
    """Run the job for every cp size (see the module docstring); print as it goes (each mode's line as
    soon as its ranks are done with it); return the result.

    ``verdict_only``: print only the failures and the verdict. ``progress``: a
    :class:`gdn_cp.cli.progress.Progress` to print through and count steps on (its bar). ``rank_log_level``:
    the ranks' log records at this level and above reach this process's loggers (DEBUG: each rank's
    THD cut, route, mode and backend, and the library's own records). Raises ValueError
    (:func:`check_job`) before spawning anything when the job cannot run here.
    """
    check_job(cfg)
    tol = cp_vs_cp1_tolerance(cfg.dtype, cfg.backend) if tolerance is None else tolerance
    result = JobResult(tolerance=tol)
    write = echo if progress is None else progress.line
    say = (lambda line: None) if verdict_only else write
    shape = cfg.shape
    say(f"gdn-cp run: CP sizes {','.join(map(str, cfg.cp_sizes))}; modes {', '.join(cfg.modes_to_run)}; "
        f"{count(cfg.num_sequences, 'packed sequence')}, {count(cfg.tokens_per_rank, 'token')} per rank; "
        f"{shape.num_k_heads} key / {shape.num_v_heads} value heads of dim {shape.head_k_dim}; {cfg.dtype} on "
        f"{cfg.device}, {cfg.backend} backend, {cfg.dist_backend} ranks; seed {cfg.seed}")
    say(f"Each mode's columns are relative errors against CP=1 on the same inputs, max over ranks: "
        f"max|CP - CP=1| / max|CP=1| of the output and of each gradient; allowed: <= {tol:g}.")
    if progress is not None:
        progress.start(job_steps(cfg), f"cp={cfg.cp_sizes[0]} CP=1 reference")
    for cp in cfg.cp_sizes:
        skipped = _skips(cfg, cp)
        result.skipped += [(cp, mode, why) for mode, why in skipped.items()]
        modes = tuple(m for m in cfg.modes_to_run if m not in skipped)
        say(f"\n== cp={cp}: spawning {count(cp, 'rank')} ({cfg.dist_backend}, {cfg.device})")
        if progress is not None:
            progress.describe(f"cp={cp} CP=1 reference")
        block = _Block(cp, modes, skipped, tol, result, say, progress)
        try:
            answers = run_ranks(cp, _rank_job, cp, cfg, modes, device=cfg.device, backend=cfg.dist_backend,
                                timeout_s=timeout_s, on_event=block.on_event, log_level=rank_log_level)
        except RankError as err:
            say(f"cp={cp} failed:\n{err}")
            result.failures.append(f"cp={cp}: {count(len(err.failures), 'rank')} failed (above)")
            continue
        block.finish(answers)
    if progress is not None:
        progress.close()
    _finish(cfg, result, say, write)
    return result


def _finish(cfg: JobConfig, result: JobResult, say: Callable[[str], None],
            verdict: Optional[Callable[[str], None]] = None) -> None:
    """The end of the report: what was skipped (``say``), then what failed and the verdict (``verdict``,
    printed even where the rest is not)."""
    verdict = verdict or say
    asked = cfg.modes is not None
    for cp, mode, why in result.skipped:  # check_job refuses these before spawning; kept as a guard
        if asked:
            result.failures.append(f"{mode} at cp={cp} was asked for with --modes but cannot run: {why}")
    if result.ran == 0 and not result.failures:
        result.failures.append("nothing ran: every mode was skipped at every CP size")
    result.ok = not result.failures
    say("")
    if not asked:
        for cp, mode, why in result.skipped:
            say(f"skipped: {mode} at cp={cp} ({why})")
    for line in result.failures:
        verdict(f"failed: {line}")
    verdict(result.verdict)
