#!/usr/bin/env python
"""Full GatedDeltaNet layer benchmark: stock megatron-core 0.19.2 against every gdn-cp mode, forward +
backward of the real layer (``in_proj`` to ``out_proj``) on the same weights and packed input, plus the ideal;
docs/performance.md ("Figures", its full-layer part) says what each row holds and how it is measured.

- ``--spec``: ``local`` (Megatron's local modules) and/or ``te`` (``get_gated_delta_net_module_spec``: needs
  TransformerEngine; without it its rows are errors that say so). ``--backend``: gdn-cp's per-rank kernels.
- Cases (``layer_full_math.CASES``) at CP >= 2, one rank per GPU over NCCL (gloo ranks on the CPU):
  ``stock_headwise`` (a pristine copy of megatron-core in its own rank pool), ``headwise``,
  ``chunkwise_hidden`` / ``chunkwise_core`` (the swap point), ``chunkwise_generic`` (gdn-cp's own exchange),
  ``all_gather``, and ``cp1_slice`` (CP=1 on each rank's contiguous slice: the ideal). ``--cp 1``: the per-rank
  work on one GPU (``stock_cp1`` / ``patched_cp1``; with ``--slice-of-cp N`` each rank's slice of a CP=N run).
- Levers (``--levers``, ``layer_full_rank.LEVER_SWITCHES``): each also timed switched off (a benchmark-side switch
  in the rank process, never a library flag). ``--plan SPEC[-LEVER]:T,...`` gives the units in priority order,
  so that a time limit cuts the least important.
- Method (DESIGN.md, "Measuring performance"): a compile pass per unit (stock and patched pools side by side),
  each case checked against CP=1 (``--cp 1``: against stock on the same module and rows); then per case
  ``--warmup`` + ``--iters`` CUDA-event iterations, the maximum over ranks per iteration, median and p10 / p90,
  peak memory, ``--profile-iters`` under torch.profiler (compute / NCCL / memcpy / idle and its causes, kernel
  classes), the core alone, bytes per token from the plan.
- No new case after ``--time-limit``; a case past ``--time-limit + --grace`` is killed and recorded as an error.
  Rows are merged into ``--out`` after every case (rows of the same run key replaced); SIGINT / SIGTERM write
  what was collected.

    python3 -m benchmarks.layer_full --quick --out /tmp/layer_full.json        # CPU dry run (~1 min)
    python3 -m benchmarks.layer_full --cp 1 --slice-of-cp 2 --tokens 32K --packings mixed8   # 1x H200
    python3 -m benchmarks.layer_full --tokens 32K --out $OUT/layer_full.json   # 2x H200: CP=2
    python3 -m benchmarks.plot_layer_full $OUT/layer_full.json                 # markdown tables

On the device machine ``benchmarks/gpu_suite.sh`` installs the stack and keeps the Triton cache:
``GDN_CP_STAGES=layer_full GDN_CP_LAYER_FULL_ARGS="--tokens 32K" bash benchmarks/gpu_suite.sh``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib.util
import json
import logging
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch

from gdn_cp.layout import build_chunkwise_plan
from gdn_cp.ops.fla.detect import fla_version
from gdn_cp.ops.registry import BACKEND_CHOICES
from gdn_cp.patch import (BACKUP_SUFFIX, PRISTINE, PatchError, check_patch, ensure_patched, find_megatron_root,
                          megatron_version, overall_state, revert_patch)
from gdn_cp_testing.ranks import RankPool

from . import layer_full_rank as rank_side
from .common import (add_out_arguments, csv_choices as _csv, machine_info, now_iso, resolve_out, setup_logging, versions,
                     write_json)
from .layer_full_math import (CASES, CP1_CASES, LEVERS, PACKINGS, SLICE_CASES, SPECS, STOCK_CASES, GDNDims,
                              bytes_per_token, case_key, contiguous_slice, packing, parse_plan, run_key)
from .measure import fmt_tokens, iteration_stats, parse_tokens


logger = logging.getLogger("benchmarks.layer_full")

SCHEMA = 1
TINY = GDNDims(hidden=32, num_k_heads=4, num_v_heads=8, head_k_dim=8, head_v_dim=8, conv_width=4)
DEFAULTS = dict(tokens=[32 * 1024], align=64, warmup=5, iters=20, profile_iters=3)
QUICK = dict(tokens=[512], align=4, warmup=1, iters=3, profile_iters=0)
SPAWN_S = 180.0  # spawning a pool (imports, NCCL init, building the layers) may take this long
CASE_TIMEOUT_S = 420.0  # longest wait for one call into the ranks (a cold FLA autotune takes minutes)


class _Stop(BaseException):
    """SIGINT / SIGTERM: stop, write what was collected."""


def _on_signal(signum, frame):  # noqa: ARG001
    raise _Stop(f"signal {signum}")


# ---- arguments ----

def _tokens(text: str) -> int:
    try:
        return parse_tokens(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("what")
    g.add_argument("--tokens", type=_tokens, nargs="+", default=None,
                   help="T per micro-batch, e.g. 32K (default 32K; one T per 10-minute call)")
    g.add_argument("--packings", type=_csv(PACKINGS), default=list(PACKINGS),
                   help=f"comma list, in run order (default {','.join(PACKINGS)})")
    g.add_argument("--cases", type=_csv(CASES + CP1_CASES), default=None,
                   help=f"comma list (default at CP >= 2: {','.join(CASES)}; at --cp 1: stock_cp1,patched_cp1, "
                        f"and {','.join(SLICE_CASES)} with --slice-of-cp)")
    g.add_argument("--cp", type=int, default=None,
                   help="CP size = ranks (default: GPUs on CUDA, 2 on the CPU); 1: the per-rank work on one GPU")
    g.add_argument("--slice-of-cp", type=int, default=None, metavar="N",
                   help="with --cp 1: also time each rank's contiguous slice of a CP=N run (one row per rank)")
    g.add_argument("--slice-ranks", type=lambda t: [int(x) for x in t.split(",")], default=None, metavar="R,R",
                   help="with --slice-of-cp N: time only these ranks' slices (default: every rank's), e.g. 0,3")
    g.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    g.add_argument("--dtype", choices=("bfloat16", "float32", "float64"), default=None,
                   help="activations and weights (default bfloat16 on CUDA, float32 on the CPU)")
    g.add_argument("--align", type=int, default=None,
                   help="every sequence length is a multiple of this (a multiple of 2*cp; default 64)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--spec", type=_csv(SPECS), default=None,
                   help="comma list, in run order, of local (default) and te (see above)")
    g.add_argument("--levers", type=_csv(LEVERS), default=[],
                   help=f"comma list of gdn-cp levers to time switched off too, beside the rows with every lever on "
                        f"(see above): {','.join(LEVERS)}")
    g.add_argument("--plan", type=str, default=None,
                   help="explicit run order of SPEC[-LEVER]:T units instead of --spec/--levers/--tokens, e.g. "
                        "te:32K,te:128K,te-fused_norm:32K,local:128K (a time limit then cuts the last units)")
    g.add_argument("--backend", choices=BACKEND_CHOICES, default="auto",
                   help="gdn-cp's per-rank kernels in the patched cases (TransformerConfig.linear_cp_backend; default "
                        "auto: FlashQLA where it runs and takes the layer, else FLA); stock rows are stock's FLA call")
    _add_method_run(p)
    return p


def _add_method_run(p: argparse.ArgumentParser) -> None:
    """The argument groups method and run (the shape: Qwen3.5-9B's GDN layer, ``--quick`` a tiny one)."""
    m = p.add_argument_group("method")
    m.add_argument("--warmup", type=int, default=None,
                   help="untimed fwd+bwd per case after the compile pass (default 5)")
    m.add_argument("--iters", type=int, default=None, help="timed fwd+bwd per case (default 20)")
    m.add_argument("--profile-iters", type=int, default=None,
                   help="profiled iterations per case, CUDA only (default 3; 0: none)")
    m.add_argument("--no-core", action="store_true", help="do not time the core alone")
    m.add_argument("--compile-only", action="store_true",
                   help="only the compile pass (compile/autotune every case, check it against CP=1), no timing: "
                        "a first call with a cold Triton cache; its rows have status 'compiled'")
    m.add_argument("--fast-autotune", action="store_true",
                   help="test knob: each Triton autotuner takes its first working config (flagged in every row; "
                        "kernels are then not tuned, so do not quote the times)")
    r = p.add_argument_group("run")
    r.add_argument("--time-limit", type=float, default=480.0, help="no new case after this many seconds (default 480)")
    r.add_argument("--grace", type=float, default=45.0, help="a running case is killed this long after the limit")
    add_out_arguments(r, "layer_full.json", "JSON rows (merged, see above)")
    r.add_argument("--quick", action="store_true",
                   help=f"CPU dry run: tiny shape and {QUICK} unless given")
    r.add_argument("-v", "--verbose", action="store_true")


def resolve_args(args):
    """Fill the defaults (``--quick``'s where it is given), then check the combination."""
    if args.plan is not None and (args.spec is not None or args.levers or args.tokens is not None):
        raise SystemExit("--plan names every unit (spec, lever, T): leave out --spec, --levers and --tokens")
    defaults = QUICK if args.quick else DEFAULTS
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.out = resolve_out(args, "layer_full.json")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    args.gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    args.cp = args.cp or (args.gpus if args.device == "cuda" else 2)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.dims = TINY if args.quick else GDNDims()
    for name in ("warmup", "iters", "profile_iters"):
        if getattr(args, name) < (1 if name == "iters" else 0):
            raise SystemExit(f"--{name.replace('_', '-')} must be >= {1 if name == 'iters' else 0}")
    if args.cp < 1:
        raise SystemExit(f"--cp must be >= 1, got {args.cp}; on CUDA it defaults to the GPU count")
    if args.slice_of_cp is not None:
        if args.cp != 1:
            raise SystemExit(f"--slice-of-cp goes with --cp 1 (got --cp {args.cp}); at CP >= 2 the cp1_slice case "
                             "times every rank's slice")
        if args.slice_of_cp < 2:
            raise SystemExit(f"--slice-of-cp must be >= 2 (the CP size whose slices to time), got {args.slice_of_cp}")
    if args.slice_ranks is not None:
        if args.slice_of_cp is None or any(not 0 <= r < args.slice_of_cp for r in args.slice_ranks):
            raise SystemExit(f"--slice-ranks {','.join(map(str, args.slice_ranks))} must be ranks in [0, N) of "
                             f"--slice-of-cp N (got N={args.slice_of_cp})")
    if args.cases is None:
        args.cases = list(CASES) if args.cp > 1 else [
            c for c in CP1_CASES if c not in SLICE_CASES or args.slice_of_cp is not None]
    allowed = CASES if args.cp > 1 else CP1_CASES
    wrong = [c for c in args.cases if c not in allowed]
    if wrong:
        raise SystemExit(f"--cases {','.join(wrong)} cannot run at --cp {args.cp}; choose from {','.join(allowed)}")
    if args.cp == 1 and args.slice_of_cp is None and any(c in SLICE_CASES for c in args.cases):
        raise SystemExit(f"--cases {','.join(SLICE_CASES)} need --slice-of-cp N (the CP size whose slices to time)")
    zigzag_cp = args.slice_of_cp or args.cp  # the packing must be one a CP run of this size takes
    if args.align % (2 * zigzag_cp):
        raise SystemExit(f"--align {args.align} must be a multiple of 2*cp={2 * zigzag_cp} (Megatron's zigzag cut)")
    if args.plan is not None:
        try:
            args.units = parse_plan(args.plan)
        except ValueError as err:
            raise SystemExit(f"--plan: {err}") from None
        args.tokens = list(dict.fromkeys(t for _, _, t in args.units))
        args.specs = list(dict.fromkeys(s for s, _, _ in args.units))
        args.levers = list(dict.fromkeys(lv for _, lv, _ in args.units if lv))
    else:
        args.specs = args.spec or ["local"]
        args.units = [(s, lv, t) for s in args.specs for lv in [None, *args.levers] for t in args.tokens]
    if args.levers and all(c in STOCK_CASES for c in args.cases):
        raise SystemExit(f"--levers {','.join(args.levers)} switch off gdn-cp levers: add a patched case to --cases")
    for t in args.tokens:
        for name in args.packings:
            try:
                packing(name, t, args.align)
            except ValueError as err:
                raise SystemExit(f"--tokens {fmt_tokens(t)} --packings {name}: {err}") from None
    return args


def knobs(args) -> dict:
    """Every setting that can change a number, stored in each row."""
    return {"dims": asdict(args.dims), "dtype": args.dtype, "align": args.align, "seed": args.seed,
            "warmup": args.warmup, "iters": args.iters, "profile_iters": args.profile_iters,
            "core": not args.no_core, "fast_autotune": args.fast_autotune, "compile_only": args.compile_only,
            "slice_of_cp": args.slice_of_cp, "time_limit_s": args.time_limit, "grace_s": args.grace,
            "case_timeout_s": CASE_TIMEOUT_S, "packings": args.packings, "cases": args.cases,
            "specs": args.specs, "levers": args.levers, "plan": args.plan,
            "linear_cp_backend": args.backend,
            "torch_compile": "on CUDA: megatron's jit_fuser and gdn-cp's glue compile as in training (since f51d570; "
                             "off on the CPU, where the test shims disable dynamo)",
            "route_build": "once per micro-batch (PackedSeqParams reused across iterations, as the layers of one "
                           "micro-batch share it); stock rebuilds its per-token permutation every call"}


# ---- megatron trees ----

def prepare_megatron_trees(source: Path | None, workdir: Path) -> dict[str, Path]:
    """Two copies of megatron-core 0.19.2's ``megatron/`` package: ``stock`` (pristine) and
    ``patched`` (gdn-cp's patch), whatever state ``source`` is in. Returns their roots."""
    root = find_megatron_root(source)
    stock, patched = workdir / "stock", workdir / "patched"
    for dest in (stock, patched):
        if dest.exists():
            shutil.rmtree(dest)
    shutil.copytree(root / "megatron", stock / "megatron", symlinks=True,
                    ignore=shutil.ignore_patterns("*" + BACKUP_SUFFIX))
    try:
        revert_patch(stock)  # the release's files, whatever state the source is in (else PatchError)
        ensure_patched(stock, copy_to=patched)
    except PatchError as err:
        raise ValueError(f"megatron-core at {root}: {err}") from None
    state = overall_state(check_patch(stock))
    if state != PRISTINE:
        raise RuntimeError(f"the stock copy of megatron-core at {stock} is {state}, expected {PRISTINE}")
    logger.info("megatron-core %s from %s: pristine copy %s, patched copy %s", megatron_version(root), root, stock,
                patched)
    return {"stock": stock, "patched": patched}


# ---- rank pools under a time guard ----

class Runner:
    """The rank pools of this run (stock and patched: both stay up, so that one (T, spec) unit
    times stock and gdn-cp side by side before the next starts; only one runs a case at a time);
    every call into the ranks is bounded by the time guard."""

    def __init__(self, args):
        self.args = args
        self.t0 = time.monotonic()
        self.pools: dict = {}
        self.infos: dict[str, list] = {}
        self.failed: dict[str, str] = {}  # kind -> why its pool did not start
        self.kills = 0
        self.stopped: str | None = None  # set by a signal: nothing new starts, in any thread

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def may_start(self) -> str | None:
        """None, or why nothing new may start."""
        if self.stopped:
            return f"stopped ({self.stopped}): not started"
        if self.elapsed() >= self.args.time_limit:
            return f"time limit: not started ({self.elapsed():.0f} s elapsed, --time-limit {self.args.time_limit:g} s)"
        return None

    def _wait_s(self, at_least: float = 0.0) -> float:
        """How long to wait for the ranks now: ``CASE_TIMEOUT_S`` (or ``at_least``), never past the
        hard deadline (``--time-limit`` + ``--grace``)."""
        hard = self.args.time_limit + self.args.grace - self.elapsed()
        return max(5.0, min(max(CASE_TIMEOUT_S, at_least), hard))

    def open(self, kind: str, setup_spec: dict) -> list:
        self.close(kind)
        env = {"GDN_CP_TEST_FAST_AUTOTUNE": "1" if self.args.fast_autotune else "0",
               "GDN_CP_TEST_PG_TIMEOUT": str(int(CASE_TIMEOUT_S + 60))}
        backend = "gloo" if self.args.device == "cpu" else None
        logger.info("[%4.0fs] spawning %d ranks for %s", self.elapsed(), self.args.cp, kind)
        # A pool that fails to start kills its own ranks before raising.
        pool = RankPool(self.args.cp, device=self.args.device, backend=backend,
                        timeout_s=self._wait_s(SPAWN_S), env=env)
        self.pools[kind] = pool
        infos = self.call(kind, rank_side.rank_setup, setup_spec, at_least=SPAWN_S)
        self.infos[kind] = infos
        logger.info("[%4.0fs] %s pool up (%s, megatron %s: %s)", self.elapsed(), kind, pool.backend,
                    infos[0]["megatron"]["state"], infos[0]["megatron"]["root"])
        return infos

    def call(self, kind: str, fn, spec: dict, at_least: float = 0.0) -> list:
        """``fn(ctx, spec)`` on every rank of ``kind``'s pool; a rank that fails raises, a silent one
        gets the pool killed."""
        pool = self.pools[kind]
        pool.timeout_s = self._wait_s(at_least)
        try:
            return pool.run(fn, spec)
        except Exception:
            if pool.broken:
                logger.warning("%s rank pool broken (%s): killing it", kind, pool.broken)
                self.close(kind, kill=True)
            raise

    def close(self, kind: str | None = None, kill: bool = False) -> None:
        """Close ``kind``'s pool (every pool when None)."""
        for k in [kind] if kind is not None else list(self.pools):
            pool = self.pools.pop(k, None)
            if pool is None:
                continue
            if kill or pool.broken:
                self.kills += 1
                pool.kill()
            else:
                pool.close()


# ---- rows ----

class Rows:
    """This run's rows, merged into the rows already in ``path`` (written after every change)."""

    def __init__(self, path: Path, replaces: list[dict]):
        self.path = path
        old = []
        if path.exists():
            old = json.loads(path.read_text())
            if not isinstance(old, list) or not all(isinstance(r, dict) for r in old):
                raise SystemExit(f"--out {path} exists and is not a list of layer_full rows; pick another --out")
        keys = {run_key(r) for r in replaces}
        self.kept = [r for r in old if run_key(r) not in keys]
        self.new: list[dict] = []
        self._lock = threading.Lock()
        if len(self.kept) != len(old):
            logger.info("replacing %d earlier row(s) of the same runs in %s", len(old) - len(self.kept), path)

    def add(self, row: dict) -> None:
        with self._lock:  # the compile pass of two pools runs in two threads
            self.new.append(row)
            write_json(self.path, self.kept + self.new)

    def write(self) -> None:
        with self._lock:
            write_json(self.path, self.kept + self.new)


def plan_rows(args, run: dict) -> list[dict]:
    """Every (unit, packing, case) of this run as a row skeleton, in run order: a unit is one
    (spec, lever switched off or None, T) of ``args.units``; a lever unit has the patched cases only."""
    rows = []
    versions = run["versions"]
    stack = f"fla {versions.get('fla')} + triton {versions.get('triton')}"
    for unit, (spec, lever_off, t) in enumerate(args.units):
        for name in args.packings:
            layout, cu = packing(name, t, args.align)
            for case in args.cases:
                if lever_off is not None and case in STOCK_CASES:
                    continue
                for slice_rank in (args.slice_ranks or range(args.slice_of_cp)) if case in SLICE_CASES else [None]:
                    row = {
                        "unit": unit, "spec": spec, "lever_off": lever_off, "stack": stack,
                        "benchmark": "layer_full", "schema": SCHEMA, "date": run["date"], "run_id": run["run_id"],
                        "gpus": args.gpus, "device": args.device, "backend": None, "cp": args.cp, "tp": 1, "T": t,
                        "layout": layout, "packing": name, "case": case, "status": "skipped", "error": None,
                        "median_ms": None, "p10_ms": None, "p90_ms": None, "iters": 0, "peak_gib": None,
                        "bytes_per_token": None, "check": None, "core": None, "profile": None,
                        "num_sequences": sum(1 for a, b in zip(cu, cu[1:]) if b > a), "cu": cu,
                        "knobs": run["knobs"], "machine": run["machine"], "versions": run["versions"],
                        "command": run["command"],
                    }
                    if slice_rank is not None:
                        n = args.slice_of_cp
                        plan = build_chunkwise_plan(cu, n, slice_rank, args.dims.conv_width)
                        row.update(slice_rank=slice_rank, slice_of_cp=n, slice_cu=contiguous_slice(cu, n, slice_rank),
                                   rows_timed=t // n,
                                   slice_continues={"from_left": plan.first_continues, "to_right": plan.last_continues})
                    else:
                        row["rows_timed"] = t // args.cp
                    rows.append(row)
    return rows


def _spec(row: dict, args, phase: str) -> dict:
    return {"phase": phase, "case": row["case"], "layout": row["layout"], "cu": row["cu"], "seed": args.seed,
            "spec": row["spec"], "lever_off": row["lever_off"], "core": not args.no_core, "warmup": args.warmup, "iters": args.iters,
            "profile_iters": args.profile_iters, "slice_of_cp": row.get("slice_of_cp"),
            "slice_rank": row.get("slice_rank")}


# Above these (relative L2 vs CP=1) a case is flagged as not computing the CP=1 answer: bf16 CP runs
# measured so far stay below 7e-3 (docs/performance.md), fp32 below 1e-5 on the CPU.
CHECK_SUSPECT = {"bfloat16": 2e-2, "float32": 1e-4, "float64": 1e-8}


def fill_compile(row: dict, outs: list[dict]) -> None:
    refused = [o["refused"] for o in outs if "refused" in o]
    if refused:
        row.update(status="refused", error=refused[0])
        return
    row["compile_s"] = max(o["compile_s"] for o in outs)
    if "core_compile_s" in outs[0]:
        row["core_compile_s"] = max(o["core_compile_s"] for o in outs)
    if "check" in outs[0]:
        c = [o["check"] for o in outs]
        row["check"] = {"metric": "relative L2 vs CP=1 (same weights, same input), max over ranks",
                        "against": c[0].get("against", "CP=1 on the whole micro-batch"),
                        "out": max(x["out"] for x in c), "grad_x": max(x["grad_x"] for x in c),
                        "grad_params": max(x["grad_params"] for x in c), "worst_param": c[0]["worst_param"]}
        limit = CHECK_SUSPECT[row["knobs"]["dtype"]]
        worst = max(row["check"][k] for k in ("out", "grad_x", "grad_params"))
        row["check"].update(suspect_above=limit, suspect=worst > limit)
        if worst > limit:
            logger.warning("T=%s %s %s differs from CP=1 by %.2e (> %.0e): its time is not of a correct computation",
                           fmt_tokens(row["T"]), row["packing"], row["case"], worst, limit)
    row["chunkwise_path"] = outs[0]["chunkwise_path"]
    # what ran, seen in the rank (not assumed from the flags): the layer's submodules, the gated norm
    # path of this very step, the FLA backend of chunk_gated_delta_rule, the glue path the layer resolved
    for k in ("modules", "norm_path", "fla_gdn_backend", "gdn_cp_backend", "glue", "key_heads_in_glue",
              "wide_column_copy", "halo_rows_apart", "scan_branch_masks", "ftz_sigmoid"):
        if k in outs[0]:
            row[k] = outs[0][k]


def fill_time(row: dict, outs: list[dict], args) -> None:
    stats = iteration_stats([o["iter_ms"] for o in outs])
    row.update(status="ok", error=None, **{k: stats[k] for k in ("median_ms", "p10_ms", "p90_ms", "iters")},
               iter_max_ms=stats["iter_max_ms"], per_rank_median_ms=stats["per_rank_median_ms"], warmup=args.warmup)
    if outs[0].get("peak_gib") is not None:
        row["peak_gib_per_rank"] = [o["peak_gib"] for o in outs]
        row["peak_gib"] = max(row["peak_gib_per_rank"])
        row["peak_delta_gib"] = max(o["peak_gib"] - o["allocated_before_gib"] for o in outs)
    if all("profile" in o and "compute_ms" in o["profile"] for o in outs):
        per_rank = [o["profile"] for o in outs]
        crit = max(range(len(per_rank)), key=lambda r: per_rank[r]["compute_ms"])
        p = per_rank[crit]
        row.update(compute_ms=p["compute_ms"], comm_wait_ms=p["nccl_ms"], memcpy_ms=p["memcpy_ms"],
                   idle_ms=p["idle_ms"], profiled_wall_ms=p["wall_ms"], profile_rank=crit,
                   kernels_per_iter=p.get("kernels"), top_kernels_ms=p.get("top_kernels_ms"),
                   classes_ms=p.get("classes_ms"), idle_causes_ms=p.get("idle_causes_ms"))
        row["profile"] = {"note": "per rank, ms per iteration over the same profiled iterations: compute + nccl + "
                                  "memcpy + idle = wall (exclusive; *_total = overlapping sums); the flat fields "
                                  "are the rank with the most compute", "per_rank": per_rank}
    elif any("profile" in o for o in outs):
        row["profile"] = {"error": next(o["profile"] for o in outs if "profile" in o)}
    if any("core_error" in o for o in outs):
        row["core"] = {"error": next(o["core_error"] for o in outs if "core_error" in o)}
    elif all("core" in o for o in outs):
        core = iteration_stats([o["core"]["iter_ms"] for o in outs])
        row["core"] = {k: core[k] for k in ("median_ms", "p10_ms", "p90_ms", "iters", "per_rank_median_ms")}
        if outs[0]["core"].get("peak_gib") is not None:
            row["core"]["peak_gib"] = max(o["core"]["peak_gib"] for o in outs)
    if all(o.get("memory") for o in outs):
        crit = max(range(len(outs)), key=lambda r: outs[r]["memory"]["peak_gib"])
        row["memory"] = {**outs[crit]["memory"], "rank": crit,
                         "note": "one more fwd+bwd after the timed ones: GiB above what was allocated before it "
                                 "(inputs, weights): saved_after_forward = what the forward keeps for backward, "
                                 "peak_in_forward / peak (whole step) = the allocator's high-water marks"}
    if row["case"] == "cp1_slice":
        meds = stats["per_rank_median_ms"]
        row["critical_rank"] = max(range(len(meds)), key=lambda r: meds[r])
        row["slices"] = [contiguous_slice(row["cu"], row["cp"], r) for r in range(row["cp"])]
        plans = [build_chunkwise_plan(row["cu"], row["cp"], r, args.dims.conv_width) for r in range(row["cp"])]
        row["slice_continues"] = [{"from_left": p.first_continues, "to_right": p.last_continues} for p in plans]
    b = bytes_per_token(row["case"], layout=row["layout"], cu=row["cu"], cp=row["cp"], dims=args.dims,
                        act_bytes=torch.finfo(getattr(torch, args.dtype)).bits // 8,
                        chunkwise_path=row.get("chunkwise_path") or "generic")
    row.update(bytes_per_token=b["bytes_per_token"], bytes_per_token_mean=b["bytes_per_token_mean"],
               bytes_detail={"note": "bytes leaving each rank per fwd+bwd / T_local, from the plan",
                             "per_rank": b["per_rank"], "exchange_per_rank": b["exchange_per_rank"],
                             "chunkwise_exchange_path": b["chunkwise_exchange_path"]})


def _error_text(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=6)}"


