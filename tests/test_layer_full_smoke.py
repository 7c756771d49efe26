"""benchmarks/layer_full.py on the CPU: one small run (2 gloo ranks, reference backend, tiny shape;
stock megatron-core from a pristine copy in its own ranks, the gdn-cp cases from a patched copy)
writes rows with the promised fields, and every case's output and gradients equal CP=1's, so the
benchmark times correct code. The pure pieces (packings, bytes per token from the plan, statistics
over ranks, the profile split, row merging) are checked against independent counts. No timing
assertions: CI machines are shared and noisy."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
import sys

import pytest

import torch

from benchmarks import layer_full, measure, plot_layer_full
from benchmarks import layer_full_math as lfm
from benchmarks.measure import spans_from_trace
from gdn_cp.ops.accuracy import rel_l2
from gdn_cp_testing.packings import zigzag_rows
from tests.conftest import start_smoke_run
from tests.megatron.conftest import patched_megatron  # noqa: F401 - the fixture, for the switch test

ROW_KEYS = {"gpus", "backend", "cp", "tp", "T", "layout", "packing", "case", "median_ms", "p10_ms", "p90_ms",
            "iters", "peak_gib", "machine", "versions", "date", "knobs", "bytes_per_token", "status", "check",
            "megatron", "core", "cu"}
TINY = lfm.GDNDims(hidden=32, num_k_heads=4, num_v_heads=8, head_k_dim=8, head_v_dim=8, conv_width=4)
FP32_TOL = 1e-5


# started in the background when the session starts (tests/conftest.py: a run is mostly process
# start-ups and megatron imports), unless the session may patch the installed megatron-core while it runs
SMOKE_RUNS = {
    "smoke": ("layer_full", ["--quick", "--tokens", "256", "--packings", "mixed8,sbhd", "--iters", "2"]),
    # --cp 1: one process per megatron tree, the whole packing and both slices of a CP=2 run
    "smoke_cp1": ("layer_full", ["--quick", "--cp", "1", "--slice-of-cp", "2", "--tokens", "256", "--packings",
                                 "mixed8", "--iters", "2", "--spec", "te,local", "--levers", "fused_norm,glue_unfused"]),
}
SMOKE_IMPORTS_MEGATRON = True


def _smoke_rows(fixture: str):
    code, printed, out = start_smoke_run(sys.modules[__name__], fixture).result(timeout_s=300)
    args = " ".join(SMOKE_RUNS[fixture][1])
    assert code == 0, f"layer_full.py {args} failed ({code}):\n{printed[-8000:]}"
    return json.loads(out.read_text()), printed


@pytest.fixture(scope="module")
def smoke():
    return _smoke_rows("smoke")


def test_help_lists_the_knobs():
    text = layer_full.build_parser().format_help()
    for flag in ("--tokens", "--packings", "--cases", "--warmup", "--iters", "--profile-iters", "--time-limit",
                 "--compile-only", "--out", "--quick", "--backend"):
        assert flag in text, flag


def test_rows_say_which_backend_gdn_cp_ran(smoke):
    """--backend (default auto) is a knob of every row and of its run key; gdn-cp's rows name the
    kernels their layers ran (the reference on the CPU); a named backend marks gdn-cp's case keys."""
    rows, _ = smoke
    for r in rows:
        assert r["knobs"]["linear_cp_backend"] == "auto"
        if r["case"] not in lfm.STOCK_CASES and r["status"] == "ok":
            # the reference reads grouped heads: the conv never repeats q and k for it
            assert r["gdn_cp_backend"] == "reference" and r["key_heads_in_glue"] is False, r["case"]
            assert r["wide_column_copy"] is (r.get("lever_off") != "narrow_copy"), r["case"]  # what the row ran
            # the conv's switches kept on the row (None here: the CPU runs the plain glue, no Triton conv)
            assert r["halo_rows_apart"] is None and r["scan_branch_masks"] is None, r["case"]
    row = dict(rows[0], knobs=dict(rows[0]["knobs"], linear_cp_backend="flashqla"))
    assert lfm.run_key(row) != lfm.run_key(rows[0])
    patched = next(r for r in rows if r["case"] not in lfm.STOCK_CASES)
    assert lfm.case_key(dict(patched, knobs=row["knobs"])) == lfm.case_key(patched) + "|flashqla"


