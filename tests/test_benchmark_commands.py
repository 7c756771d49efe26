"""Every benchmark command the docs cite still parses with the benchmark's own argument parser: the arguments
docs/*.md and README.md give benchmarks/gpu_suite.sh (``GDN_CP_LAYER_FULL_ARGS``, ``GDN_CP_LAYER_FULL_B_ARGS``,
``GDN_CP_TRAIN_MLM_ARGS``, ``GDN_CP_GLUE_KERNELS_ARGS``, ``GDN_CP_SYNCS_ARGS``, ``GDN_CP_WGRADS_ARGS``), each with the
arguments the suite's stage adds, and for layer_full also through its check of the combination (``resolve_args``, on
the CPU here)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# what gpu_suite.sh's stage passes before the cited arguments
STAGE_ARGS = {"LAYER_FULL": ["--out", "/tmp/x.json", "--time-limit", "480"],
              "LAYER_FULL_B": ["--out", "/tmp/x.json", "--time-limit", "240"],
              "TRAIN_MLM": ["--out", "/tmp/x.json", "--checkout", "/tmp/mlm"], "GLUE_KERNELS": ["--out", "/tmp/x.json"],
              "SYNCS": ["--out", "/tmp/x.json"],
              "WGRADS": ["--checkout", "/tmp/mlm", "--work", "/tmp/w", "--out", "/tmp/x.json", "--timeout-s", "480"]}


def cited() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        text = " ".join(doc.read_text().split())  # commands wrap over lines
        found += re.findall(r'GDN_CP_(LAYER_FULL|LAYER_FULL_B|TRAIN_MLM|GLUE_KERNELS|SYNCS|WGRADS)_ARGS="([^"]*)"', text)
    return sorted(set(found))


def test_the_docs_cite_commands_of_each_benchmark():
    kinds = {k for k, _ in cited()}
    assert kinds == set(STAGE_ARGS), kinds


@pytest.mark.parametrize("kind,args", cited(), ids=lambda v: v if len(v) < 40 else v[:40])
def test_each_cited_command_parses(kind, args):
    words = STAGE_ARGS[kind] + shlex.split(args)
    if kind == "TRAIN_MLM":
        from benchmarks.train_megatron_lm import build_parser
        build_parser().parse_args(words)
    elif kind == "GLUE_KERNELS":  # the backward forms it names included
        from benchmarks.glue_kernels import parse_args
        parse_args(words)
    elif kind == "SYNCS":
        from benchmarks.syncs import parse_args
        parse_args(words)
    elif kind == "WGRADS":
        from gdn_cp_testing.megatron.wgrads import build_parser
        build_parser().parse_args(words)
    else:
        from benchmarks.layer_full import build_parser, resolve_args
        resolve_args(build_parser().parse_args([*words, "--device", "cpu"]))


def test_a_wrong_group_or_lever_is_refused():
    from benchmarks.layer_full import build_parser as layer_full
    from benchmarks.train_megatron_lm import build_parser as train_mlm

    with pytest.raises(SystemExit):
        train_mlm().parse_args(["--groups", "main,nosuch"])
    with pytest.raises(SystemExit):
        layer_full().parse_args(["--levers", "glue_nosuch"])
    from benchmarks.layer_full import resolve_args

    with pytest.raises(SystemExit, match="--plan"):
        resolve_args(layer_full().parse_args(["--cp", "1", "--device", "cpu", "--plan", "local-glue_nosuch:32K"]))


def test_the_benchmarks_stay_small():
    """Issue 48: benchmarks/*.py at most 3,500 lines in all and no function over 80 lines (a reader can hold
    them; they had grown to 6,002 lines, four functions over 80)."""
    import ast

    files = sorted((ROOT / "benchmarks").glob("*.py"))
    assert sum(len(f.read_text().splitlines()) for f in files) <= 3500
    long = [(f.name, node.name, node.end_lineno - node.lineno + 1) for f in files
            for node in ast.walk(ast.parse(f.read_text())) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > 80]
    assert not long, long