def _describe_pool(runner: Runner, row: dict, kind: str) -> None:
    infos = runner.infos[kind]
    row["backend"] = runner.pools[kind].backend
    row["megatron"] = {**infos[0]["megatron"], "pool": kind,
                       "stock_source": "pristine copy, own processes" if row["case"] in STOCK_CASES else None}
    row["rank_info"] = {k: infos[0].get(k) for k in ("gpu", "gpu_memory_gib", "capability", "fla", "triton",
                                                       "torch", "torch_cuda", "fast_autotune", "dist_backend",
                                                       "transformer_engine")}
    why = (infos[0].get("spec_errors") or {}).get(row["spec"])
    if why:
        row.update(status="error", error=f"spec {row['spec']}: {why}")


def _ensure_pool(runner: Runner, kind: str, setup_spec: dict) -> str | None:
    """Open ``kind``'s pool unless it is up; None, or why it is not (recorded once per kind; a pool
    killed after a hang is respawned once)."""
    if kind in runner.pools:
        return None
    if kind in runner.failed:
        return runner.failed[kind]
    if kind in runner.infos and runner.kills > 1:
        return "rank pools were killed twice (hang or crash); not starting another"
    try:
        runner.open(kind, setup_spec)
        return None
    except Exception as err:  # noqa: BLE001 - recorded in every row of this pool
        text = f"{kind} pool failed to start: {_error_text(err)}"
        logger.error("%s", text)
        runner.close(kind, kill=True)
        if kind not in runner.infos:
            runner.failed[kind] = text
        return text


