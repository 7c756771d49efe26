"""docs/megatron.md's table "What runs beside CP" against what backs it: every GPU row it cites as shown
is a row of benchmarks/results/train_megatron_lm.json that matches CP=1 (and every such row of the file is
cited), every row it cites as not run is in the benchmark's matrix and has not run, every CPU test it
cites exists, every refusal it quotes is a message gdn-cp or Megatron raises, and each cell's status says
what its evidence is. A table cell that claims more than the files hold fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import train_megatron_lm as bench

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "megatron.md"
RESULTS = ROOT / "benchmarks" / "results" / "train_megatron_lm.json"
SECTION = "## What runs beside CP: parallelism x data flags"
PARALLELISMS = ("CP", "TP", "SP", "PP", "EP", "hybrid CP", "dynamic CP")
FLAGS = ("none", "inter-document masking", "sft", "recompute", "FP8", "MTP")
STATUSES = ("shown", "CPU only", "not run", "refused", "not tried")
KEYS = ("results", "not run", "CPU", "refused", "note")


def parse_table(text: str) -> dict:
    """``{(parallelism, flags): (status, {key: [items]})}`` of the section's table; ValueError naming what
    is malformed."""
    if SECTION not in text:
        raise ValueError(f"docs/megatron.md has no section {SECTION!r}")
    body = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in body.splitlines() if ln.startswith("| ") and not ln.startswith("| ---")]
    if not rows or [c.strip() for c in rows[0].strip("|").split("|")] != ["parallelism", "data flags", "at CP > 1",
                                                                          "evidence"]:
        raise ValueError(f"the table's header is not parallelism | data flags | at CP > 1 | evidence: {rows[:1]}")
    out = {}
    for line in rows[1:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4:
            raise ValueError(f"not 4 cells: {line}")
        par, flags, status, evidence = cells
        items: dict = {}
        for item in filter(None, (x.strip() for x in evidence.split("; "))):
            key, _, value = item.partition(": ")
            if key not in KEYS or not value:
                raise ValueError(f"({par}, {flags}): evidence item {item!r} is not 'KEY: value' with KEY one of {KEYS}")
            if key == "refused":
                items.setdefault(key, []).append(value.strip('"'))
            elif key != "note":
                items.setdefault(key, []).extend(v.strip() for v in value.split(","))
        if (par, flags) in out:
            raise ValueError(f"({par}, {flags}) twice")
        out[(par, flags)] = (status, items)
    return out


@pytest.fixture(scope="module")
def table():
    return parse_table(DOC.read_text())


@pytest.fixture(scope="module")
def results():
    doc = json.loads(RESULTS.read_text())
    bench.judge(doc["rows"], doc["rule"])
    return {r["name"]: r for r in doc["rows"]}


def test_every_combination_once_with_a_status_that_says_what_backs_it(table):
    assert set(table) == {(p, f) for p in PARALLELISMS for f in FLAGS}, sorted(set(table) ^ {(p, f) for p in
                                                                                          PARALLELISMS for f in FLAGS})
    for cell, (status, items) in table.items():
        assert status in STATUSES, (cell, status)
        has = {k for k in items if items[k]}
        want = {"shown": {"results"}, "CPU only": {"CPU"}, "not run": {"not run"}, "refused": {"refused"},
                "not tried": set()}[status]
        assert want <= has, (cell, status, has)
        strongest = [k for k in ("results", "CPU", "not run") if k in has]
        assert status in ("refused", "not tried") and not strongest or status == {"results": "shown", "CPU": "CPU only",
                                                                                 "not run": "not run"}[strongest[0]], \
            (cell, status, has)


def test_shown_cells_are_the_results_files_matching_rows(table, results):
    cited = {name for _, items in table.values() for name in items.get("results", [])}
    for name in cited:
        assert name in results, f"the table cites {name} as shown; {RESULTS.name} has no such row"
        assert results[name]["verdict"] in ("matches CP=1", "refused before step 1 (as required)"), \
            (name, results[name]["verdict"])
    matching = {n for n, r in results.items() if r["verdict"] == "matches CP=1"}
    assert matching <= cited, f"rows of {RESULTS.name} that match CP=1 but no cell shows: {sorted(matching - cited)}"


def test_rows_not_run_are_in_the_matrix_and_have_not_run(table, results):
    matrix = {s.name: ref for s, ref in bench.matrix(bench.GROUPS)}
    for cell, (_, items) in table.items():
        for name in items.get("not run", []):
            assert name in matrix, (cell, name, "not a row of benchmarks/train_megatron_lm.py's matrix")
            assert results.get(name, {}).get("status") != "ok", (cell, name, f"ran: {RESULTS.name} has it; cite it "
                                                                 "as results (shown) or say how it differs")
    # the group of issue 42 is all in the table
    parallel = {s.name for s, ref in bench.matrix(("parallel",)) if ref and not s.name.endswith("_noise")}
    named = {n for _, items in table.values() for n in items.get("not run", []) + items.get("results", [])}
    assert parallel <= named, sorted(parallel - named)


def test_cpu_tests_exist(table):
    defined = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        defined |= set(re.findall(r"^def (test_\w+)\(", path.read_text(), re.M))
    for cell, (_, items) in table.items():
        for name in items.get("CPU", []):
            assert name in defined, (cell, name)


def test_refusals_are_messages_that_are_raised(table):
    """Each quoted refusal is in gdn-cp's sources (the message's text; the refusals themselves are tested in
    tests/megatron/test_padded_cut_parallelism.py and test_thd_split.py) or, for Megatron's own, in the
    installed megatron's."""
    sources = "".join(p.read_text() for p in (ROOT / "gdn_cp").rglob("*.py"))
    flat = re.sub(r'"\s*\n\s*f?"', "", sources)  # messages are split over lines as adjacent literals
    for cell, (_, items) in table.items():
        for quote in items.get("refused", []):
            probe = re.sub(r"\{[^}]*\}", "", quote)
            assert all(part in flat for part in re.split(r"--context-parallel-size \d+|\s{2,}", probe) if part), \
                (cell, quote)


def test_the_parser_refuses_a_malformed_table():
    good = f"{SECTION}\n\n| parallelism | data flags | at CP > 1 | evidence |\n| --- | --- | --- | --- |\n"
    assert parse_table(good + "| CP | none | shown | results: a, b; CPU: test_x |\n") == {
        ("CP", "none"): ("shown", {"results": ["a", "b"], "CPU": ["test_x"]})}
    with pytest.raises(ValueError, match="evidence item 'seen: a'"):
        parse_table(good + "| CP | none | shown | seen: a |\n")
    with pytest.raises(ValueError, match="twice"):
        parse_table(good + "| CP | none | not tried | |\n| CP | none | not tried | |\n")
