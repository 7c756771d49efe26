"""benchmarks/results/runs/ holds the raw records of the GPU runs the docs quote, and nothing else: every folder
(and loose file) there is cited by README.md or a page of docs/, and every run the docs cite is there.

A run is cited as ``run_2026-12-01b``, ``run_2026-12-02{a,b,c}``, ``run 2026-12-04a``, ``runs 2026-12-03a / b``,
``runs 2026-12-04c/d`` or a section's ``Runs of 2026-12-03, a-d``; a loose file by its name."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "benchmarks" / "results" / "runs"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_ONE = re.compile(r"runs?[_ ](\d{4}-\d{2}-\d{2})(\{[a-z,]+\}|[a-z](?:\s*(?:/|,|and)\s*[a-z]\b)*)")
_RANGE = re.compile(r"runs of (\d{4}-\d{2}-\d{2}), ([a-z])-([a-z])\b", re.IGNORECASE)


def cited_runs(text: str) -> set[str]:
    """The run folder names ``text`` cites."""
    out = set()
    for m in _ONE.finditer(text):
        out |= {f"run_{m[1]}{c}" for c in re.findall(r"[a-z]", m[2])}
    for m in _RANGE.finditer(text):
        out |= {f"run_{m[1]}{chr(c)}" for c in range(ord(m[2]), ord(m[3]) + 1)}
    return out


def test_the_citation_forms_are_read():
    assert cited_runs("`run_2026-12-02{a,b,c}/` and run 2026-12-04a") == {
        "run_2026-12-02a", "run_2026-12-02b", "run_2026-12-02c", "run_2026-12-04a"}
    assert cited_runs("(runs 2026-12-03a / b; runs 2026-12-04c/d)") == {
        "run_2026-12-03a", "run_2026-12-03b", "run_2026-12-04c", "run_2026-12-04d"}
    assert cited_runs("## The glue (runs of 2026-12-04, a-c: 1x H200)") == {
        "run_2026-12-04a", "run_2026-12-04b", "run_2026-12-04c"}
    assert cited_runs("run 2026-12-04 and run_2026-12-01") == set()


def test_every_raw_run_is_cited_and_every_cited_run_is_there():
    texts = {doc.name: doc.read_text() for doc in DOCS}
    cited = set().union(*(cited_runs(t) for t in texts.values()))
    present = {p.name for p in RUNS.iterdir()}
    folders = {n for n in present if (RUNS / n).is_dir()}
    loose = present - folders
    uncited = sorted(folders - cited) + sorted(n for n in loose if not any(n in t for t in texts.values()))
    assert not uncited, f"benchmarks/results/runs/: no doc cites {uncited} (cite it, or remove it)"
    missing = sorted(cited - folders)
    assert not missing, f"the docs cite {missing}, which benchmarks/results/runs/ lacks"