def test_every_case_measured_with_the_promised_fields(smoke):
    rows, stdout = smoke
    assert {(r["packing"], r["case"]) for r in rows} == {(p, c) for p in ("mixed8", "sbhd") for c in lfm.CASES}
    for r in rows:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert r["status"] == "ok", (r["case"], r["error"])
        assert (r["cp"], r["tp"], r["T"], r["backend"], r["gpus"]) == (2, 1, 256, "gloo", 0)
        assert r["layout"] == ("sbhd" if r["packing"] == "sbhd" else "thd")
        assert r["iters"] == 2 and len(r["iter_max_ms"]) == 2
        assert 0 < r["p10_ms"] <= r["median_ms"] <= r["p90_ms"]
        assert r["peak_gib"] is None  # CPU: no CUDA allocator
        assert r["knobs"]["dims"] == vars(TINY) and r["versions"]["torch"]
    assert "| T | packing |" in stdout  # the markdown table


def test_every_case_equals_cp1(smoke):
    """Output rows, input-gradient rows and parameter gradients (summed over CP) against CP=1 on
    the same weights and inputs: the benchmark times code that computes the right thing."""
    rows, _ = smoke
    for r in rows:
        if r["case"] == "cp1_slice":  # the ideal drops the state a slice inherits: not a CP=1 answer
            assert r["check"] is None
            continue
        c = r["check"]
        assert max(c["out"], c["grad_x"], c["grad_params"]) <= FP32_TOL, (r["packing"], r["case"], c)
        assert c["suspect"] is False


@pytest.fixture(scope="module")
def smoke_cp1():
    """``--cp 1``: one process per megatron tree, the whole packing and both slices of a CP=2 run."""
    return _smoke_rows("smoke_cp1")


def _base_rows(rows):
    """The local-spec rows with every lever on (the te rows cannot run without TransformerEngine)."""
    return [r for r in rows if r["spec"] == "local" and r["lever_off"] is None]


def test_cp1_rows_time_the_whole_packing_and_each_slice(smoke_cp1):
    rows, stdout = smoke_cp1
    rows = _base_rows(rows)
    keys = sorted(lfm.case_key(r) for r in rows)
    assert keys == sorted(["stock_cp1", "patched_cp1", "stock_slice[r0]", "stock_slice[r1]",
                           "patched_slice[r0]", "patched_slice[r1]"])
    _, cu = lfm.packing("mixed8", 256, 4)
    for r in rows:
        assert r["status"] == "ok", (lfm.case_key(r), r["error"])
        assert (r["cp"], r["T"], r["bytes_per_token"]) == (1, 256, 0)
        assert r["megatron"]["state"] == ("pristine" if r["case"].startswith("stock") else "patched")
        if r["case"].endswith("_slice"):
            assert r["slice_cu"] == lfm.contiguous_slice(cu, 2, r["slice_rank"]) and r["rows_timed"] == 128
        else:
            assert r["rows_timed"] == 256
    # mixed8 at T=256: the third sequence, rows [100, 140), crosses row 128
    by = {lfm.case_key(r): r for r in rows}
    assert by["patched_slice[r0]"]["slice_continues"] == {"from_left": False, "to_right": True}
    assert by["patched_slice[r1]"]["slice_continues"] == {"from_left": True, "to_right": False}
    # the per-rank table: a row for the whole packing and one per slice, each with stock on the same rows
    assert "| mixed8 | all |" in stdout and "| mixed8 | rank 1 of CP=2 |" in stdout and "| / stock |" in stdout


def test_cp1_patched_equals_stock_on_the_same_rows(smoke_cp1):
    """gdn-cp's THD path at CP=1 against stock megatron-core's code on the same module and rows, with
    every lever on and with each lever off."""
    rows, _ = smoke_cp1
    for r in rows:
        if r["spec"] == "te":
            continue
        if r["case"].startswith("stock"):
            assert r["check"] is None
            continue
        c = r["check"]
        assert max(c["out"], c["grad_x"], c["grad_params"]) <= FP32_TOL, (lfm.case_key(r), c)
        assert c["against"].startswith("stock")


def test_te_spec_without_transformer_engine_fails_clearly(smoke_cp1):
    """Here TransformerEngine is missing: every te row is an error that names it and the way out,
    the local rows still run, and each row says its spec, lever and FLA stack."""
    rows, _ = smoke_cp1
    te = [r for r in rows if r["spec"] == "te"]
    assert len(te) == 6 + 3 + 3  # stock and patched at CP=1 and per slice; patched with each lever switched
    for r in te:
        assert r["status"] == "error" and "TransformerEngine is not importable" in r["error"], r["error"]
        assert "--spec local" in r["error"] and r["median_ms"] is None
    assert {r["status"] for r in rows if r["spec"] == "local"} == {"ok"}
    assert all(r["stack"].startswith("fla ") and " + triton " in r["stack"] for r in rows)
    assert [r["unit"] for r in rows] == sorted(r["unit"] for r in rows)  # plan order: te, te-lever, local, ...


