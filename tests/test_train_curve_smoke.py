"""Smoke test of benchmarks/train_curve.py: a --quick run (5 tiny steps, 2 gloo ranks, the real
patched megatron-core GatedDeltaNet on the CPU) writes the expected JSON, and every CP=2 loss curve
matches the CP=1 curve within 1e-4 relative.

The benchmark never writes the installed megatron-core (it patches a temporary copy when the
installed one is pristine), so this test needs no ``patched_megatron`` fixture; it needs
megatron-core 0.19.2 installed (the ``megatron_installed`` fixture: missing fails, unless
GDN_CP_ALLOW_SKIP_MEGATRON=1, then it skips).
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from tests.conftest import start_smoke_run

RUNS = ("cp1", "cp2-headwise", "cp2-chunkwise", "cp2-chunkwise-core", "cp2-all_gather")
QUICK_STEPS = 5
TOL = 1e-4


# started in the background when the session starts (tests/conftest.py), unless the session may
# patch the installed megatron-core while it runs
SMOKE_RUNS = {"quick_report": ("train_curve", ["--quick"])}
SMOKE_IMPORTS_MEGATRON = True


@pytest.fixture(scope="module")
def quick_report(megatron_installed):
    code, printed, out = start_smoke_run(sys.modules[__name__], "quick_report").result(timeout_s=300)
    assert code == 0, f"train_curve.py --quick failed ({code}):\n{printed}"
    assert "max rel diff loss" in printed  # the table was printed
    assert "step    5/5" in printed  # progress lines
    return json.loads(out.read_text()), out


def test_help_runs(benchmark_module, capsys):
    with pytest.raises(SystemExit) as exit_:
        benchmark_module("train_curve").main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    for opt in ("--steps", "--quick", "--out"):
        assert opt in out


@pytest.mark.slow
@pytest.mark.megatron
def test_quick_report_structure(quick_report):
    report, out = quick_report
    for key in ("benchmark", "date", "machine", "versions", "megatron_core", "config", "target",
                "max_rel_diff_loss", "runs", "rel_diff_per_step", "wall_s", "plot"):
        assert key in report, key
    assert report["benchmark"] == "train_curve"
    assert report["machine"]["cpu_model"] and report["versions"]["torch"]
    assert report["versions"]["megatron_core"] == "0.19.2"
    cfg = report["config"]
    assert cfg["steps"] == QUICK_STEPS and cfg["quick"] is True and cfg["dtype"] == "float32"
    assert set(report["runs"]) == set(RUNS)
    assert set(report["max_rel_diff_loss"]) == set(RUNS) - {"cp1"}
    for name, run in report["runs"].items():
        assert run["cp"] == (1 if name == "cp1" else 2)
        assert len(run["loss"]) == len(run["grad_norm"]) == QUICK_STEPS
        assert all(math.isfinite(v) and v > 0 for v in run["loss"]), run["loss"]
        assert run["wall_s"] > 0
    assert report["runs"]["cp2-chunkwise-core"]["chunkwise_swap_points_used"] == ["core"]
    assert len(report["config"]["sequences_per_step"]) == QUICK_STEPS
    if importlib.util.find_spec("matplotlib") is None:  # CI installs the test extra only
        assert report["plot"] is None
    else:
        assert report["plot"] and Path(report["plot"]).is_file()
        assert Path(report["plot"]) == out.with_suffix(".png")


@pytest.mark.slow
@pytest.mark.megatron
def test_cp2_curves_match_cp1(quick_report):
    report, _ = quick_report
    ref = report["runs"]["cp1"]["loss"]
    for name in RUNS[1:]:
        run = report["runs"][name]
        worst = max(abs(a - b) / abs(b) for a, b in zip(run["loss"], ref))
        assert worst <= TOL, f"{name}: loss differs from CP=1 by {worst:.3e} relative"
        assert report["max_rel_diff_loss"][name] == pytest.approx(worst, rel=1e-9, abs=1e-15)
        assert run["met"] is True
        # the loss alone could agree by luck; the gradient norms and the final weights must too
        assert run["max_rel_diff_grad_norm"] <= TOL
        assert run["max_rel_diff_final_params"] <= TOL
        assert run["rel_l2_final_params"] <= TOL
    assert report["target"]["all_met"] is True
