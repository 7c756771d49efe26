#!/usr/bin/env python
"""Route build time: gdn-cp's interval-intersection route vs megatron-core's per-token builder.

For every (T_global, number of sequences, cp) of the sweep, on one rank (``--rank``, default 1;
every figure is *per rank*: each rank builds its own plan), it times

(a) ``plan``       ``build_thd_route(cu, cp, rank, "zigzag", "contiguous")`` from a CPU int32
                   boundaries tensor: the one host read, validation and interval intersection
                   (O(cp x sequences));
(b) ``plan+index`` (a) then ``route.send_index`` and ``route.recv_index``: the index tensors a
                   layer call gathers with (O(T_local), materialized once per micro-batch);
(c) ``per-token``  megatron-core 0.19.2's ``_build_thd_cp_a2a_perm`` (bucketize and arithmetic
                   over all T_global tokens, on every rank), called from megatron-core when it is
                   importable, else :func:`per_token_perm` below (the same code);
(d) ``full-perm``  for reference: gdn-cp's ``build_natural_order``, which produces exactly the
                   T_global permutation (c) produces (plus this rank's own rows) from the same
                   segment lists; it shows what the route saves by staying per rank.

Before timing, each config is checked once: megatron's permutation and gdn-cp's routes must move
the same rows (see :func:`verify`). A result row has ``agree: true`` only if every check passed.

Timings: warm-up first, then the median of as many repeats as fit a time budget (more repeats for
fast cases). ``--passes N`` runs the whole sweep N times and keeps, per figure, the lowest
median (the machine may be shared; JSON keeps every pass's medians and the load average).
Torch runs single-threaded by default (``--threads``), like one rank's host thread. By default
glibc malloc is told to keep freed memory (``--malloc retain``): otherwise the per-token builder's
~100 MB of temporaries at T=1M may be page-faulted in again on every call, which made the same
call ~25 ms or ~70 ms depending only on the process's allocation history; retaining pins the
cheaper regime (the conservative one for the speed-up). JSON keeps page faults per call.

    python3 -m benchmarks.route_build                 # full sweep -> benchmarks/results/
    python3 -m benchmarks.route_build --quick --out /tmp/rb.json   # smoke run (seconds)
"""

from __future__ import annotations

import argparse
import inspect
import logging
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from gdn_cp.layout import CONTIGUOUS, ZIGZAG, build_natural_order, build_thd_route
from gdn_cp.layout.packings import packed_boundaries

from .measure import retain_freed_memory, time_call
from .common import (
    REPO_ROOT,
    add_out_arguments,
    format_table,
    load_average,
    machine_info,
    now_iso,
    plot_lines,
    resolve_out,
    setup_logging,
    versions,
    write_json,
)

logger = logging.getLogger("benchmarks.route_build")

FULL_T = (32 * 1024, 128 * 1024, 1024 * 1024)
FULL_SEQS = (1, 64, 4096)
FULL_CP = (2, 8)
QUICK_T = (4 * 1024, 32 * 1024)
QUICK_SEQS = (1, 64)
QUICK_CP = (2, 8)

TARGET = {"T_global": 1024 * 1024, "num_sequences": 64, "cp": 8, "min_speedup": 100.0, "max_ms": 1.0}

CONTENTION_RATIO = 1.3

MEGATRON_FUNC = "megatron.core.ssm.gated_delta_net.common._build_thd_cp_a2a_perm"