def test_lever_rows_beside_the_rows_with_every_lever_on(smoke_cp1):
    """--levers fused_norm: the patched cases once more with the fused norm switched off, same rows and
    weights; stock has no such lever. On the CPU the reference backend has no fused norm, so both
    take the layer's own norm (the switch itself is tested below on a backend that has one)."""
    rows, stdout = smoke_cp1
    off = [r for r in rows if r["spec"] == "local" and r["lever_off"] == "fused_norm"]
    assert sorted(lfm.case_key(r) for r in off) == sorted(
        f"{c}|-fused_norm" for c in ("patched_cp1", "patched_slice[r0]", "patched_slice[r1]"))
    for r in _base_rows(rows) + off:
        assert r["status"] == "ok"
        want = "stock" if r["case"].startswith("stock") else "unfused"
        assert r["norm_path"].startswith(want), r["norm_path"]
        assert r["modules"]["out_norm"] == "torch.nn.modules.normalization.RMSNorm"
    assert "fused_norm off ms" in stdout and "Per rank, stock megatron-core" in stdout
    glue_rows = [r for r in rows if r["spec"] == "local" and r["lever_off"] == "glue_unfused"]
    assert len(glue_rows) == 3 and {r["status"] for r in glue_rows} == {"ok"}  # the switch re-reads the settings
    # each patched row names the glue path its layer ran (layer_full_glue.json's test groups rows by it)
    # (off CUDA every setting runs the eager glue: gdn_cp.ops.fused.glue_path)
    assert {r["glue"] for r in glue_rows} == {"eager"}
    assert all(r.get("glue") for r in rows if r["status"] == "ok" and not r["case"].startswith("stock")), rows


def _fused_norm_switch_case(ctx, spec):  # noqa: ARG001 - a rank-pool task
    """In a rank: the patched layer's forward on a backend that has a fused gated norm (the reference
    backend plus a counting torch stand-in for FLA's kernel): it is used with every lever on, not
    under ``layer_full_rank.fused_norm_off``, and used again after it; outputs agree."""
    from dataclasses import replace

    import torch.nn.functional as F

    import gdn_cp.megatron.layer as glue
    from benchmarks import layer_full_rank as lfr
    from gdn_cp.ops import get_backend
    from gdn_cp_testing.megatron.layer import build_gdn, make_config, rank_groups, run_layer, thd_params

    calls = [0]

    def fused(x, z, weight, eps):
        calls[0] += 1
        xf = x.float()
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight.float() * F.silu(z.float())).to(x.dtype)

    backend = replace(get_backend("reference"), fused_gated_rms_norm=lambda: fused)
    saved = glue.choose_backend
    glue.choose_backend = lambda settings, layer, device: backend
    try:
        torch.manual_seed(0)
        m = build_gdn(make_config(1, "chunkwise", torch.float32), rank_groups()["self"], seed=2)
        x, dout = torch.randn(64, 1, m.config.hidden_size), torch.randn(64, 1, m.config.hidden_size)
        psp = thd_params([0, 24, 64])
        got = []
        for switch in (None, lfr.fused_norm_off, None):
            calls[0] = 0
            with switch([m]) if switch else contextlib.nullcontext():
                y, gx, _ = run_layer(m, x, dout, packed_seq_params=psp)
            got.append((calls[0], y, gx))
    finally:
        glue.choose_backend = saved
    return {"calls": [c for c, _, _ in got],
            "out": max(rel_l2(got[1][1], got[0][1]), rel_l2(got[2][1], got[0][1])),
            "grad_x": max(rel_l2(got[1][2], got[0][2]), rel_l2(got[2][2], got[0][2]))}


@pytest.mark.usefixtures("patched_megatron")
def test_fused_norm_switch_turns_the_lever_off_and_back_on(rank_pool):
    [res] = rank_pool(1).run(_fused_norm_switch_case, {})
    assert res["calls"][0] > 0 and res["calls"][1] == 0 and res["calls"][2] > 0, res
    assert res["out"] < 1e-5 and res["grad_x"] < 1e-5, res  # the same math either way (fp32)


