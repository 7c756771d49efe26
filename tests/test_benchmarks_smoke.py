"""Smoke test of benchmarks/route_build.py: a --quick run writes the expected JSON and the
per-token builder (megatron-core's own when installed, else the benchmark's copy) agrees with
gdn-cp's routes on every config. No timing assertions: CI machines are shared and noisy."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.conftest import start_smoke_run

RESULT_KEYS = {
    "T_global",
    "num_sequences",
    "cp",
    "rank",
    "T_local",
    "agree",
    "checks",
    "plan_ms",
    "plan_index_ms",
    "per_token_ms",
    "full_perm_ms",
    "speedup",
    "speedup_plan_only",
    "passes",
}


# started in the background when the session starts (tests/conftest.py), unless the session may
# patch the installed megatron-core while it runs (route_build imports it for the per-token builder)
SMOKE_RUNS = {"quick_report": ("route_build", ["--quick", "--no-plot", "--budget", "0.005"])}
SMOKE_IMPORTS_MEGATRON = True


@pytest.fixture(scope="module")
def quick_report():
    code, printed, out = start_smoke_run(sys.modules[__name__], "quick_report").result(timeout_s=300)
    assert code == 0, f"route_build.py --quick failed:\n{printed}"
    assert "ours plan ms" in printed  # the table was printed
    return json.loads(out.read_text())


def test_help_runs(benchmark_module, capsys):
    with pytest.raises(SystemExit) as exit_:
        benchmark_module("route_build").main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert "--quick" in out and "--out" in out


@pytest.mark.slow
def test_report_keys(quick_report):
    for key in ("benchmark", "date", "machine", "versions", "settings", "methods", "results", "all_agree", "target"):
        assert key in quick_report, key
    assert quick_report["benchmark"] == "route_build"
    assert quick_report["machine"]["cpu_model"]
    assert quick_report["machine"]["logical_cores"] >= 1
    assert quick_report["versions"]["torch"] == torch.__version__
    assert quick_report["settings"]["per_rank"] is True
    assert quick_report["methods"]["per_token"]["impl"] in ("megatron-core", "benchmark copy")
    assert quick_report["results"], "no configs were run"
    for row in quick_report["results"]:
        assert RESULT_KEYS <= set(row), RESULT_KEYS - set(row)
        for m in ("plan", "plan_index", "per_token", "full_perm"):
            assert row[f"{m}_ms"] > 0


@pytest.mark.slow
def test_per_token_agrees_with_routes(quick_report):
    assert quick_report["all_agree"] is True
    for row in quick_report["results"]:
        assert row["agree"] is True, row
        assert row["checks"]["route_matches_per_token"] is True
        assert row["checks"]["natural_order_equals_per_token"] is True


def test_benchmark_copy_matches_megatron(benchmark_module):
    """The benchmark's per-token copy is the function megatron-core ships (when installed)."""
    common = pytest.importorskip("megatron.core.ssm.gated_delta_net.common")
    route_build = benchmark_module("route_build")
    from gdn_cp.layout.packings import packed_boundaries

    for nseq, t_global, cp in ((1, 4096, 2), (37, 8192, 4), (64, 16384, 8)):
        cu = torch.tensor(packed_boundaries(nseq, t_global, cp, seed=3), dtype=torch.int32)
        ours = route_build.per_token_perm(cu, cp, t_global)
        theirs = common._build_thd_cp_a2a_perm(cu, cp, t_global)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


# ---------------------------------------------------------------------------------------------
# benchmarks/fla_levers.py: the GPU runs each way; here what each stack offers and the reference
# ---------------------------------------------------------------------------------------------

def test_fla_levers_says_why_a_way_does_not_run(benchmark_module):
    from gdn_cp.ops.fla.detect import FLAFeatures

    levers = benchmark_module("fla_levers")
    fla042 = levers.gdn_ways_offered(FLAFeatures(None, None, fused_gated_norm=True), [])
    assert fla042["expanded"] is None and "grouped value heads" in fla042["grouped"]
    assert fla042["grouped_flash_qla"] is not None
    fla060 = FLAFeatures(None, None, grouped_value_heads=True, gate_in_kernel=True, beta_sigmoid_in_kernel=True,
                         fused_gated_norm=True)
    no_qla = levers.gdn_ways_offered(fla060, [{"name": "flash_qla", "available": False, "enabled": True}])
    assert no_qla["grouped"] is None and no_qla["grouped_gates_in_kernel"] is None
    assert "flash_qla is not importable" in no_qla["grouped_flash_qla"]
    assert levers.gdn_ways_offered(fla060, [{"name": "flash_qla", "available": True, "enabled": True}])[
        "grouped_flash_qla"] is None
    norms = levers.norm_ways_offered(fla060, "no TE")
    assert norms == {"torch": None, "fla_fused": None, "te": "no TE", "te_zero_centered": "no TE",
                     "fla_fused_zero_centered": None}
    assert set(levers.NORM_WAYS) == set(norms) and set(levers.GDN_WAYS) == set(fla042)


def test_fla_levers_fp64_norm_reference(benchmark_module):
    """The reference every norm way is checked against: torch's RMSNorm * silu(z), in fp64, with
    the gradients autograd gives it."""
    levers = benchmark_module("fla_levers")
    gen = torch.Generator().manual_seed(0)
    x, z, do = (torch.randn(12, 16, generator=gen) for _ in range(3))
    w = 1 + (6.4 * torch.randn(16, generator=gen)).round() / 64
    y, grads = levers.norm_fp64(x, z, w, 1e-5, do)
    xx, zz, ww = (t.double().requires_grad_(True) for t in (x, z, w))
    norm = torch.nn.RMSNorm(16, eps=1e-5, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.copy_(ww)
    want = norm(xx) * torch.nn.functional.silu(zz)
    want.backward(do.double())
    assert torch.allclose(y, want.detach(), atol=1e-12)
    assert torch.allclose(grads["dx"], xx.grad, atol=1e-12) and torch.allclose(grads["dz"], zz.grad, atol=1e-12)
    assert torch.allclose(grads["dw"], norm.weight.grad, atol=1e-12)
    assert torch.equal(w.to(torch.bfloat16).double() - 1, (w - 1).to(torch.bfloat16).double())  # exact either way


def test_sizes_are_taken_as_the_help_prints_them(benchmark_module, capsys):
    """Issue #25: `route_build.py --t 1M` was refused ("invalid int value") while its help said
    "default 32K 128K 1M". Every default list the help prints parses back to the default."""
    import re

    route_build = benchmark_module("route_build")
    with pytest.raises(SystemExit):
        route_build.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for flag, dest, full in (("--t", "t", route_build.FULL_T), ("--seqs", "seqs", route_build.FULL_SEQS),
                             ("--cp", "cp", route_build.FULL_CP)):
        shown = re.search(rf"{flag} [A-Z]+ \[[A-Z]+ \.\.\.\] .*?\(default ([0-9KM ]+)[;)]", help_text).group(1).split()
        assert getattr(route_build.parse_args([flag, *shown]), dest) == list(full), (flag, shown)
    assert route_build.parse_args(["--t", "4096", "4k", "2M"]).t == [4096, 4096, 2 * 1024 * 1024]
    for bad in ("1.5M", "0", "1G", "1_000", "-4K"):
        with pytest.raises(SystemExit):
            route_build.parse_args(["--t", bad])
        assert "is not a token count" in capsys.readouterr().err or bad == "-4K"
