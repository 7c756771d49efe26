#!/usr/bin/env python
"""Markdown tables from ``layer_full.py`` rows, and a PNG of the ``--cp 1`` per-rank rows by kernel class; merges
row files from several device calls.

    python3 -m benchmarks.plot_layer_full a.json b.json --merge-out benchmarks/results/layer_full.json
    python3 -m benchmarks.plot_layer_full benchmarks/results/layer_full_glue.json NEW.json --keep-runs \
        --merge-out benchmarks/results/layer_full_glue.json --md /tmp/tables.md --png /tmp/layer_full_glue.png

Merging: files are read in order; the rows of a later file replace every earlier row of the same run
(``layer_full_math.run_key``: machine size, CP, T, dtype, shape, compile-only or timed, spec, FLA version), so
re-running a T replaces its rows; ``--keep-runs`` keeps every run's rows instead (``layer_full_glue.json``, whose
every run compares glue variants: tests/ops/test_glue_default.py reads each run apart). ``--cp 1`` rows get one
table (:func:`per_rank_summary`: stock and gdn-cp side by side per run, stack, spec, T and rank slice, each lever's
off / on ratio). The markdown table (for the README) gives, per (T, packing), each case's median fwd+bwd time of
the whole layer, its ratio to stock headwise (< 1 is faster) and the fraction of the ideal it reaches
(``cp1_slice`` median / case median: 100% = as fast as CP=1 on the critical rank's own slice with no
communication). A second table says where the time goes. Runs on the CPU.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from gdn_cp_testing.results import picks_glue_path

from .common import pyplot, save_figure, write_json
from .layer_full_math import CASES as CP_CASES, CP1_CASES, case_key, run_key
from .measure import CLASS_NAMES, fmt_tokens as _fmt_t

CASES = CP_CASES + CP1_CASES
LABELS = {"stock_headwise": "stock headwise", "headwise": "headwise", "chunkwise_hidden": "chunkwise (hidden swap)",
          "chunkwise_core": "chunkwise (core swap)", "chunkwise_generic": "chunkwise (hidden, gdn-cp exchange)",
          "all_gather": "all_gather", "cp1_slice": "ideal: CP=1 on own slice",
          "stock_cp1": "stock CP=1", "patched_cp1": "gdn-cp CP=1", "stock_slice": "stock CP=1 slice",
          "patched_slice": "gdn-cp CP=1 slice"}


def _base(key: str) -> str:
    """``patched_slice[r1]|te|-fused_norm`` -> ``patched_slice``."""
    return key.split("[", 1)[0].split("|", 1)[0]


def _stock_key(key: str) -> str:
    """The stock row a patched row is compared with: same rank slice and spec, no lever off:
    ``patched_slice[r1]|te|-fused_norm`` -> ``stock_slice[r1]|te``."""
    parts = [p for p in key.replace("patched", "stock", 1).split("|") if not p.startswith("-")]
    return "|".join(parts)


def _stack(row: dict) -> str:
    """The software stack and the GPU (rows of two GPUs are two measurements): ``fla 0.4.2 + triton 3.6.0, H100``."""
    versions = row.get("versions") or {}
    gpu = re.search(r"\b[A-Z]\d{2,4}\b", versions.get("gpu") or "")
    return (row.get("stack") or f"fla {versions.get('fla')}") + (f", {gpu.group(0)}" if gpu else "")


def _label(key: str) -> str:
    base = _base(key)
    return LABELS.get(base, base) + key[len(base):]


def _num(v, f: str = "{:.2f}") -> str:
    return "-" if v is None else f.format(v)


def _md_table(head: list, aligns: str, body) -> list[str]:
    """A markdown table's lines: ``head``, its rule (``aligns``: ``l`` or ``r`` per column) and a line per row."""
    line = lambda cells: "| " + " | ".join(map(str, cells)) + " |"  # noqa: E731
    return [line(head), "|" + "".join("---:|" if a == "r" else "---|" for a in aligns), *map(line, body)]


def _ordered(keys) -> list[str]:
    """Case keys in report order (CASES, then slice rank)."""
    order = {c: i for i, c in enumerate(CASES)}
    return sorted(set(keys), key=lambda k: (order.get(_base(k), len(order)), k))


