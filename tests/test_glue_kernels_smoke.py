"""benchmarks/glue_kernels.py on the CPU through Triton's interpreter (a tiny shape): it runs the kernels at each
row count it is asked for and writes the rows the GPU run will. No timing assertions."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from tests.conftest import start_smoke_run

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="Triton is not installed (the interpreter runs the kernels on the CPU)")


def test_help_says_what_it_times(benchmark_module, capsys):
    with pytest.raises(SystemExit) as exit_:
        benchmark_module("glue_kernels").main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--rows" in out and "--halo" in out and "--conv-bias" in out and "floor" in out


# the interpreter's dry run starts in the background when the session starts (tests/conftest.py)
SMOKE_RUNS = {"dry_run": ("glue_kernels", ["--device", "cpu", "--rows", "40,24", "--heads", "1,1", "--head-dim", "16",
                                           "--iters", "1"], {"TRITON_INTERPRET": "1"})}


@pytest.fixture(scope="module")
def dry_run():
    return start_smoke_run(sys.modules[__name__], "dry_run").result(timeout_s=300)


def test_a_dry_run_writes_a_row_per_row_count(dry_run):
    code, printed, out = dry_run
    assert code == 0, printed[-2000:]
    report = json.loads(out.read_text())
    assert [r["rows"] for r in report["results"]] == [40, 24]
    for row in report["results"]:
        assert row["fwd_ms"] > 0 and row["bwd_ms"] > 0 and row["floor"]["bwd_ms"] > 0
        forms = ("one_pass", "scan")
        assert all(row[f"fwd_{name}_ms"] > 0 and row[f"bwd_{name}_ms"] > 0 for name in forms), row
        # z's columns at 1 key / 1 value head of 16 start at byte 96 of rows of 132 bytes: no 8-byte words
        assert row["column_copy_ms"]["narrow"] > 0 and row["column_copy_ms"]["wide"] is None, row
    assert report["tuned"] == {}  # autotuning's picks, recorded on a GPU; the interpreter runs one fixed config


def test_an_unknown_form_is_refused_naming_the_forms(benchmark_module, capsys):
    with pytest.raises(SystemExit) as exit_:
        benchmark_module("glue_kernels").main(["--forms", "scan,nope"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--forms scan,nope: unknown ['nope']" in err and "one_pass, scan" in err


def test_a_scan_form_with_switches_sets_them_for_its_rows_only(benchmark_module):
    """``scan_tail_branch`` etc. (``BACKWARD_FORMS``): the scan with triton_conv's flags set while its rows are timed,
    in one process (each process autotunes anew: 110-130 s a run on an H100, run 2026-12-07u), restored after."""
    glue_kernels = benchmark_module("glue_kernels")
    from gdn_cp.ops.fused import triton_conv

    args, forms = glue_kernels.parse_args(["--forms", "scan,scan_tail_branch"])
    assert list(forms) == ["scan", "scan_tail_branch"] and forms["scan_tail_branch"] == {"scan": True}
    with glue_kernels.switched("scan_tail_branch"):
        assert triton_conv.SCAN_HALO_TAIL and triton_conv.SCAN_BRANCH_MASKS
    with glue_kernels.switched("scan"):
        assert not (triton_conv.SCAN_HALO_TAIL or triton_conv.SCAN_BRANCH_MASKS)
    assert not (triton_conv.SCAN_HALO_TAIL or triton_conv.SCAN_BRANCH_MASKS)
    for name, flags in glue_kernels.SWITCHES.items():  # every form's flags are triton_conv's (a typo: a wasted GPU call)
        with glue_kernels.switched(name):
            assert all(getattr(triton_conv, flag) is True for flag in flags), name
        assert not any(getattr(triton_conv, flag) for flag in flags), name