def test_every_lever_has_its_switch_and_the_flag_levers_turn_their_flag_for_the_row_only():
    from benchmarks.layer_full_rank import LEVER_SWITCHES
    from gdn_cp.ops.fused import glue

    assert set(LEVER_SWITCHES) == set(lfm.LEVERS)
    assert glue.REPEAT_KEY_HEADS_IN_CONV  # on by default since runs 2026-12-06l/o
    with LEVER_SWITCHES["key_heads_by_backend"]([]):
        assert not glue.REPEAT_KEY_HEADS_IN_CONV
    assert glue.REPEAT_KEY_HEADS_IN_CONV
    from gdn_cp.ops.fused import split

    assert split.WIDE_COLUMN_COPY  # on by default since runs 2026-12-07c-e: the lever turns it off for its row
    with LEVER_SWITCHES["narrow_copy"]([]):
        assert not split.WIDE_COLUMN_COPY
    assert split.WIDE_COLUMN_COPY
    from gdn_cp.ops.fused import triton_conv

    # off by default (run 2026-12-07q; the scan's tail loop not yet timed): the lever reads the halo apart both ways
    assert not (triton_conv.HALO_ROWS_APART or triton_conv.SCAN_HALO_TAIL)
    with LEVER_SWITCHES["halo_apart"]([]):
        assert triton_conv.HALO_ROWS_APART and triton_conv.SCAN_HALO_TAIL
    assert not (triton_conv.HALO_ROWS_APART or triton_conv.SCAN_HALO_TAIL)
    assert not triton_conv.SCAN_BRANCH_MASKS  # off by default (not yet timed on a GPU): the lever turns it on
    with LEVER_SWITCHES["scan_branch"]([]):
        assert triton_conv.SCAN_BRANCH_MASKS and not triton_conv.FTZ_SIGMOID
    assert not (triton_conv.SCAN_BRANCH_MASKS or triton_conv.FTZ_SIGMOID)  # off by default (not yet timed on a GPU)
    with LEVER_SWITCHES["scan_branch_ftz"]([]):
        assert triton_conv.SCAN_BRANCH_MASKS and triton_conv.FTZ_SIGMOID
    assert not (triton_conv.SCAN_BRANCH_MASKS or triton_conv.FTZ_SIGMOID)


def test_plan_units_and_keys():
    assert lfm.parse_plan("te:32K, te:128K,te-fused_norm:32K,local:128K") == [
        ("te", None, 32768), ("te", None, 131072), ("te", "fused_norm", 32768), ("local", None, 131072)]
    for bad in ("te", "tee:32K", "te-nope:32K", "te:32K,te:32K", ""):
        with pytest.raises(ValueError):
            lfm.parse_plan(bad)
    row = {"case": "patched_slice", "slice_rank": 1, "spec": "te", "lever_off": "fused_norm"}
    assert lfm.case_key(row) == "patched_slice[r1]|te|-fused_norm"
    assert lfm.case_key({"case": "stock_cp1", "spec": "local", "lever_off": None}) == "stock_cp1"
    assert plot_layer_full._stock_key("patched_slice[r1]|te|-fused_norm") == "stock_slice[r1]|te"
    assert plot_layer_full._base("patched_slice[r1]|te") == "patched_slice"
    base = {"device": "cuda", "gpus": 1, "cp": 1, "T": 32768, "knobs": {}, "versions": {"fla": "0.6.0"}}
    keys = {lfm.run_key(dict(base, spec=s, versions={"fla": f})) for s in ("te", "local") for f in ("0.4.2", "0.6.0")}
    assert len(keys) == 4  # a te run never replaces local rows, nor one FLA stack another's
    assert lfm.run_key(base) == lfm.run_key(dict(base, spec="local"))  # rows from before spec are local


def test_plan_arguments(tmp_path):
    parse = lambda *a: layer_full.resolve_args(layer_full.build_parser().parse_args(["--device", "cpu", *a]))  # noqa: E731
    args = parse("--cp", "1", "--slice-of-cp", "2", "--plan", "te:32K,te-fused_norm:32K,local:128K")
    assert args.units == [("te", None, 32768), ("te", "fused_norm", 32768), ("local", None, 131072)]
    assert args.tokens == [32768, 131072] and args.specs == ["te", "local"] and args.levers == ["fused_norm"]
    args = parse("--cp", "1", "--spec", "te,local", "--levers", "fused_norm", "--tokens", "32K", "128K")
    assert args.units[:3] == [("te", None, 32768), ("te", None, 131072), ("te", "fused_norm", 32768)]
    with pytest.raises(SystemExit, match="leave out"):
        parse("--cp", "1", "--plan", "te:32K", "--tokens", "32K")
    with pytest.raises(SystemExit, match="add a patched case"):
        parse("--cp", "1", "--levers", "fused_norm", "--cases", "stock_cp1")
    rows = layer_full.plan_rows(parse("--cp", "1", "--plan", "te:32K,te-fused_norm:32K", "--packings", "mixed8"),
                                {"date": "d", "run_id": "r", "knobs": {}, "machine": {}, "command": "c",
                                 "versions": {"fla": "0.6.0", "triton": "3.7.1"}})
    assert [(r["unit"], lfm.case_key(r)) for r in rows] == [
        (0, "stock_cp1|te"), (0, "patched_cp1|te"), (1, "patched_cp1|te|-fused_norm")]
    assert {r["stack"] for r in rows} == {"fla 0.6.0 + triton 3.7.1"}