def class_table(rows) -> str:
    """Where each profiled row's time goes by kernel class (``layer_full_math``'s profile:
    ``classes_ms``, ms per iteration of the critical rank), against its floor: the GEMMs. Empty
    without such rows."""
    have = [r for r in rows if r.get("status") == "ok" and r.get("classes_ms")]
    if not have:
        return ""
    body = [[_stack(r), r.get("spec") or "local", _fmt_t(r["T"]), r["packing"], _label(case_key(r)), f"{r['median_ms']:.2f}",
             *(f"{r['classes_ms'].get(c, 0.0):.2f}" for c in CLASS_NAMES),
             _num(r["median_ms"] / r["classes_ms"]["gemm"] if r["classes_ms"].get("gemm") else None)]
            for r in sorted(have, key=lambda r: (_stack(r), r.get("spec") or "local", r["T"], r["packing"], case_key(r)))]
    return "\n".join(["**Where the time goes, by kernel class** (ms per iteration of the profiled iterations, critical "
                      "rank; the GEMMs are the floor: the projections; `gdn` = the gated delta rule's kernels, FLA's or "
                      "FlashQLA's; `gdn-cp glue` = gdn-cp's Triton kernels, `compiled glue` = torch.compile's: the conv + "
                      "split + l2 norm and gates)\n",
                      *_md_table(["stack", "spec", "T", "packing", "case", "median", *CLASS_NAMES, "median / GEMM"],
                                 "lllllr" + "r" * (len(CLASS_NAMES) + 1), body), ""])


def load_rows(paths, keep_runs: bool = False) -> list[dict]:
    """Rows of every file, later files replacing earlier rows of the same run; ``keep_runs``: every device run's
    rows kept side by side instead (a file's rows whose ``run_id`` is already there are not added twice)."""
    rows: list[dict] = []
    for path in paths:
        new = json.loads(Path(path).read_text())
        if not isinstance(new, list):
            raise ValueError(f"{path} is not a list of layer_full rows (got {type(new).__name__})")
        if keep_runs:
            seen = {r.get("run_id") for r in rows}
            rows += [r for r in new if r.get("run_id") not in seen]
            continue
        keys = {run_key(r) for r in new}
        rows = [r for r in rows if run_key(r) not in keys] + new
    return rows


def _groups(rows):
    """{(device, gpus, backend, cp, dtype, stack): {(T, packing): {case: row}}} of the measured rows."""
    out: dict = {}
    for r in rows:
        if r.get("status") != "ok":
            continue
        g = (r.get("device"), r.get("gpus"), r.get("backend"), r.get("cp"), r.get("knobs", {}).get("dtype"), _stack(r))
        out.setdefault(g, {}).setdefault((r["T"], r["packing"]), {})[case_key(r)] = r
    return out


def _cell(row, stock, ideal) -> str:
    if row is None:
        return "-"
    text = f"{row['median_ms']:.2f}"
    extra = []
    if stock is not None and row is not stock:
        extra.append(f"{row['median_ms'] / stock['median_ms']:.2f}x")
    if ideal is not None and row["case"] != "cp1_slice":
        extra.append(f"{100 * ideal['median_ms'] / row['median_ms']:.0f}%")
    return text + (f" ({', '.join(extra)})" if extra else "")


def _where_row(t, name, case, r) -> list:
    """A row of the table of where a case's time goes (``markdown_tables``)."""
    chk = r.get("check") or {}
    return [_fmt_t(t), name, _label(case), f"{r['median_ms']:.2f}", f"{r['p10_ms']:.2f}-{r['p90_ms']:.2f}",
            _num((r.get("core") or {}).get("median_ms")),
            *(_num(r.get(k)) for k in ("compute_ms", "comm_wait_ms", "memcpy_ms", "idle_ms")),
            _num(r.get("bytes_per_token"), "{:.0f}"), _num(r.get("peak_gib")),
            "-" if not chk else f"{chk['out']:.1e} / {max(chk['grad_x'], chk['grad_params']):.1e}"]


