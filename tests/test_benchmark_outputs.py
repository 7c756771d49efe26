"""Issue #32: a benchmark's reproduction (route_build and train_curve then) overwrote the committed results the
docs quote. A reproduction writes into benchmarks/results/reproduced/ (git-ignored) unless told
(``--replace``, or an ``--out``); the GPU-only sync count refuses to run without a GPU (exit 2) rather
than exiting 0 having done nothing."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def _out(benchmark_module, name: str, argv: list[str]) -> Path:
    module = benchmark_module(name)
    if name == "layer_full":
        return Path(module.resolve_args(module.build_parser().parse_args(["--device", "cpu"] + argv)).out)
    return Path(module.parse_args(argv).out)


@pytest.mark.parametrize("name", ["syncs", "layer_full"])
def test_a_reproduction_never_writes_over_the_committed_results_unless_told(benchmark_module, name, tmp_path, capsys):
    default = _out(benchmark_module, name, [])
    assert default.parent == RESULTS / "reproduced" and default.name == f"{name}.json", default
    assert _out(benchmark_module, name, ["--replace"]) == RESULTS / f"{name}.json"
    assert _out(benchmark_module, name, ["--out", str(tmp_path / "x.json")]) == tmp_path / "x.json"
    with pytest.raises(SystemExit) as exit_:
        _out(benchmark_module, name, ["--replace", "--out", str(tmp_path / "x.json")])
    assert exit_.value.code not in (0, None) and "--replace" in (str(exit_.value.code) + capsys.readouterr().err)


def test_the_reproduced_folder_is_ignored_by_git():
    r = subprocess.run(["git", "check-ignore", "-q", str(RESULTS / "reproduced" / "layer_full.json")], cwd=ROOT)
    assert r.returncode == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_the_sync_count_refuses_without_a_gpu(benchmark_module, capsys):
    assert benchmark_module("syncs").main([]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err.count("\n") == 1 and "needs a CUDA GPU" in cap.err and "nothing was measured" in cap.err