def test_cp1_arguments_are_checked():
    parse = lambda *a: layer_full.resolve_args(layer_full.build_parser().parse_args(["--device", "cpu", *a]))  # noqa: E731
    with pytest.raises(SystemExit, match="--slice-of-cp goes with --cp 1"):
        parse("--cp", "2", "--slice-of-cp", "2")
    with pytest.raises(SystemExit, match="need --slice-of-cp"):
        parse("--cp", "1", "--cases", "patched_slice")
    with pytest.raises(SystemExit, match="cannot run at --cp 2"):
        parse("--cp", "2", "--cases", "stock_cp1")
    with pytest.raises(SystemExit, match="multiple of 2\\*cp=8"):
        parse("--cp", "1", "--slice-of-cp", "4", "--align", "4", "--tokens", "256")
    assert parse("--cp", "1").cases == ["stock_cp1", "patched_cp1"]
    assert parse("--cp", "1", "--slice-of-cp", "2").cases == list(lfm.CP1_CASES)


def test_stock_ran_pristine_megatron_in_its_own_ranks(smoke):
    rows, _ = smoke
    stock = [r for r in rows if r["case"] == "stock_headwise"]
    patched = [r for r in rows if r["case"] != "stock_headwise"]
    assert {r["megatron"]["state"] for r in stock} == {"pristine"}
    assert {r["megatron"]["state"] for r in patched} == {"patched"}
    assert {r["megatron"]["root"] for r in stock}.isdisjoint({r["megatron"]["root"] for r in patched})
    assert all(r["core"] is None for r in stock)  # stock's core is inline: only the layer is timed
    assert all(r["core"]["median_ms"] > 0 for r in patched)


def test_bytes_per_token_in_the_rows(smoke):
    """fp32 tiny shape: C=128 channels, V=64, Hv=8, H=32, a=4 bytes, cp=2."""
    rows, _ = smoke
    by = {(r["packing"], r["case"]): r for r in rows}
    for p in ("mixed8", "sbhd"):
        assert by[p, "stock_headwise"]["bytes_per_token"] == (128 + 64 + 16 + 64) * 4  # (cp-1)/cp * 2 directions
        assert by[p, "headwise"]["bytes_per_token"] == (128 + 64) * 4 + 8 * 8
        assert by[p, "all_gather"]["bytes_per_token"] == 2 * (128 * 4 + 8 * 8)
        assert by[p, "cp1_slice"]["bytes_per_token"] == 0
        assert by[p, "chunkwise_hidden"]["bytes_per_token"] < by[p, "chunkwise_core"]["bytes_per_token"]
        # on gloo both hidden-swap cases take gdn-cp's own exchange: the same bytes
        assert by[p, "chunkwise_generic"]["chunkwise_path"] == by[p, "chunkwise_hidden"]["chunkwise_path"] == "generic"
        assert by[p, "chunkwise_generic"]["bytes_per_token"] == by[p, "chunkwise_hidden"]["bytes_per_token"]
    slices = by["mixed8", "cp1_slice"]
    assert slices["slices"] == [lfm.contiguous_slice(slices["cu"], 2, r) for r in range(2)]
    assert slices["critical_rank"] in (0, 1)
    # mixed8 at T=256, cp=2: the third sequence, rows [100, 140), crosses row 128: rank 0 hands it on
    # and rank 1 takes it over
    assert slices["slice_continues"] == [{"from_left": False, "to_right": True}, {"from_left": True, "to_right": False}]


def test_markdown_and_merge(smoke, tmp_path):
    rows, _ = smoke
    text = plot_layer_full.markdown_tables(rows)
    assert "stock headwise" in text and "ideal" in text and "x, " in text
    old = [dict(r, T=512) for r in rows[:2]] + [dict(r, median_ms=-1.0) for r in rows]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(old))
    b.write_text(json.dumps(rows))
    merged = plot_layer_full.load_rows([a, b])
    assert len(merged) == 2 + len(rows)  # T=512 kept, the T=256 rows replaced by the later file
    assert all(r["median_ms"] > 0 for r in merged)


