"""Smoke test of benchmarks/layer_bench.py on the CPU: a --quick run (cp 1 and 2, tiny T, reference
backend, gloo ranks) writes the expected JSON, and a head count that cp does not divide makes headwise
"refused", not a crash. No timing assertions: CI machines are shared and noisy."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import start_smoke_run

MODES = ("chunkwise", "headwise", "all_gather")
CASE_KEYS = {"phase", "cp", "t_global", "t_local", "mode", "status", "error", "cu", "slice_of"}
NUMBER_KEYS = ("wall_ms", "bytes_per_token", "dist_bytes_per_token", "warmup_s")
GPU_KEYS = ("compute_ms", "comm_wait_ms", "peak_gib")  # None on the CPU


# started in the background when the session starts (tests/conftest.py)
SMOKE_RUNS = {
    "quick": ("layer_bench", ["--quick", "--no-plot"]),
    "refused": ("layer_bench", ["--quick", "--no-plot", "--cp", "2", "--modes", "headwise", "--tokens", "128",
                                "--num-k-heads", "1", "--num-v-heads", "2"]),
}


def _result(fixture: str) -> tuple[dict, str]:
    """(the JSON report, everything the run printed)."""
    code, printed, out = start_smoke_run(sys.modules[__name__], fixture).result(timeout_s=300)
    assert code == 0, f"layer_bench.py --quick failed:\n{printed}"
    return json.loads(out.read_text()), printed


@pytest.fixture(scope="module")
def quick():
    return _result("quick")


@pytest.fixture(scope="module")
def refused():
    return _result("refused")


def test_help_runs(benchmark_module, capsys):
    with pytest.raises(SystemExit) as exit_:
        benchmark_module("layer_bench").main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    for flag in ("--quick", "--out", "--time-limit", "--iters", "--tokens", "--cp"):
        assert flag in out


@pytest.mark.slow
def test_report_structure(quick):
    report, printed = quick
    for key in ("benchmark", "date", "machine", "versions", "config", "notes", "cases", "summary", "tune",
                "pools", "finished", "elapsed_s"):
        assert key in report, key
    assert report["benchmark"] == "layer"
    assert report["finished"] is True
    assert report["machine"]["cpu_model"]
    assert report["versions"]["torch"]
    assert report["config"]["backend"] == "reference" and report["config"]["device"] == "cpu"
    assert report["config"]["cp"] == [1, 2]
    assert "wall ms" in printed and "comm/wait ms" in printed  # the final table
    assert all(t["status"] == "ok" for t in report["tune"]), report["tune"]


@pytest.mark.slow
def test_every_case_has_numbers_or_an_error(quick):
    report, _ = quick
    cases = report["cases"]
    assert cases
    for c in cases:
        assert CASE_KEYS <= set(c), CASE_KEYS - set(c)
        if c["status"] == "ok":
            for k in NUMBER_KEYS:
                assert isinstance(c[k], (int, float)) and c[k] >= 0, (k, c)
            assert c["iters"] >= 1 and len(c["wall_ms_iters"]) == c["iters"]
            for k in GPU_KEYS:
                assert c[k] is None  # CPU: no kernel time, no CUDA memory
        else:
            assert c["status"] in ("error", "refused", "skipped")
            assert isinstance(c["error"], str) and c["error"]


@pytest.mark.slow
def test_numbers_for_every_mode_and_cp1(quick):
    report, _ = quick
    ok = [c for c in report["cases"] if c["status"] == "ok"]
    for mode in MODES:
        assert any(c["mode"] == mode and c["cp"] == 2 for c in ok), mode
    assert any(c["cp"] == 1 and c["slice_of"] is None for c in ok)
    assert any(c["cp"] == 1 and c["slice_of"] for c in ok)  # T/cp slice for chunkwise's ratio
    for c in ok:
        if c["cp"] == 1:
            assert c["bytes_per_token"] == 0
        else:
            assert c["bytes_per_token"] > 0 and c["dist_bytes_per_token"] > 0
    assert any(c.get("chunkwise_path") for c in ok if c["mode"] == "chunkwise")


@pytest.mark.slow
def test_summary(quick):
    report, _ = quick
    s = report["summary"]
    ratios = s["chunkwise_compute_ratio"]
    assert {r["t_global"] for r in ratios} == set(report["config"]["tokens"])
    for r in ratios:
        assert r["compute_ratio"] is None  # CPU: no kernel time
        assert r["wall_ratio"] > 0
    assert s["all_gather_peak_memory"]
    assert any(k.startswith("headwise") for k in s["bytes_per_token"])


@pytest.mark.slow
def test_headwise_refused_not_crashed(refused):
    report, printed = refused
    (case,) = [c for c in report["cases"] if c["cp"] == 2]
    assert case["status"] == "refused"
    assert "ValueError" in case["error"] and "divisible" in case["error"]
    assert "refused" in printed