def markdown_tables(rows) -> str:
    """README tables: medians with (x stock, % of ideal), then where the time goes."""
    parts = []
    summary = per_rank_summary(rows)
    if summary:
        parts.append(summary)
    classes = class_table(rows)
    if classes:
        parts.append(classes)
    for (device, gpus, backend, cp, dtype, stack), by_tp in sorted(_groups(rows).items(), key=str):
        any_row = next(iter(next(iter(by_tp.values())).values()))
        gpu = any_row.get("rank_info", {}).get("gpu") or any_row.get("machine", {}).get("cpu_model")
        cases = _ordered(k for v in by_tp.values() for k in v)
        if cp == 1:  # per_rank_summary's rows
            continue
        parts.append(f"**GatedDeltaNet fwd+bwd, CP={cp}** ({gpus} x {gpu}, {backend}, {dtype}; median ms of the "
                     f"slowest rank per iteration over {any_row['iters']} iterations; "
                     f"(time / stock headwise, ideal / time))\n")
        parts += _md_table(["T", "packing", *map(_label, cases)], "ll" + "r" * len(cases),
                           [[_fmt_t(t), name, *(_cell(by_case.get(c), by_case.get("stock_headwise"), by_case.get("cp1_slice"))
                                                for c in cases)] for (t, name), by_case in sorted(by_tp.items())])
        parts.append("\nWhere the time goes (critical rank, ms per iteration from the profiled iterations; "
                     "B/token = bytes leaving a rank per fwd+bwd / T_local, max over ranks):\n")
        parts += _md_table(["T", "packing", "case", "median", "p10-p90", "core", "compute", "NCCL", "memcpy", "idle",
                            "B/token", "peak GiB", "vs CP=1 (out / grad)"], "lll" + "r" * 10,
                           [_where_row(t, name, c, by_case[c]) for (t, name), by_case in sorted(by_tp.items())
                            for c in cases if c in by_case])
        parts.append("")
    compiled = [r for r in rows if r.get("status") == "compiled"]
    if compiled:
        parts.append("Compile pass only (no timing): first fwd+bwd in seconds (compile and autotune included), "
                     "and the case against CP=1 (relative L2, max over ranks):\n")
        e = lambda c, k: "-" if k not in c else f"{c[k]:.1e}"  # noqa: E731
        parts += _md_table(["CP", "T", "packing", "case", "compile s", "out", "grad x", "grad params"], "rlllrrrr",
                           [[r["cp"], _fmt_t(r["T"]), r["packing"], _label(case_key(r)), f"{r.get('compile_s', 0):.1f}",
                             *(e(r.get("check") or {}, k) for k in ("out", "grad_x", "grad_params"))] for r in compiled])
        parts.append("")
    not_ok = [r for r in rows if r.get("status") not in ("ok", "compiled")]
    if not_ok:
        parts.append(f"Not measured: {len(not_ok)} case(s): " + "; ".join(
            f"T={_fmt_t(r['T'])} {r['packing']} {case_key(r)}: {r['status']} ({str(r.get('error')).splitlines()[0][:80]})"
            for r in not_ok[:12]))
    return "\n".join(parts) if parts else "no measured rows"


def per_rank_summary(rows) -> str:
    """The table of ``--cp 1`` rows: per run, stack, spec, T, packing and rows (the whole packing or one rank's slice),
    stock and gdn-cp on the same rows and weights: median (p10-p90), gdn-cp / stock in time and peak memory, the
    core alone, kernels and idle per iteration (profiled), and gdn-cp with each lever off (its time / the time with
    every lever on: > 1 means the lever pays). Empty without such rows."""
    ok = [r for r in rows if r.get("status") == "ok" and r.get("cp") == 1]
    patched = [r for r in ok if r["case"].startswith("patched") and not r.get("lever_off")]
    if not patched:
        return ""
    where = lambda r: (r.get("run_id", ""), _stack(r), r.get("spec") or "local", r["T"], r["packing"], r["case"].split("_", 1)[1],  # noqa: E731
                       -1 if r.get("slice_rank") is None else r["slice_rank"])
    index = {(*where(r), r.get("lever_off"), r["case"].startswith("stock")): r for r in ok}
    levers = sorted({r["lever_off"] for r in ok if r.get("lever_off")})

    def both(stock, r, f):  # "stock / gdn-cp" of one quantity
        return f"{_num(None if stock is None else f(stock))} / {_num(f(r))}"

    def spread(r):
        return f"{r['median_ms']:.2f} ({r['p10_ms']:.2f}-{r['p90_ms']:.2f})"

    kernels = lambda r: sum((r.get("kernels_per_iter") or {}).values()) or None  # noqa: E731
    body = []
    for r in sorted(patched, key=where):
        stock = index.get((*where(r), None, True))
        mem = None if stock is None or not stock.get("peak_gib") or r.get("peak_gib") is None else \
            r["peak_gib"] / stock["peak_gib"]
        offs = [index.get((*where(r), lv, False)) for lv in levers]
        body.append([r.get("run_id", "-").removeprefix("layer_full-"), _stack(r),
                     r.get("knobs", {}).get("linear_cp_backend") or "auto", r.get("spec") or "local", _fmt_t(r["T"]),
                     r["packing"], "all" if r.get("slice_rank") is None else f"rank {r['slice_rank']} of CP={r.get('slice_of_cp')}",
                     "-" if stock is None else spread(stock), spread(r),
                     _num(None if stock is None else r["median_ms"] / stock["median_ms"], "{:.3f}"),
                     *("-" if off is None else f"{off['median_ms']:.2f} ({off['median_ms'] / r['median_ms']:.3f})" for off in offs),
                     _num((r.get("core") or {}).get("median_ms")), both(stock, r, kernels).replace(".00", ""),
                     both(stock, r, lambda x: x.get("idle_ms")), both(stock, r, lambda x: x.get("peak_gib")),
                     _num(mem, "{:.3f}"), str(r.get("norm_path") or "-").split(":", 1)[0]])
    head = ["run", "stack", "gdn-cp backend", "spec", "T", "packing", "rows", "stock ms", "gdn-cp ms", "/ stock",
            *(f"{lv} off ms (off / on)" for lv in levers), "core ms", "kernels stock / gdn-cp", "idle ms stock / gdn-cp",
            "peak GiB stock / gdn-cp", "/ stock", "gdn-cp norm"]
    return "\n".join(["**Per rank, stock megatron-core 0.19.2 and gdn-cp on the same rows and weights** (median ms of "
                      "the fwd+bwd (p10-p90); kernels and idle per iteration of the profiled iterations)\n",
                      *_md_table(head, "llllrll" + "r" * (8 + len(levers)) + "l", body), ""])