def _time_order(group: list[dict]) -> list[dict]:
    """Stock and gdn-cp alternate per slice rank (stock r0, gdn-cp r0, stock r1, ...), levers last."""
    return sorted(group, key=lambda r: (r.get("slice_rank") if r.get("slice_rank") is not None else -1,
                                        r["case"] not in STOCK_CASES))


def _run_row(runner: Runner, rows: Rows, row: dict, kind: str, phase: str, setups: dict, args) -> None:
    """One row, one phase, in ``kind``'s pool (opened here when it is not up)."""
    if phase == "time" and row.get("status") != "compiled":
        return
    why = runner.may_start()
    if why:
        row.update(status="skipped", error=why)
        return
    why = _ensure_pool(runner, kind, setups[kind])
    if why:
        row.update(status="error", error=why)
        rows.add(row)
        return
    if phase == "compile":
        _describe_pool(runner, row, kind)
        if row["status"] == "error":
            rows.add(row)
            return
    label = f"T={fmt_tokens(row['T'])} {row['packing']} {case_key(row)} ({phase})"
    logger.info("[%4.0fs] %s ...", runner.elapsed(), label)
    t0 = time.perf_counter()
    try:
        outs = runner.call(kind, rank_side.rank_case, _spec(row, args, phase))
        if phase == "compile":
            fill_compile(row, outs)
            if row["status"] != "refused":
                row["status"] = "compiled"
        else:
            fill_time(row, outs, args)
    except _Stop:
        row.update(status="error", error="stopped by a signal while running")
        raise
    except Exception as err:  # noqa: BLE001 - record, go on
        row.update(status="error", error=f"{phase}: {_error_text(err)}")
    row[f"{phase}_elapsed_s"] = round(time.perf_counter() - t0, 2)
    logger.info("[%4.0fs] %s: %s", runner.elapsed(), label, _summary(row, phase))
    if phase == "time" or row["status"] in ("error", "refused") or args.compile_only:
        rows.add(row)