def test_rows_file_replaces_rows_of_the_same_run(tmp_path):
    path = tmp_path / "rows.json"
    mine = {"device": "cpu", "gpus": 0, "cp": 2, "tp": 1, "T": 256, "knobs": {"dtype": "float32", "dims": {"a": 1}}}
    other = dict(mine, T=512)
    path.write_text(json.dumps([dict(mine, case="x"), dict(other, case="y")]))
    rows = layer_full.Rows(path, [mine])
    assert [r["case"] for r in rows.kept] == ["y"]
    rows.add(dict(mine, case="z"))
    assert [r["case"] for r in json.loads(path.read_text())] == ["y", "z"]
    path.write_text(json.dumps({"not": "rows"}))
    with pytest.raises(SystemExit, match="not a list"):
        layer_full.Rows(path, [mine])


# ---------------------------------------------------------------------------------------------
# pure pieces
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", lfm.PACKINGS)
@pytest.mark.parametrize("t", [8192, 32768, 131072])
def test_packings(name, t):
    layout, cu = lfm.packing(name, t, 64)
    assert cu[0] == 0 and cu[-1] == t
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    assert all(n > 0 and n % 64 == 0 for n in lengths)
    assert len(lengths) == {"mixed8": 8, "sbhd": 1}[name]
    assert layout == ("sbhd" if name == "sbhd" else "thd")


def test_packing_errors_name_the_fix():
    with pytest.raises(ValueError, match="--align"):
        lfm.packing("sbhd", 1000, 64)
    with pytest.raises(ValueError, match="mixed8 needs"):
        lfm.packing("mixed8", 2048, 64)
    with pytest.raises(ValueError, match="packing must be one of"):
        lfm.packing("nope", 4096, 64)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("name", ["mixed8", "one_sequence", "many_short"])
def test_rows_leaving_matches_a_per_row_count(cp, name):
    """Route send splits against the per-row truth: a zigzag row leaves its rank for the contiguous
    layout when it lies outside the rank's block, and a block row leaves when another rank owns it
    in the zigzag layout."""
    cu = {"mixed8": lfm.packing("mixed8", 4096, 64)[1], "one_sequence": [0, 4096],
          "many_short": list(range(0, 4097, 64))}[name]
    t_local = cu[-1] // cp
    owner = {}
    for r in range(cp):
        for g in zigzag_rows(cu, cp, r).tolist():
            owner[g] = r
    for r in range(cp):
        mine = zigzag_rows(cu, cp, r).tolist()
        to_c = sum(1 for g in mine if g // t_local != r)
        to_z = sum(1 for g in range(r * t_local, (r + 1) * t_local) if owner[g] != r)
        assert lfm.rows_leaving("thd", cu, cp, r, "zigzag", "contiguous") == to_c
        assert lfm.rows_leaving("thd", cu, cp, r, "contiguous", "zigzag") == to_z


def test_bytes_per_token_qwen_shape():
    """Qwen3.5-9B GDN, bf16, CP=2, fwd+bwd: stock headwise 32,896 B/token, gdn-cp headwise 24,832
    (z stays home), the hidden swap 16,384 on one long sequence plus the state/halo exchange."""
    q = lfm.GDNDims()
    cu = [0, 32768]
    b = lambda case, **kw: lfm.bytes_per_token(case, layout="thd", cu=cu, cp=2, dims=q, act_bytes=2, **kw)  # noqa: E731
    assert b("stock_headwise")["bytes_per_token"] == 32896
    assert b("headwise")["bytes_per_token"] == 24832
    hidden = b("chunkwise_hidden", chunkwise_path="fla")
    state = 32 * 128 * 256 * 4
    tail = 3 * 8192 * 2
    assert hidden["exchange_per_rank"] == [(tail + 2 * state) / 16384] * 2
    assert hidden["bytes_per_token"] == 16384 + (tail + 2 * state) / 16384
    assert b("cp1_slice")["bytes_per_token"] == 0
    # FlashQLA's scan exchange: one block of [Hv, Dk, Dv] + [Hv, Dk, Dk] in bf16 per rank and direction
    packed = 32 * 128 * 256 * 2
    assert b("chunkwise_hidden", chunkwise_path="flashqla")["exchange_per_rank"] == [(tail + 2 * packed) / 16384] * 2


def test_iteration_stats_take_the_slowest_rank_per_iteration():
    s = measure.iteration_stats([[1.0, 5.0, 3.0], [4.0, 2.0, 3.0]])
    assert s["iter_max_ms"] == [4.0, 5.0, 3.0]
    assert s["median_ms"] == 4.0 and s["per_rank_median_ms"] == [3.0, 3.0]
    assert s["p10_ms"] == pytest.approx(3.2) and s["p90_ms"] == pytest.approx(4.8)
    with pytest.raises(ValueError, match="same non-zero number"):
        measure.iteration_stats([[1.0], [1.0, 2.0]])


def test_split_busy_time_gives_each_instant_to_one_part():
    spans = {"compute": [(0, 10), (5, 12), (30, 40)],  # union 0-12, 30-40
             "nccl": [(8, 20), (35, 50)],              # exclusive 12-20, 40-50
             "memcpy": [(19, 25), (60, 61)]}            # exclusive 20-25, 60-61
    s = measure.split_busy_time(spans, wall=100)
    assert (s["compute"], s["nccl"], s["memcpy"]) == (22, 18, 6)
    assert s["idle"] == 100 - 46 and s["compute"] + s["nccl"] + s["memcpy"] + s["idle"] == 100
    assert s["compute_total"] == 27 and s["nccl_total"] == 27
    with pytest.raises(ValueError, match="categories"):
        measure.split_busy_time({"cpu": [(0, 1)]}, 1)


def test_spans_from_a_kineto_trace():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "chunk_gated_delta_rule_fwd_kernel_h", "ts": 100.0, "dur": 50.0},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",
         "ts": 120.0, "dur": 80.0},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 210.0, "dur": 5.0},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 220.0, "dur": 1.0},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 90.0, "dur": 3.0},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 1.0},
    ]}
    spans, by_name = spans_from_trace(trace)
    assert spans == {"compute": [(100.0, 150.0)], "nccl": [(120.0, 200.0)], "memcpy": [(210.0, 215.0), (220.0, 221.0)]}
    split = measure.split_busy_time(spans, wall=200.0)
    assert split["compute"] == 50 and split["nccl"] == 50 and split["memcpy"] == 6
    assert by_name["nccl: ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"] == 80.0


