#!/usr/bin/env python
"""How many tokens the padded per-document cut adds: ``--dataloader-inter-document-masking`` rows at
CP > 1 in a model with attention layers get every document padded at its end to a multiple of 2*cp
(and, under sequence parallelism, the row to a multiple of ``lcm(2*cp, cp*TP)``;
:mod:`gdn_cp.megatron.document_padding`). CPU only, seconds.

Documents are drawn from a length mix and packed into rows of ``seq`` tokens the way Megatron's
``GPTDataset`` packs them (one stream of documents cut at every ``seq`` tokens: a document that
crosses a row end is two pieces, each a document of its row); each row is padded by
``gdn_cp.layout.pad_documents``, the function the data path calls. Per (mix, seq, cp, TP under
sequence parallelism): the padded fraction (pad tokens / real tokens over all rows), the worst row's,
the share of rows that need any pad, documents per row, and the largest row growth (the rank's
activations grow by it).

Mixes (synthetic; their parameters say which corpora they imitate, no corpus was read):

* ``mock``: Megatron-LM's mock data (``MockGPTLowLevelDataset``: lengths uniform in [1, 4095]),
  what ``benchmarks/train_megatron_lm.py`` trains on;
* ``web``: lognormal, median 400 tokens, sigma 1.3 (web text: most pages short, a long tail);
* ``short``: lognormal, median 120, sigma 0.9 (chat turns, Q&A, short posts);
* ``long``: lognormal, median 3000, sigma 1.5 (books, code files, papers).

    python3 -m benchmarks.pad_cost                       # -> benchmarks/results/pad_cost.{json,png}
    python3 -m benchmarks.pad_cost --quick --out /tmp/pad_cost.json
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import numpy as np

from gdn_cp.layout import pad_documents, padded_row_multiple

from .common import RESULTS_DIR, format_table, machine_info, now_iso, save_figure, setup_logging, versions, write_json

logger = logging.getLogger("benchmarks.pad_cost")

MIXES = {
    "mock": ("uniform", 1, 4095),
    "web": ("lognormal", 400, 1.3),
    "short": ("lognormal", 120, 0.9),
    "long": ("lognormal", 3000, 1.5),
}
FULL_SEQ = (8192, 32768, 131072)
FULL_CP = (2, 4, 8, 16)
FULL_TP_SP = (1, 8)
TOKENS_PER_CASE = 1 << 24  # rows enough for 16M tokens per (mix, seq)


def draw_lengths(mix: str, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` document lengths (>= 1) of ``mix`` (:data:`MIXES`)."""
    kind, a, b = MIXES[mix]
    if kind == "uniform":
        return rng.integers(a, b + 1, size=count)
    return np.maximum(1, np.rint(rng.lognormal(np.log(a), b, size=count))).astype(np.int64)


def packed_rows(mix: str, seq: int, rows: int, seed: int) -> list[np.ndarray]:
    """``rows`` rows of ``seq`` tokens cut from one stream of ``mix`` documents: each row's boundaries
    ``[0, ..., seq]`` (a document crossing a row end is a piece in each row)."""
    rng = np.random.default_rng(seed)
    ends = np.zeros(0, dtype=np.int64)
    while not len(ends) or ends[-1] < rows * seq:
        more = draw_lengths(mix, max(1024, rows * seq // 256), rng)
        ends = np.concatenate([ends, (ends[-1] if len(ends) else 0) + np.cumsum(more)])
    out = []
    for r in range(rows):
        lo, hi = r * seq, (r + 1) * seq
        inner = ends[(ends > lo) & (ends < hi)] - lo
        out.append(np.concatenate([[0], inner, [seq]]).astype(np.int64))
    return out


def measure(mix: str, seq: int, cps, tps, tokens: int, seed: int) -> list[dict]:
    rows = packed_rows(mix, seq, max(16, tokens // seq), seed)
    docs = np.array([len(cu) - 1 for cu in rows])
    out = []
    for cp in cps:
        for tp in tps:
            multiple = padded_row_multiple(cp, tp)
            padded = np.array([pad_documents(cu, cp, multiple).total for cu in rows]) - seq
            out.append({"mix": mix, "seq": seq, "cp": cp, "tp_sp": tp, "rows": len(rows),
                        "docs_per_row": float(docs.mean()), "pad_fraction": float(padded.sum() / (seq * len(rows))),
                        "worst_row_pad_fraction": float(padded.max() / seq),
                        "rows_padded": float((padded > 0).mean()),
                        "pad_tokens_per_document": float(padded.sum() / docs.sum())})
    return out


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib not installed: no plot written")
        return False
    seqs = sorted({r["seq"] for r in rows})
    fig, axes = plt.subplots(1, len(seqs), figsize=(4.6 * len(seqs), 4.2), sharey=True, squeeze=False)
    for ax, seq in zip(axes[0], seqs):
        for i, mix in enumerate(MIXES):
            for tp, style in ((1, "-"), (8, "--")):
                pts = sorted((r["cp"], 100 * r["pad_fraction"]) for r in rows
                             if r["seq"] == seq and r["mix"] == mix and r["tp_sp"] == tp)
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", color=f"C{i}",
                            label=f"{mix}" + (" (SP, TP=8)" if tp > 1 else ""))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"seq {seq // 1024}K")
        ax.set_xlabel("CP size")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("pad tokens / real tokens (%)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle("--dataloader-inter-document-masking at CP > 1: tokens added by the padded per-document cut",
                 fontsize=9)
    return save_figure(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mixes", nargs="+", choices=sorted(MIXES), default=list(MIXES))
    p.add_argument("--seq", type=int, nargs="+", default=list(FULL_SEQ), help="row lengths (tokens)")
    p.add_argument("--cp", type=int, nargs="+", default=list(FULL_CP), help="CP sizes")
    p.add_argument("--tp-sp", type=int, nargs="+", default=list(FULL_TP_SP),
                   help="TP sizes under sequence parallelism (1: no sequence parallelism)")
    p.add_argument("--tokens", type=int, default=TOKENS_PER_CASE, help="tokens packed per (mix, seq)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a smoke run: two mixes, small sizes")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "pad_cost.json")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    setup_logging()
    if args.quick:
        args.mixes, args.seq, args.cp, args.tp_sp, args.tokens = ["mock", "short"], [8192], [2, 8], [1, 8], 1 << 17
    t0 = time.monotonic()
    rows = []
    for mix in args.mixes:
        for seq in args.seq:
            rows += measure(mix, seq, args.cp, args.tp_sp, args.tokens, args.seed)
    doc = {"benchmark": "pad_cost", "date": now_iso(), "machine": machine_info(), "versions": versions(),
           "mixes": {m: MIXES[m] for m in args.mixes}, "tokens_per_case": args.tokens, "seed": args.seed,
           "elapsed_s": round(time.monotonic() - t0, 1), "rows": rows}
    write_json(args.out, doc)
    print(format_table(["mix", "seq", "cp", "TP (SP)", "docs/row", "padded %", "worst row %", "rows padded %"],
                       [[r["mix"], r["seq"], r["cp"], r["tp_sp"], f"{r['docs_per_row']:.1f}",
                         f"{100 * r['pad_fraction']:.3f}", f"{100 * r['worst_row_pad_fraction']:.2f}",
                         f"{100 * r['rows_padded']:.0f}"] for r in rows]))
    if not args.no_plot:
        plot(rows, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
