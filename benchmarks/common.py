"""Small shared helpers for the benchmarks in this folder.

- :func:`machine_info` / :func:`versions` / :func:`now_iso` / :func:`write_json`: what a result was
  measured on, and atomic JSON output (from :mod:`gdn_cp_testing.results`, shared with the tests);
- how a benchmark measures (timing, statistics, profile splits, token counts): :mod:`.measure`;
- :func:`format_table`: human-readable output;
- :func:`plot_lines`: an optional matplotlib plot (skipped, not failed, without matplotlib);
- :func:`add_out_arguments` / :func:`resolve_out`: where a reproduction writes (never over a committed
  result unless told: ``--replace``);
- :func:`setup_logging`: script plumbing.

The benchmarks are a package run from the repository root (``python3 -m benchmarks.<name>``), so
a benchmark runs the ``gdn_cp`` of its own checkout; they use only ``gdn_cp`` (its testing
toolkit included), never ``tests``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Sequence

from gdn_cp_testing.results import load_average, machine_info, now_iso, stack_versions, write_json

__all__ = [
    "REPO_ROOT",
    "RESULTS_DIR",
    "REPRODUCED_DIR",
    "add_out_arguments",
    "resolve_out",
    "setup_logging",
    "machine_info",
    "versions",
    "load_average",
    "now_iso",
    "write_json",
    "format_table",
    "plot_lines",
    "save_figure",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPRODUCED_DIR = RESULTS_DIR / "reproduced"
"""Where a benchmark writes by default: beside the committed results, git-ignored, so a reproduction
never overwrites the files the docs quote (compare the two; ``--replace`` writes over them)."""


def add_out_arguments(parser, name: str, what: str = "JSON path") -> None:
    """``--out`` (default: ``benchmarks/results/reproduced/<name>``) and ``--replace`` (write the
    committed ``benchmarks/results/<name>`` instead); :func:`resolve_out` reads them."""
    parser.add_argument("--out", type=Path, default=None,
                        help=f"{what} (default: benchmarks/results/reproduced/{name}, beside the committed "
                        f"benchmarks/results/{name}, which only --replace overwrites)")
    parser.add_argument("--replace", action="store_true",
                        help=f"write benchmarks/results/{name}, the committed result the docs quote")


def resolve_out(args, name: str, parser=None) -> Path:
    """The path ``--out`` / ``--replace`` ask for (both at once: ``parser``'s error, else SystemExit)."""
    if args.replace and args.out is not None:
        message = "--replace writes the committed result; leave out --out with it"
        if parser is not None:
            parser.error(message)
        raise SystemExit(message)
    if args.out is not None:
        return Path(args.out)
    return (RESULTS_DIR if args.replace else REPRODUCED_DIR) / name

logger = logging.getLogger("benchmarks")


def versions(extra: dict | None = None) -> dict:
    """Python, torch, Triton, FLA, megatron-core, gdn-cp and GPU versions (+ ``extra``)."""
    return stack_versions(extra)


def save_figure(fig, path) -> bool:
    """Lay out, write a PNG (creating its folder) and close ``fig``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def _cell(v) -> str:
    if isinstance(v, float):
        if v >= 100:
            return f"{v:.0f}"
        if v >= 10:
            return f"{v:.1f}"
        if v >= 1:
            return f"{v:.2f}"
        return f"{v:.3f}"
    return str(v)


def format_table(headers: Sequence[str], rows: Sequence[Sequence], markdown: bool = False) -> str:
    """Right-aligned text table (or a Markdown table with ``markdown=True``)."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    if markdown:
        lines = ["| " + " | ".join(h for h in headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in cells]
        return "\n".join(lines)
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    lines = [fmt.format(*headers), "  ".join("-" * w for w in widths)]
    lines += [fmt.format(*r) for r in cells]
    return "\n".join(lines)


def plot_lines(
    path,
    x: Sequence[float],
    series: dict[str, Sequence[float]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    logx: bool = True,
    logy: bool = True,
    xticklabels: Sequence[str] | None = None,
) -> bool:
    """Line plot of ``series`` (label -> y values over ``x``) to ``path``.
    Returns False (and logs why) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib not installed: no plot written (pip install matplotlib)")
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, ys in series.items():
        ax.plot(x, ys, marker="o", label=label)
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    if xticklabels is not None:
        ax.set_xticks(list(x))
        ax.set_xticklabels(list(xticklabels))
        ax.minorticks_off()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return save_figure(fig, path)