def test_idle_causes_tell_the_hosts_gaps_from_the_gpus():
    """Each gap in the GPU's work goes to its cause by the launch call of the work after it: launched after the GPU
    drained (the host was late: by the work launched late; or a synchronize came first), launched before (the GPU),
    or no launch call seen; the gap across the timing's own cudaEventSynchronize (between iterations) to none. A
    synchronize is called while the GPU works and returns once it drained, as in a real trace: the call spans the
    gap's start (run 2026-12-07w: the check by the call's start alone put the gap between iterations, after the
    timing's event synchronize and the device synchronize before the next iteration, under ``sync``)."""
    def call(name, ts, corr=None, dur=1.0):
        return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur,
                **({"args": {"correlation": corr}} if corr is not None else {})}

    def kernel(name, ts, dur, corr=None):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}

    trace = {"traceEvents": [
        call("cudaLaunchKernel", 0.0, 1), kernel("gemm_a", 10.0, 10.0, 1),            # busy 10-20
        call("cudaLaunchKernel", 5.0, 2), kernel("conv_b", 22.0, 8.0, 2),             # launched early: device 2
        call("cuLaunchKernel", 40.0, 3), kernel("scan_c", 45.0, 5.0, 3),              # launched late: launch 15
        call("cudaStreamSynchronize", 47.0, dur=4.0), call("cudaLaunchKernel", 60.0, 4),
        kernel("norm_d", 62.0, 8.0, 4),                                               # after a sync: sync 12
        call("cudaEventSynchronize", 65.0, dur=6.0), call("cudaDeviceSynchronize", 80.0),
        call("cudaLaunchKernel", 100.0, 5), kernel("gemm_e", 105.0, 5.0, 5),          # next iteration: left out
        {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 120.0, "dur": 5.0},  # unlinked 10
    ]}
    got = measure.idle_causes(trace, iters=1)
    assert {k: round(v * 1e3, 6) for k, v in got.items() if k != "late"} == {
        "sync": 12.0, "launch": 15.0, "device": 2.0, "unlinked": 10.0}
    assert got["late"] == [["compute: scan_c", 15.0 / 1e3]]
    assert measure.idle_causes(trace, iters=2)["launch"] == 15.0 / 1e3 / 2


def test_megatron_trees_pristine_and_patched(tmp_path):
    """The copies the two pools import: one pristine, one patched, from the installed megatron-core."""
    from gdn_cp import patch

    try:
        root = patch.find_megatron_root()
    except patch.PatchError as err:
        pytest.skip(f"megatron-core not installed: {err}")
    trees = layer_full.prepare_megatron_trees(None, tmp_path)
    assert patch.overall_state(patch.check_patch(trees["stock"])) == patch.PRISTINE
    assert patch.overall_state(patch.check_patch(trees["patched"])) == patch.PATCHED
    assert patch.overall_state(patch.check_patch(root)) in (patch.PRISTINE, patch.PATCHED)  # untouched