def _compile_pass(runner: Runner, rows: Rows, group: list[dict], pool_of, setups: dict, args) -> None:
    """The compile pass of one unit: each pool's rows in order; the pools side by side (one thread
    each: a cold FLA compile is minutes per pool, and opening a pool ~20 s). Nothing is timed here; the timed
    pass runs one case at a time."""
    by_kind: dict[str, list[dict]] = {}
    for row in group:
        by_kind.setdefault(pool_of(row), []).append(row)

    def work(kind: str) -> None:
        for row in by_kind[kind]:
            _run_row(runner, rows, row, kind, "compile", setups, args)

    if len(by_kind) == 1:  # in this thread: a signal stops it where it is
        return work(*by_kind)
    threads = cf.ThreadPoolExecutor(len(by_kind), thread_name_prefix="layer_full-compile")
    try:
        for done in [threads.submit(work, kind) for kind in by_kind]:
            done.result()  # a pool's failure is raised here
    finally:
        threads.shutdown(wait=False)  # a signal: main() stops every pool, and with them the threads' calls


def run_units(runner: Runner, rows: Rows, planned: list[dict], pool_of, setups: dict, args) -> None:
    """Per unit (spec, lever, T) and packing, in plan order: the compile pass over its cases, then
    the timed pass, stock's and gdn-cp's rows side by side; pools open when first needed."""
    groups: dict[tuple, list[dict]] = {}
    for row in planned:
        if row["status"] == "skipped":  # rows already settled (e.g. no TransformerEngine) are not run
            groups.setdefault((row["unit"], row["packing"]), []).append(row)
    for group in groups.values():
        _compile_pass(runner, rows, group, pool_of, setups, args)
        if not args.compile_only:
            for row in _time_order(group):
                _run_row(runner, rows, row, pool_of(row), "time", setups, args)
        for row in group:
            if row.get("status") == "compiled" and not args.compile_only:  # compiled, then the time guard stopped it
                row.update(status="skipped", error=row.get("error") or "time limit after the compile pass")


