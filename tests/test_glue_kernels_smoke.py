"""benchmarks/glue_kernels.py on the CPU through Triton's interpreter (a tiny shape): it runs every form it is
asked for, writes the rows the GPU run will, and the candidate backwards give the shipped form's gradients. No
timing assertions."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="Triton is not installed (the interpreter runs the kernels on the CPU)")


def test_help_names_the_forms(benchmark_module, capsys):
    with pytest.raises(SystemExit) as exit_:
        benchmark_module("glue_kernels").main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--forms" in out and "taps_once" in out and "sums_per_tile" in out


def test_a_dry_run_writes_every_form(tmp_path):
    out = tmp_path / "glue_kernels.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-m", "benchmarks.glue_kernels", "--device", "cpu", "--rows", "40",
                           "--heads", "1,1", "--head-dim", "16", "--iters", "1", "--forms", "both,taps_once",
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [r["form"] for r in report["results"]] == ["both", "taps_once"]  # the shipped form ran as the reference only
    for row in report["results"]:
        assert row["fwd_ms"] > 0 and row["bwd_ms"] > 0 and row["floor"]["bwd_ms"] > 0
        assert max(row["max_diff"].values()) < 1e-2, row