def per_token_perm(cu_seqlens: torch.Tensor, cp_size: int, t_global: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token THD CP permutation, a line-for-line copy of megatron-core 0.19.2's
    ``_build_thd_cp_a2a_perm`` (megatron/core/ssm/gated_delta_net/common.py, line 565; called
    from megatron/core/ssm/gated_delta_net/gdn.py line 157, every GatedDeltaNet forward on THD
    input with cp > 1). Used only when megatron-core is not importable.

    Returns ``(idx, inv)``: ``idx[g]`` is the row of global (natural-order) row ``g`` in the
    rank-major buffer of zigzag rows that headwise's all-to-all produces; ``inv`` its inverse.
    Every step is a pass over all ``t_global`` tokens.
    """
    cu = cu_seqlens.to(dtype=torch.long)
    t_local = t_global // cp_size

    positions = torch.arange(t_global, device=cu.device)
    seq_idx = torch.bucketize(positions, cu[1:], right=True)
    seq_lens = torch.diff(cu)
    halves = seq_lens // (2 * cp_size)
    local_starts = cu[:-1] // cp_size
    global_starts = cu[:-1]

    half_i = halves[seq_idx]
    pos_in_seq = positions - global_starts[seq_idx]

    natural_chunk = pos_in_seq // half_i
    offset = pos_in_seq - natural_chunk * half_i

    lb_chunk = torch.where(natural_chunk < cp_size, 2 * natural_chunk, 4 * cp_size - 2 * natural_chunk - 1)

    rank = lb_chunk // 2
    half_within_rank = lb_chunk - 2 * rank
    k = half_within_rank * half_i + offset

    idx = rank * t_local + local_starts[seq_idx] + k

    inv = torch.empty_like(idx)
    inv[idx] = positions

    return idx, inv


def resolve_per_token(choice: str):
    """(function, description dict) for the per-token builder: megatron-core's own when asked
    for or available, else :func:`per_token_perm`."""
    if choice in ("auto", "megatron"):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                from megatron.core.ssm.gated_delta_net import common as mg_common
                import megatron.core as mcore
            fn = mg_common._build_thd_cp_a2a_perm
            try:
                src = f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}"
            except (OSError, TypeError):
                src = None
            version = getattr(getattr(mcore, "package_info", None), "__version__", None)
            if version is None:
                try:
                    from importlib.metadata import version as _v

                    version = _v("megatron-core")
                except Exception:  # noqa: BLE001
                    version = None
            return fn, {"impl": "megatron-core", "function": MEGATRON_FUNC, "source": src, "megatron_core": version}
        except (ImportError, AttributeError) as exc:
            if choice == "megatron":
                raise SystemExit(f"--per-token megatron: cannot import {MEGATRON_FUNC}: {exc}")
            logger.info("megatron-core not importable (%s): using the in-benchmark copy", exc)
    return per_token_perm, {
        "impl": "benchmark copy",
        "function": "benchmarks/route_build.py:per_token_perm",
        "mirrors": "megatron/core/ssm/gated_delta_net/common.py:565 _build_thd_cp_a2a_perm (megatron-core 0.19.2)",
        "megatron_core": None,
    }


def _route(cu_tensor, cp, rank):
    return build_thd_route(cu_tensor, cp, rank, ZIGZAG, CONTIGUOUS)


def _route_and_index(cu_tensor, cp, rank):
    r = build_thd_route(cu_tensor, cp, rank, ZIGZAG, CONTIGUOUS)
    return r, r.send_index, r.recv_index


def verify(cu: list[int], cp: int, idx: torch.Tensor, inv: torch.Tensor, ranks) -> dict:
    """Check that megatron's per-token permutation and gdn-cp's plans move the same rows.

    From megatron's ``idx`` (global row -> rank-major zigzag buffer row) every global row's zigzag
    owner is ``idx // T_local`` and rank p's zigzag rows, in local order, are
    ``inv[p*T_local:(p+1)*T_local]``. For each rank r in ``ranks``, the zigzag -> contiguous
    route must then

    - send: ``x_local[send_index]`` = r's global rows in increasing order, split per contiguous
      owner exactly as ``send_splits``;
    - receive: with the buffer laid out as every peer sends (per source peer in rank order, that
      peer's rows in global order, sizes ``recv_splits``), ``buffer[recv_index]`` = global rows
      ``[r*T_local, (r+1)*T_local)``;

    and gdn-cp's ``build_natural_order`` must equal megatron's ``idx`` and ``inv`` exactly.
    """
    t_global = cu[-1]
    t_local = t_global // cp
    owner = idx // t_local
    checks = {"idx_is_permutation": bool(torch.equal(torch.sort(idx).values, torch.arange(t_global)))}
    route_ok = True
    for r in ranks:
        route = build_thd_route(torch.tensor(cu, dtype=torch.int32), cp, r, ZIGZAG, CONTIGUOUS)
        x_local = inv[r * t_local : (r + 1) * t_local]  # global rows, zigzag local order
        sent = x_local if route.send_index is None else x_local[route.send_index]
        want_sent = torch.nonzero(owner == r).flatten()
        want_send_splits = tuple(torch.bincount(want_sent // t_local, minlength=cp).tolist())
        rows = torch.arange(r * t_local, (r + 1) * t_local)
        src = owner[rows]
        buffer = rows[torch.sort(src, stable=True).indices]
        want_recv_splits = tuple(torch.bincount(src, minlength=cp).tolist())
        got = buffer if route.recv_index is None else buffer[route.recv_index]
        ok = (
            torch.equal(sent, want_sent)
            and route.send_splits == want_send_splits
            and route.recv_splits == want_recv_splits
            and torch.equal(got, rows)
        )
        if not ok:
            logger.error("route mismatch: cp=%d rank=%d T=%d seqs=%d", cp, r, t_global, len(cu) - 1)
        route_ok &= bool(ok)
    checks["route_matches_per_token"] = route_ok
    nat_ok = True
    for r in ranks:
        nat = build_natural_order(cu, cp, r)
        own = inv[r * t_local : (r + 1) * t_local]
        nat_ok &= bool(torch.equal(nat.to_natural, idx) and torch.equal(nat.to_buffer, inv) and torch.equal(nat.own_rows, own))
    checks["natural_order_equals_per_token"] = nat_ok
    checks["ranks_checked"] = list(ranks)
    return checks


_UNITS = {"": 1, "K": 1024, "M": 1024 * 1024}


def _fmt_t(t: int) -> str:
    """32768 -> '32K', 1048576 -> '1M', 1000 -> '1000': how the table, the plot and --help write T."""
    for unit in ("M", "K"):
        if t % _UNITS[unit] == 0:
            return f"{t // _UNITS[unit]}{unit}"
    return str(t)


def token_count(text: str) -> int:
    """``--t``: a T as the help and the table write it: digits, optionally K (1024) or M (1024*1024)."""
    found = re.fullmatch(r"([0-9]+)([KkMm]?)", text.strip())
    if not found or int(found.group(1)) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count: use digits with an optional K (x1024) or "
                                         "M (x1024*1024), e.g. 32K 128K 1M or 4096")
    return int(found.group(1)) * _UNITS[found.group(2).upper()]


METHODS = ("plan", "plan_index", "per_token", "full_perm")


def _new_row(args, cu, cu_tensor, cp, t_global, nseq, per_token) -> dict:
    """A config's row, after checking once that megatron's permutation and gdn-cp's routes move the same rows."""
    idx, inv = per_token(cu_tensor, cp, t_global)
    ranks = range(cp) if args.verify_all_ranks else sorted({0, args.rank, cp - 1})
    checks = verify(cu, cp, idx, inv, ranks)
    del idx, inv
    route = _route(cu_tensor, cp, args.rank)
    return {
        "T_global": t_global,
        "num_sequences": nseq,
        "nonempty_sequences": sum(1 for a, b in zip(cu, cu[1:]) if b > a),
        "cp": cp,
        "rank": args.rank,
        "T_local": t_global // cp,
        "route_pieces": {"send": len(route.send_transfers), "recv": len(route.recv_transfers)},
        "agree": all(v for k, v in checks.items() if k != "ranks_checked"),
        "checks": checks,
        "passes": {m: [] for m in METHODS},
        "cpu_passes": {m: [] for m in METHODS},
        "repeats": {m: [] for m in METHODS},
        "minor_faults_per_call": {m: [] for m in METHODS},
    }


def _time_pass(args, row, fns) -> None:
    """One pass of every method into ``row``; the figures kept are those of the lowest-median pass."""
    for m in METHODS:
        res = time_call(fns[m], budget_s=args.budget, min_repeats=args.min_repeats, max_repeats=args.max_repeats)
        row["passes"][m].append(res["median_ms"])
        row["cpu_passes"][m].append(res["cpu_median_ms"])
        row["repeats"][m].append(res["repeats"])
        row["minor_faults_per_call"][m].append(res["minor_faults_per_call"])
    for m in METHODS:
        best = min(range(len(row["passes"][m])), key=row["passes"][m].__getitem__)
        row[f"{m}_ms"] = row["passes"][m][best]
        row[f"{m}_cpu_ms"] = row["cpu_passes"][m][best]
    row["speedup"] = row["per_token_ms"] / row["plan_index_ms"]
    row["speedup_plan_only"] = row["per_token_ms"] / row["plan_ms"]


def _target(results: list[dict]):
    """The target config's figures and whether they meet :data:`TARGET` (None where the sweep lacks it)."""
    target = None
    for r in results:
        if (r["T_global"], r["num_sequences"], r["cp"]) == (TARGET["T_global"], TARGET["num_sequences"], TARGET["cp"]):
            target = dict(TARGET)
            target.update(
                plan_ms=r["plan_ms"],
                plan_index_ms=r["plan_index_ms"],
                per_token_ms=r["per_token_ms"],
                speedup=r["speedup"],
                speedup_plan_only=r["speedup_plan_only"],
                met=bool(r["speedup"] >= TARGET["min_speedup"] and r["plan_index_ms"] < TARGET["max_ms"]),
                met_plan_only=bool(r["speedup_plan_only"] >= TARGET["min_speedup"] and r["plan_ms"] < TARGET["max_ms"]),
            )
    return target


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    malloc_retain = retain_freed_memory() if args.malloc == "retain" else False
    if args.malloc == "retain" and not malloc_retain:
        logger.warning("--malloc retain: not glibc (mallopt unavailable); allocator left as is")
    per_token, per_token_info = resolve_per_token(args.per_token)
    configs = [(t, n, cp) for t in args.t for n in args.seqs for cp in args.cp]
    logger.info(
        "route_build: %d configs x %d pass(es), rank %d, %d torch thread(s), per-token = %s",
        len(configs), args.passes, args.rank, args.threads, per_token_info["impl"],
    )
    load_before = load_average()
    rows: dict[tuple, dict] = {}
    started = time.perf_counter()
    for p in range(args.passes):
        for i, (t_global, nseq, cp) in enumerate(configs):
            if args.rank >= cp:
                raise SystemExit(f"--rank {args.rank} is not < cp={cp}")
            cu = packed_boundaries(nseq, t_global, cp, args.seed)
            cu_tensor = torch.tensor(cu, dtype=torch.int32)
            key = (t_global, nseq, cp)
            row = rows.get(key)
            if row is None:
                row = rows[key] = _new_row(args, cu, cu_tensor, cp, t_global, nseq, per_token)
            fns = {
                "plan": lambda: _route(cu_tensor, cp, args.rank),
                "plan_index": lambda: _route_and_index(cu_tensor, cp, args.rank),
                "per_token": lambda: per_token(cu_tensor, cp, t_global),
                "full_perm": lambda: build_natural_order(tuple(cu), cp, args.rank),
            }
            _time_pass(args, row, fns)
            logger.info(
                "[pass %d/%d, %2d/%d] T=%-5s seqs=%-4d cp=%d  plan %.3f ms  plan+index %.3f ms  per-token %.3f ms"
                "  full-perm %.3f ms  (x%.2f)%s",
                p + 1, args.passes, i + 1, len(configs), _fmt_t(t_global), nseq, cp,
                row["passes"]["plan"][-1], row["passes"]["plan_index"][-1], row["passes"]["per_token"][-1],
                row["passes"]["full_perm"][-1], row["per_token_ms"] / row["plan_index_ms"],
                "" if row["agree"] else "  DISAGREE",
            )
    results = list(rows.values())
    target = _target(results)
    return {
        "benchmark": "route_build",
        "description": (
            "Per-rank time to build the zigzag->contiguous THD route (gdn-cp, interval intersection) "
            "vs megatron-core 0.19.2's per-token _build_thd_cp_a2a_perm; ms, lower median of passes"
        ),
        "date": now_iso(),
        "duration_s": round(time.perf_counter() - started, 1),
        "machine": machine_info(),
        "versions": versions({"megatron_core": per_token_info.get("megatron_core")}),
        "settings": {
            "quick": args.quick,
            "rank": args.rank,
            "per_rank": True,
            "threads": args.threads,
            "passes": args.passes,
            "budget_s": args.budget,
            "min_repeats": args.min_repeats,
            "max_repeats": args.max_repeats,
            "seed": args.seed,
            "malloc": args.malloc,
            "malloc_retain_applied": malloc_retain,
            "boundaries": "gdn_cp.layout.packings.packed_boundaries(num_sequences, T_global, cp, seed), int32 CPU tensor",
            "statistic": "median wall time per pass; the lowest median over passes is reported "
            "(*_cpu_ms: the calling thread's median CPU time in that pass, a contention check)",
        },
        "methods": {
            "plan": "build_thd_route(cu, cp, rank, 'zigzag', 'contiguous'): host read + validation + intersection",
            "plan_index": "plan, then route.send_index and route.recv_index (materialized once per micro-batch)",
            "per_token": per_token_info,
            "full_perm": "gdn_cp.layout.build_natural_order: the same T_global permutation as per_token",
        },
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "all_agree": all(r["agree"] for r in results),
        "target": target,
        "results": results,
    }


TABLE_HEADERS = ("T", "seqs", "cp", "ours plan ms", "ours plan+index ms", "per-token ms", "speed-up", "speed-up (plan)", "full-perm ms", "agree")


def table_rows(report: dict) -> list[list]:
    return [
        [
            _fmt_t(r["T_global"]), r["num_sequences"], r["cp"], r["plan_ms"], r["plan_index_ms"], r["per_token_ms"],
            f"{r['speedup']:.0f}x" if r["speedup"] >= 10 else f"{r['speedup']:.2f}x",
            f"{r['speedup_plan_only']:.0f}x" if r["speedup_plan_only"] >= 10 else f"{r['speedup_plan_only']:.2f}x",
            r["full_perm_ms"], "yes" if r["agree"] else "NO",
        ]
        for r in report["results"]
    ]


def make_plot(report: dict, path) -> bool:
    sel = sorted(
        (r for r in report["results"] if r["num_sequences"] == 64 and r["cp"] == 8), key=lambda r: r["T_global"]
    )
    if len(sel) < 2:
        logger.info("plot skipped: fewer than 2 configs with 64 sequences, cp=8")
        return False
    x = [r["T_global"] for r in sel]
    series = {
        "ours: plan": [r["plan_ms"] for r in sel],
        "ours: plan + index tensors": [r["plan_index_ms"] for r in sel],
        "per-token (megatron-core _build_thd_cp_a2a_perm)": [r["per_token_ms"] for r in sel],
        "ours: full T_global permutation (reference)": [r["full_perm_ms"] for r in sel],
    }
    m = report["machine"]
    return plot_lines(
        path, x, series,
        title=f"THD route build per rank: 64 sequences, cp=8\n{m['cpu_model']}, {report['settings']['threads']} thread(s)",
        xlabel="T_global (tokens)", ylabel="time per rank (ms, median)",
        xticklabels=[_fmt_t(v) for v in x],
    )


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=(
            "Per-rank THD route build time: gdn-cp's interval-intersection route (plan, plan + index "
            "tensors) vs megatron-core 0.19.2's per-token _build_thd_cp_a2a_perm. Prints a table, "
            "writes JSON (and a PNG plot with matplotlib)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--quick", action="store_true", help="small smoke run (T in 4K,32K; seqs 1,64; short budgets)")
    add_out_arguments(ap, "route_build.json", "JSON path (--quick: default $TMPDIR/route_build_quick.json)")
    ap.add_argument("--plot", type=Path, default=None, help="PNG path (default: next to --out, .png)")
    ap.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    ap.add_argument("--t", type=token_count, nargs="+", default=None,
                    help=f"T_global values, digits with an optional K (x1024) or M (x1024*1024) (default "
                    f"{' '.join(map(_fmt_t, FULL_T))}; --quick: {' '.join(map(_fmt_t, QUICK_T))})")
    ap.add_argument("--seqs", type=int, nargs="+", default=None,
                    help=f"numbers of sequences (default {' '.join(map(str, FULL_SEQS))})")
    ap.add_argument("--cp", type=int, nargs="+", default=None, help=f"cp sizes (default {' '.join(map(str, FULL_CP))})")
    ap.add_argument("--rank", type=int, default=1, help="the rank whose plan is timed")
    ap.add_argument("--passes", type=int, default=None, help="sweeps; lowest median kept (default 2; 1 with --quick)")
    ap.add_argument("--budget", type=float, default=None, help="seconds of timed calls per figure (default 0.5; 0.02 quick)")
    ap.add_argument("--min-repeats", type=int, default=None, help="fewest timed calls per figure (default 7; 3 quick)")
    ap.add_argument("--max-repeats", type=int, default=2000, help="most timed calls per figure")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--seed", type=int, default=0, help="seed of the packed boundaries")
    ap.add_argument("--malloc", choices=("retain", "default"), default="retain",
                    help="retain: glibc keeps freed memory (no per-call page faults; the stable, cheaper "
                    "regime for the per-token builder's large temporaries); default: leave malloc as is")
    ap.add_argument("--per-token", choices=("auto", "megatron", "copy"), default="auto",
                    help="per-token builder: megatron-core's own (auto: if importable) or the benchmark's copy")
    ap.add_argument("--verify-all-ranks", action="store_true", help="check every rank's route (default: 0, --rank, cp-1)")
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = ap.parse_args(argv)
    args.t = args.t or list(QUICK_T if args.quick else FULL_T)
    args.seqs = args.seqs or list(QUICK_SEQS if args.quick else FULL_SEQS)
    args.cp = args.cp or list(QUICK_CP if args.quick else FULL_CP)
    args.passes = args.passes or (1 if args.quick else 2)
    args.budget = args.budget if args.budget is not None else (0.02 if args.quick else 0.5)
    args.min_repeats = args.min_repeats or (3 if args.quick else 7)
    if args.quick and args.out is None and not args.replace:
        args.out = Path(tempfile.gettempdir()) / "route_build_quick.json"
    args.out = resolve_out(args, "route_build.json", ap)
    if args.plot is None:
        args.plot = args.out.with_suffix(".png")
    return args


def _display_path(path) -> str:
    """Repo-relative path when under the repo (so results do not name this machine's folders)."""
    try:
        return str(Path(path).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_logging(args.verbose)
    report = run(args)
    report["settings"]["command"] = "python3 -m benchmarks.route_build " + " ".join(sys.argv[1:] if argv is None else argv)
    plotted = False
    if not args.no_plot:
        plotted = make_plot(report, args.plot)
    report["plot"] = _display_path(args.plot) if plotted else None
    # Only meaningful with one torch thread (else CPU time of the calling thread is not the work).
    report["contended"] = [] if args.threads != 1 else [
        f"{_fmt_t(r['T_global'])}/{r['num_sequences']}/cp{r['cp']} {m} (wall {r[m + '_ms']:.3g} ms, cpu {r[m + '_cpu_ms']:.3g} ms)"
        for r in report["results"]
        for m in ("plan", "plan_index", "per_token")
        if r[m + "_ms"] > CONTENTION_RATIO * r[m + "_cpu_ms"]
    ]
    write_json(args.out, report)
    m = report["machine"]
    print()
    print(
        f"THD route build, per rank (rank {args.rank}), zigzag -> contiguous; ms = lowest of {args.passes} "
        f"pass median(s); {args.threads} torch thread(s)"
    )
    print(f"machine: {m['cpu_model']}, {m['usable_cores']} usable cores; torch {report['versions']['torch']}; "
          f"per-token = {report['methods']['per_token']['impl']}")
    print(f"load average before {report['load_average_before']}, after {report['load_average_after']}")
    print("speed-up = per-token / ours plan+index; speed-up (plan) = per-token / ours plan")
    print(format_table(TABLE_HEADERS, table_rows(report)))
    t = report["target"]
    if t is not None:
        print(
            f"target (T=1M, 64 seqs, cp=8: >= {t['min_speedup']:.0f}x and < {t['max_ms']} ms): "
            f"plan+index {t['plan_index_ms']:.3f} ms, x{t['speedup']:.0f} -> {'MET' if t['met'] else 'MISSED'}; "
            f"plan only {t['plan_ms']:.3f} ms, x{t['speedup_plan_only']:.0f} -> {'MET' if t['met_plan_only'] else 'MISSED'}"
        )
    contended = report["contended"]
    if contended:
        print(f"WARNING: wall > {CONTENTION_RATIO}x CPU time (process descheduled: shared machine) for: " + "; ".join(contended))
    print(f"all configs agree with the per-token permutation: {report['all_agree']}")
    print(f"wrote {args.out}" + (f" and {args.plot}" if plotted else ""))
    return 0 if report["all_agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
