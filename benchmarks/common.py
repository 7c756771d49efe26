"""Small shared helpers for the benchmarks in this folder.

- :func:`machine_info` / :func:`versions` / :func:`now_iso` / :func:`write_json`: what a result was
  measured on, and atomic JSON output (from :mod:`gdn_cp_testing.results`, shared with the tests);
- how a benchmark measures (timing, statistics, profile splits, token counts): :mod:`.measure`;
- :func:`add_out_arguments` / :func:`resolve_out`: where a reproduction writes (never over a committed
  result unless told: ``--replace``);
- :func:`csv_choices`, :func:`pyplot`, :func:`save_figure`, :func:`setup_logging`: script plumbing.

The benchmarks are a package run from the repository root (``python3 -m benchmarks.<name>``), so
a benchmark runs the ``gdn_cp`` of its own checkout; they use only ``gdn_cp`` (its testing
toolkit included), never ``tests``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from gdn_cp_testing.results import machine_info, now_iso, stack_versions as versions, write_json

__all__ = ["RESULTS_DIR", "REPRODUCED_DIR", "add_out_arguments", "csv_choices", "resolve_out",
           "setup_logging", "machine_info", "versions", "now_iso", "write_json", "pyplot", "save_figure"]

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPRODUCED_DIR = RESULTS_DIR / "reproduced"
"""Where a benchmark writes by default: beside the committed results, git-ignored, so a reproduction
never overwrites the files the docs quote (compare the two; ``--replace`` writes over them)."""


def add_out_arguments(parser, name: str, what: str = "JSON path") -> None:
    """``--out`` (default: ``benchmarks/results/reproduced/<name>``) or ``--replace`` (write the committed
    ``benchmarks/results/<name>`` instead; argparse refuses both at once); :func:`resolve_out` reads them."""
    either = parser.add_mutually_exclusive_group()
    either.add_argument("--out", type=Path, default=None,
                        help=f"{what} (default: benchmarks/results/reproduced/{name}, beside the committed "
                        f"benchmarks/results/{name}, which only --replace overwrites)")
    either.add_argument("--replace", action="store_true",
                        help=f"write benchmarks/results/{name}, the committed result the docs quote")


def resolve_out(args, name: str) -> Path:
    """The path ``--out`` / ``--replace`` ask for."""
    return Path(args.out) if args.out is not None else (RESULTS_DIR if args.replace else REPRODUCED_DIR) / name


def csv_choices(choices):
    """An argparse type: a comma list of ``choices`` (at least one) -> the list, in the order given."""
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items or any(t not in choices for t in items):
            raise argparse.ArgumentTypeError(f"choose from {','.join(choices)}; got {text!r}")
        return items
    return parse


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None without matplotlib (said on stderr)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')", file=sys.stderr)
        return None
    return plt


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
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
