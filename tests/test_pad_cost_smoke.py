"""benchmarks/pad_cost.py in this process (a --quick run: a second): its JSON rows, and the bounds the
padded per-document cut must keep (fewer than 2*cp pad tokens per document, plus the row multiple
under sequence parallelism). No timing."""

from __future__ import annotations

import json
import math


def test_quick_run_writes_rows_within_the_cuts_bounds(benchmark_module, tmp_path, capsys):
    out = tmp_path / "pad_cost.json"
    assert benchmark_module("pad_cost").main(["--quick", "--no-plot", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "pad_cost" and doc["machine"] and "padded %" in capsys.readouterr().out
    assert {(r["mix"], r["cp"], r["tp_sp"]) for r in doc["rows"]} == {
        (m, cp, tp) for m in ("mock", "short") for cp in (2, 8) for tp in (1, 8)}
    for r in doc["rows"]:
        per_doc = (2 * r["cp"] - 1) / (2 * r["cp"])  # the mean bound is looser; each document < 2*cp pads
        row_extra = math.lcm(2 * r["cp"], r["cp"] * r["tp_sp"])
        assert 0 < r["pad_tokens_per_document"] < 2 * r["cp"] * per_doc + row_extra / r["docs_per_row"], r
        assert r["worst_row_pad_fraction"] >= r["pad_fraction"] > 0, r
