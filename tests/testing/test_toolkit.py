"""The toolkit's small parts: metrics, packings, results, probes."""

from __future__ import annotations

import json
import math

import pytest
import torch

from gdn_cp.layout import build_natural_order
from gdn_cp.ops.accuracy import max_rel, rel_l2, worst
from gdn_cp_testing.packings import named_packings, thd_case, zigzag_rows
from gdn_cp.layout.packings import packed_boundaries
from gdn_cp_testing.probes import env_setting, swap_points
from gdn_cp_testing.results import JsonlRecorder, write_json


@pytest.mark.parametrize("metric", [max_rel, rel_l2])
def test_metrics_refuse_to_pass_what_is_missing_or_wrong(metric):
    a = torch.tensor([1.0, -2.0, 4.0])
    assert metric(a, a) == 0.0
    assert metric(None, a) == math.inf and metric(a, None) == math.inf
    assert metric(a[:2], a) == math.inf  # shape mismatch
    assert metric(torch.zeros(3), torch.zeros(3)) == 0.0
    assert metric(a, torch.zeros(3)) == math.inf  # no scale: any difference is infinitely wrong
    assert math.isnan(metric(torch.tensor([1.0, float("nan"), 4.0]), a))
    assert metric(torch.zeros(0, 3), torch.zeros(0, 3)) == 0.0


def test_metric_values():
    want = torch.tensor([3.0, 4.0], dtype=torch.float64)
    got = torch.tensor([3.0, 4.5], dtype=torch.float32)
    assert max_rel(got, want) == pytest.approx(0.5 / 4.0)
    assert rel_l2(got, want) == pytest.approx(0.5 / 5.0)
    assert worst({"a": 1e-3, "b": float("nan"), "c": 1.0})[0] == "b"
    assert worst({}) == ("-", 0.0)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_rows_agree_with_the_library(cp):
    """The toolkit's zigzag rows are written independently of gdn_cp.layout: both must agree."""
    for name, cu in {**named_packings(cp), "thd_case": thd_case(cp)[0]}.items():
        for rank in range(cp):
            want = build_natural_order(cu, cp, rank).own_rows
            assert torch.equal(zigzag_rows(cu, cp, rank), want.to(torch.long)), (name, cp, rank)


def test_zigzag_rows_name_the_bad_sequence():
    with pytest.raises(ValueError, match=r"sequence 1 of cu has length 6, not divisible by 2\*cp=4"):
        zigzag_rows([0, 4, 10], 2, 0)


def test_packed_boundaries():
    cu = packed_boundaries(37, 4096, 4, seed=3)
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    assert len(lengths) == 37 and cu[0] == 0 and cu[-1] == 4096
    assert all(n >= 0 and n % 8 == 0 for n in lengths) and lengths.count(0) >= 2
    assert packed_boundaries(37, 4096, 4, seed=3) == cu  # seeded
    with pytest.raises(ValueError, match="t_global=100"):
        packed_boundaries(3, 100, 4, seed=0)
    with pytest.raises(ValueError, match="num_sequences=0"):
        packed_boundaries(0, 64, 4, seed=0)


def test_jsonl_recorder_writes_context_first(tmp_path):
    path = tmp_path / "out" / "rows.jsonl"
    rec = JsonlRecorder(path, run="x")
    rec.record("case", value=1.5)
    rec.record("case", value=2.5)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["context", "case", "case"]
    assert rows[0]["versions"]["torch"] == torch.__version__ and rows[0]["machine"]["logical_cores"] >= 1
    assert rows[2]["value"] == 2.5 and rows[2]["run"] == "x" and rows[2]["date"]
    JsonlRecorder(None).record("case", value=1)  # no path: records nothing, raises nothing
    JsonlRecorder(path, context=False).record("case", value=3.5)  # another process wrote the context row
    assert [json.loads(line)["kind"] for line in path.read_text().splitlines()] == ["context", "case", "case", "case"]


def test_write_json_replaces_atomically(tmp_path):
    path = write_json(tmp_path / "a" / "r.json", {"x": [1, 2]})
    write_json(path, {"x": [3]})
    assert json.loads(path.read_text()) == {"x": [3]}
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]  # no temporary left behind


def test_write_json_writes_rows_one_a_line(tmp_path):
    rows = [{"case": "stock", "ms": 1.5, "profile": {"top": [["k", 0.1]]}}, {"case": "patched", "ms": float("nan")}]
    path = write_json(tmp_path / "rows.json", rows)
    lines = path.read_text().splitlines()
    assert lines[0] == "[" and lines[-1] == "]" and len(lines) == 4, lines
    loaded = json.loads(path.read_text())
    assert loaded[0] == rows[0] and loaded[1]["case"] == "patched" and loaded[1]["ms"] != loaded[1]["ms"]
    assert json.loads(write_json(tmp_path / "empty.json", []).read_text()) == []