def test_kernel_classes_sort_a_gdn_layers_kernels():
    """Each kernel a GatedDeltaNet layer launches lands in its class (GEMMs are the floor, the rest is
    what gdn-cp can remove); every class is reported; idle comes from the profile split."""
    by_name = {
        "compute: nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coo": 5000.0,
        "compute: chunk_gated_delta_rule_fwd_kernel_h_blockdim64": 800.0,
        "compute: fused_gdr_fwd_kernel": 360.0,
        "compute: merge_16x16_to_64x64_inverse_kernel": 40.0,  # FLA's solve_tril, not an elementwise kernel
        "compute: causal_conv1d_fwd_kernel": 300.0,
        "compute: layer_norm_gated_fwd_kernel": 200.0,
        "compute: triton_per_fused_add_mul_rsqrt_silu_split_0": 150.0,
        "compute: gdn_cp_glue_conv_bwd": 60.0,
        "compute: void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>": 100.0,
        "compute: void at::native::(anonymous namespace)::CatArrayBatchedCopy<float>": 50.0,
        "nccl: ncclDevKernel_AllGather_RING_LL": 30.0,
        "memcpy: Memcpy DtoD (Device -> Device)": 10.0,
    }
    cls = measure.kernel_classes(by_name, idle_us=400.0, iters=2)
    assert set(cls) == set(measure.CLASS_NAMES)
    want = {"gemm": 2.5, "gdn": 0.6, "conv": 0.15, "norm": 0.1, "compiled glue": 0.075, "gdn-cp glue": 0.03,
            "elementwise + copies": 0.075,
            "communication": 0.015, "memcpy": 0.005, "idle": 0.2}
    assert cls == pytest.approx(want, rel=1e-12)


def test_class_table_reads_each_rows_classes():
    from benchmarks import plot_layer_full

    classes = {c: 0.0 for c in measure.CLASS_NAMES} | {"gemm": 8.2, "gdn": 1.5, "idle": 0.7}
    row = {"status": "ok", "T": 32768, "packing": "mixed8", "case": "patched_slice", "slice_rank": 0, "cp": 1,
           "median_ms": 12.3, "classes_ms": classes, "spec": "local", "stack": "fla 0.4.2 + flash-qla 0.1.3"}
    text = plot_layer_full.class_table([row])
    assert "| 12.30 | 0.00 | 8.20 | 0.00 | 1.50 |" in text  # median, communication, gemm, conv, gdn
    assert text.rstrip().endswith(f"| {12.3 / 8.2:.2f} |")


GLUE_RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "layer_full_glue.json"


def test_the_per_rank_plot_labels_each_bar_by_its_glue_and_lever():
    """The committed per-rank rows as bar labels: a lever that only picks the glue path is named by the path."""
    rows = json.loads(GLUE_RESULTS.read_text())
    labels = {plot_layer_full._bar_label(r) for r in rows if r["status"] == "ok"}
    assert {"r0 stock", "r0 gdn-cp triton", "r0 gdn-cp unfused", "r1 gdn-cp triton -split_cat"} <= labels, labels
    assert not any("-glue_triton" in label or "-glue_unfused" in label for label in labels)


def test_the_per_rank_table_compares_each_row_with_stock_of_its_own_run():
    """The committed file holds several runs of the same rows: each gdn-cp row against the stock row of its run
    (run 2026-12-05a's rank 0 at 32K: 12.76 / 16.28 ms, not an earlier run's stock)."""
    text = plot_layer_full.per_rank_summary(json.loads(GLUE_RESULTS.read_text()))
    line = next(x for x in text.splitlines() if x.startswith("| 20261205-121340 |") and "| 32K | mixed8 | rank 0 " in x)
    assert "| 16.28 (16.14-16.37) | 12.76 (12.62-12.92) | 0.784 |" in line, line
    rank0 = [x.split(" | ")[:7] for x in text.splitlines() if "| rank 0 of CP=2 |" in x]
    assert len(rank0) == len({tuple(x) for x in rank0}) == 35  # one row per run, stack, backend, spec, T


def test_the_per_rank_plot_draws_the_committed_rows(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (CI installs none: the labels are tested above)")
    png = tmp_path / "glue.png"
    assert plot_layer_full.main([str(GLUE_RESULTS), "--md", str(tmp_path / "t.md"), "--png", str(png)]) == 0
    assert png.stat().st_size > 10_000
