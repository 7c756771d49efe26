#!/usr/bin/env python
"""Plot a ``layer_bench.py`` JSON: wall time, kernel compute time and peak memory vs T_global, one
line per (mode, cp); cp=1 (the same local core for every mode) is the black baseline. Runs on the
CPU, so results fetched from the GPU machine can be re-plotted here.

    python benchmarks/plot_layer.py benchmarks/results/layer_bench.json [--out plot.png]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import save_figure  # noqa: E402

logger = logging.getLogger("benchmarks.plot_layer")

MODE_COLORS = {"chunkwise": "tab:blue", "headwise": "tab:orange", "all_gather": "tab:red", "cp1": "black"}
CP_STYLES = {1: "-", 2: "--", 4: ":", 8: "-."}
PANELS = (
    ("wall_ms", "fwd+bwd wall time (ms)", "wall time (slowest rank, median)"),
    ("compute_ms", "kernel time (ms)", "compute: CUDA kernels per rank (max over ranks)"),
    ("peak_gib", "peak allocated (GiB)", "peak memory per rank (max over ranks)"),
)


def _series(report: dict, key: str) -> dict[tuple[str, int], list[tuple[int, float]]]:
    out: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for c in report.get("cases", []):
        if c.get("status") != "ok" or c.get("slice_of") or c.get(key) is None:
            continue
        out.setdefault((c["mode"], c["cp"]), []).append((c["t_global"], float(c[key])))
    return {k: sorted(v) for k, v in out.items()}


def _fmt_t(t: float) -> str:
    t = int(t)
    return f"{t // 1024}K" if t % 1024 == 0 else str(t)


def plot_report(report: dict, path) -> bool:
    """Write the figure to ``path``; False (logged) without matplotlib or without any number."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib not installed: no plot written (pip install matplotlib)")
        return False
    panels = [(key, ylabel, title, _series(report, key)) for key, ylabel, title in PANELS]
    panels = [p for p in panels if p[3]]
    if not panels:
        logger.warning("no case with numbers: no plot written")
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.8), squeeze=False)
    ticks = sorted({t for _, _, _, s in panels for pts in s.values() for t, _ in pts})
    for ax, (key, ylabel, title, series) in zip(axes[0], panels):
        for (mode, cp), pts in sorted(series.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            label = "cp=1 (local core)" if cp == 1 else f"{mode} cp={cp}"
            ax.plot([t for t, _ in pts], [v for _, v in pts], marker="o", label=label,
                    color=MODE_COLORS.get(mode, None), linestyle=CP_STYLES.get(cp, "-"))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ticks)
        ax.set_xticklabels([_fmt_t(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("T_global (tokens per micro-batch)")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    cfg = report.get("config", {})
    shape = cfg.get("shape", {})
    gpu = (report.get("rank_info", {}).get("world1") or {}).get("gpu") or report.get("machine", {}).get("cpu_model")
    pools = report.get("pools", [])
    multi = next((p for p in pools if p.get("world", 1) > 1), None)
    dist = f"{multi['backend']}{' on one GPU' if multi.get('one_gpu') else ''}" if multi else "-"
    fig.suptitle(
        f"GDN core fwd+bwd per CP mode: {cfg.get('backend')} {cfg.get('dtype')}, Hk={shape.get('num_k_heads')} "
        f"Hv={shape.get('num_v_heads')} Dk={shape.get('head_k_dim')} Dv={shape.get('head_v_dim')} "
        f"W={shape.get('conv_width')}, {cfg.get('num_sequences')} packed seqs\n{gpu}; ranks: {dist}",
        fontsize=10,
    )
    return save_figure(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", type=Path, help="layer_bench.py output")
    ap.add_argument("--out", type=Path, default=None, help="PNG path (default: the JSON path with .png)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    report = json.loads(args.json.read_text())
    out = args.out or args.json.with_suffix(".png")
    if not plot_report(report, out):
        return 1
    print(f"plot: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