def test_probes(monkeypatch):
    """env_setting sets and restores a variable; swap_points records what chunkwise chose per layer,
    and the library's choice is back in place afterwards."""
    import os

    import gdn_cp.modes.chunkwise as chunkwise
    from gdn_cp.layout import RouteCache
    from gdn_cp.modes import CallContext, GDNShape, LayerFacts, Settings, prepare_mode
    from gdn_cp.ops import get_backend

    monkeypatch.setenv("GDN_CP_CHUNKWISE_SWAP", "auto")
    with env_setting("GDN_CP_CHUNKWISE_SWAP", "core"):
        assert os.environ["GDN_CP_CHUNKWISE_SWAP"] == "core"
        with env_setting("GDN_CP_CHUNKWISE_SWAP", None):
            assert "GDN_CP_CHUNKWISE_SWAP" not in os.environ
    assert os.environ["GDN_CP_CHUNKWISE_SWAP"] == "auto"

    shape = GDNShape(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8)
    plan = RouteCache().plan([0, 8, 32], 2, 0)
    original = chunkwise.Chunkwise.__dict__["prepare"]
    with swap_points() as seen:
        for swap, label in (("core", "a"), ("hidden", "a"), ("auto", "b")):
            layer = LayerFacts(label=label, hidden_size=32, tp=1, sequence_parallel=False, act_bytes=4)
            ctx = CallContext(settings=Settings(mode="chunkwise", chunkwise_swap=swap), shape=shape, plan=plan,
                              group=object(), backend=get_backend("reference"), layer=layer)
            prepare_mode(ctx)
    assert seen == {"a": {"core", "hidden"}, "b": {"hidden"}}  # auto: 2*32*4 B/token < the core tensors' 416
    assert chunkwise.Chunkwise.__dict__["prepare"] is original


def _kernel_library_call(fail: bool):
    """Stands for a kernel library's function that reads a device value back (a sync)."""
    if fail:
        raise RuntimeError("called a synchronizing CUDA operation")
    import warnings

    warnings.warn("called a synchronizing CUDA operation")
    return 7


def test_sync_probes_name_where_each_sync_is(monkeypatch):
    """A failing zero-sync GPU test says where the syncs are (run 2026-12-07f's FlashQLA test said only "5"): each
    message names the frames that made it, the library's function first; ``first_sync_site`` names the first one
    from the error torch's "error" mode raises (backward included). Torch's CUDA calls are stubbed: the CPU has none."""
    from gdn_cp_testing import probes

    modes = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    result, syncs = probes.count_syncs(lambda: _kernel_library_call(False))
    assert result == 7 and len(syncs) == 1 and modes == ["warn", 0], (syncs, modes)
    assert syncs[0].startswith("called a synchronizing CUDA operation at tests/testing/test_toolkit.py:"), syncs
    assert " _kernel_library_call <- tests/testing/test_toolkit.py:" in syncs[0] and "<lambda>" in syncs[0], syncs
    site = probes.first_sync_site(lambda: _kernel_library_call(True))
    assert site.startswith("tests/testing/test_toolkit.py:") and " _kernel_library_call <- " in site, site
    assert probes.first_sync_site(lambda: None) is None and modes[-2:] == ["error", 0]


def test_fast_autotune_takes_the_first_config_that_runs(monkeypatch):
    """GDN_CP_TEST_FAST_AUTOTUNE=1 on a stub run/_bench of Triton's Autotuner: a config that does
    not fit (inf) is skipped, the first that runs is taken, later ones are never compiled, and
    autotune results are not cached. The class is restored afterwards."""
    autotuner = pytest.importorskip("triton.runtime.autotuner")
    from gdn_cp_testing.ranks import maybe_fast_autotune

    cls = autotuner.Autotuner
    timings = {"too_big": float("inf"), "fits": 2.0, "faster": 1.0}
    benched = []

    def stub_bench(self, *args, config, **meta):
        benched.append(config)
        return [timings[config]] * 3

    def stub_run(self, *args, **kwargs):
        return {c: self._bench(config=c) for c in timings}

    monkeypatch.setattr(cls, "_bench", stub_bench)
    monkeypatch.setattr(cls, "run", stub_run)
    monkeypatch.setattr(cls, "_gdn_cp_fast", False, raising=False)
    monkeypatch.delenv("GDN_CP_TEST_FAST_AUTOTUNE", raising=False)
    assert maybe_fast_autotune() is False and cls.run is stub_run  # opt-in only
    monkeypatch.setenv("GDN_CP_TEST_FAST_AUTOTUNE", "1")
    assert maybe_fast_autotune() is True
    tuner = object.__new__(cls)
    tuner.cache_results = True
    result = tuner.run()
    assert benched == ["too_big", "fits"]  # "faster" was never compiled or timed
    assert result["faster"][0] == float("inf") and result["fits"][0] == 2.0
    assert tuner.cache_results is False


def test_every_smoke_run_is_a_fixture_of_its_module():
    """tests/conftest.py starts a module's ``SMOKE_RUNS[key]`` in the background only for the selected tests that
    name ``key`` as a fixture; a test that calls ``start_smoke_run`` itself waits for the whole run (the example
    loop and the docs recipe did: 24 s of a CI session spent waiting)."""
    import ast
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    found = 0
    for path in sorted(tests.rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        runs = [n.value for n in tree.body if isinstance(n, ast.Assign)
                and any(getattr(t, "id", None) == "SMOKE_RUNS" for t in n.targets)]
        if not runs:
            continue
        fixtures = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)
                    and any("fixture" in ast.unparse(d) for d in n.decorator_list)}
        keys = {k.value for k in runs[0].keys}
        assert keys <= fixtures, f"{path.name}: smoke runs {sorted(keys - fixtures)} are no fixture of the module"
        found += len(keys)
    assert found >= 5, found