def te_missing() -> str | None:
    """Why the te spec cannot be built in this Python (None when TransformerEngine is importable).
    Looked up without importing TE (importing it here would initialise CUDA in the main process)."""
    try:
        found = importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return None
    return ("TransformerEngine is not importable here (transformer_engine not on sys.path); the te spec is "
            "Megatron's TE modules (get_gated_delta_net_module_spec). On the GPU machine benchmarks/gpu_suite.sh "
            "puts .site-te on PYTHONPATH (carry .te once: its unpack leaves .site-te for later calls); "
            "or run --spec local")


def _summary(row: dict, phase: str) -> str:
    if row["status"] in ("error", "refused", "skipped"):
        return f"{row['status']}: {str(row['error']).splitlines()[0][:200]}"
    if phase == "compile":
        c = row.get("check")
        return f"compiled in {row['compile_s']:.1f} s" + (
            f"; vs CP=1: out {c['out']:.2e}, grad_x {c['grad_x']:.2e}, params {c['grad_params']:.2e}" if c else "")
    core = row.get("core") or {}
    return (f"median {row['median_ms']:.2f} ms (p10 {row['p10_ms']:.2f}, p90 {row['p90_ms']:.2f})"
            + (f", core {core['median_ms']:.2f} ms" if "median_ms" in core else "")
            + (f", peak {row['peak_gib']:.2f} GiB" if row.get("peak_gib") is not None else "")
            + f", {row['bytes_per_token']:.0f} B/token")