CLASS_COLORS = {"communication": "tab:orange", "gemm": "tab:blue", "conv": "tab:red", "gdn": "tab:green",
                "norm": "tab:olive", "gdn-cp glue": "tab:cyan", "compiled glue": "tab:pink",
                "elementwise + copies": "tab:purple", "memcpy": "tab:brown", "idle": "lightgray"}


PANELS_PER_ROW = 4


def plot_per_rank(rows, path) -> bool:
    """The ``--cp 1`` slice rows as stacked bars by kernel class (ms per iteration): one panel per (run, spec,
    T), :data:`PANELS_PER_ROW` to a row, a bar per rank and case (stock, gdn-cp, each lever off), the median marked. False without matplotlib
    or without such rows (said on stderr)."""
    plt = pyplot()
    if plt is None:
        return False
    panels = {}
    for r in rows:
        if r.get("status") == "ok" and r.get("case") in ("stock_slice", "patched_slice") and r.get("classes_ms"):
            panels.setdefault((r["run_id"], r.get("spec") or "local", r["T"]), []).append(r)
    if not panels:
        print("no profiled --cp 1 slice rows: no plot", file=sys.stderr)
        return False
    panels = sorted(panels.items(), key=str)
    width = 2 + 0.45 * max(len(group) for _, group in panels)  # a panel as wide as the most bars
    cols = min(PANELS_PER_ROW, len(panels))
    rows_of_panels = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows_of_panels, cols, figsize=(cols * width + 1.5, 5.5 * rows_of_panels), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, ((run, spec, t), group) in zip(axes.flat, panels):
        group.sort(key=lambda r: (r.get("slice_rank"), r["case"] != "stock_slice", r.get("lever_off") or ""))
        xs, bottoms = range(len(group)), [0.0] * len(group)
        for cls in CLASS_NAMES:
            vals = [r["classes_ms"].get(cls, 0.0) for r in group]
            if any(vals):
                ax.bar(xs, vals, 0.8, bottom=bottoms, color=CLASS_COLORS.get(cls, "black"), label=cls)
                bottoms = [b + v for b, v in zip(bottoms, vals)]
        ax.scatter(xs, [r["median_ms"] for r in group], marker="_", s=300, color="black", label="median fwd+bwd", zorder=3)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([_bar_label(r) for r in group], rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("ms per iteration (profiled, by kernel class)")
        ax.set_title(f"{spec} spec, {_fmt_t(t)} tokens, CP=2 rank slices\n{run}", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][cols - 1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return save_figure(fig, path)


def _bar_label(row: dict) -> str:
    """``r0 stock``, ``r1 gdn-cp triton``, ``r0 gdn-cp triton -split_cat`` (a lever that only picks the glue path
    is named by the path)."""
    if row["case"] == "stock_slice":
        return f"r{row.get('slice_rank')} stock"
    lever = row.get("lever_off")
    shown = f" -{lever}" if lever and not picks_glue_path(lever) else ""
    return f"r{row.get('slice_rank')} gdn-cp {row.get('glue', '')}{shown}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", type=Path, nargs="+", help="layer_full.py row files (later ones win)")
    ap.add_argument("--merge-out", type=Path, default=None, help="write the merged rows here")
    ap.add_argument("--keep-runs", action="store_true",
                    help="keep every run's rows (layer_full_glue.json: each run compares its variants) instead of "
                    "a later run replacing an earlier one's")
    ap.add_argument("--md", type=Path, default=None, help="markdown tables (default: print them)")
    ap.add_argument("--png", type=Path, default=None,
                    help="also draw the --cp 1 slice rows by kernel class here (needs matplotlib)")
    args = ap.parse_args(argv)
    rows = load_rows(args.json, keep_runs=args.keep_runs)
    if args.merge_out:
        write_json(args.merge_out, rows)
        print(f"merged {len(rows)} rows into {args.merge_out}")
    text = markdown_tables(rows)
    if args.md:
        args.md.write_text(text + "\n")
        print(f"tables: {args.md}")
    else:
        print(text)
    if args.png and plot_per_rank(rows, args.png):
        print(f"plot: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