def main(argv=None) -> int:
    args = resolve_args(build_parser().parse_args(argv))
    setup_logging(args.verbose)
    run = {"date": now_iso(), "run_id": f"layer_full-{time.strftime('%Y%m%d-%H%M%S')}",
           "command": " ".join(["layer_full.py", *(sys.argv[1:] if argv is None else argv)]),
           "machine": machine_info(), "versions": versions({"torch_cuda": torch.version.cuda, "fla": fla_version()}),
           "knobs": knobs(args)}
    run["machine"]["gpu_count"] = args.gpus  # the GPU's name is in each row's rank_info (no CUDA context here)
    planned = plan_rows(args, run)
    rows = Rows(args.out, planned)
    no_te = te_missing() if "te" in args.specs else None
    if no_te:
        logger.error("%s", no_te)
        for r in planned:
            if r["spec"] == "te":
                r.update(status="error", error=f"spec te: {no_te}")
                rows.add(r)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, _on_signal)
    runner = Runner(args)
    stopped = None
    specs = [s for s in args.specs if not (s == "te" and no_te)]
    setup = {"dims": asdict(args.dims), "dtype": args.dtype, "seed": args.seed, "specs": specs,
             "linear_cp_backend": args.backend}
    with tempfile.TemporaryDirectory(prefix="layer_full_megatron_", ignore_cleanup_errors=True) as tmp:
        try:
            trees = prepare_megatron_trees(None, Path(tmp))
            setups = {kind: {**setup, "megatron_root": str(trees[kind]), "expect_state": state}
                      for kind, state in (("patched", "patched"), ("stock", "pristine"))}
            run_units(runner, rows, planned, lambda row: "stock" if row["case"] in STOCK_CASES else "patched", setups,
                      args)
        except _Stop as err:
            stopped = runner.stopped = str(err)
            logger.warning("stopped by %s: writing what was collected", stopped)
        finally:
            for s in (signal.SIGTERM, signal.SIGINT):
                signal.signal(s, signal.SIG_IGN)
            runner.close(kill=stopped is not None)
            done = {id(r) for r in rows.new}
            for r in planned:
                if id(r) not in done:
                    if r["status"] == "skipped" or (r["status"] == "compiled" and not args.compile_only):
                        r.update(status="skipped", error=r.get("error") or f"not run ({stopped or 'run ended'})")
                    rows.new.append(r)
            rows.write()
    try:
        from .plot_layer_full import markdown_tables

        print(markdown_tables(rows.kept + rows.new), flush=True)
    except Exception as err:  # noqa: BLE001 - the table must never lose the results
        logger.warning("table failed: %s", err)
    ok = sum(r["status"] == "ok" for r in rows.new)
    print(f"{ok}/{len(rows.new)} cases measured; JSON: {args.out}", flush=True)
    return 0 if stopped is None else 1


if __name__ == "__main__":
    sys.exit(main())
