"""The glue's default on CUDA (``gdn_cp.ops.fused.CUDA_DEFAULT``, what ``GDN_CP_GLUE=auto`` runs) is the path the
committed per-rank GPU results measured fastest: in every (stack, backend, spec, T, rank slice) of
benchmarks/results/layer_full_glue.json where more than one glue path ran, the default's row is not slower than
any other path's (1% for run-to-run noise). A default can then never again ship unmeasured or slower."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from gdn_cp.ops.fused import CUDA_DEFAULT, GLUE_PATHS

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "layer_full_glue.json"


def _groups():
    rows = [r for r in json.loads(RESULTS.read_text()) if r.get("status") == "ok" and r.get("glue")]
    groups = defaultdict(dict)
    for r in rows:
        key = (r.get("stack"), r.get("gdn_cp_backend"), r.get("spec") or "local", r["T"], r.get("slice_rank"))
        groups[key][r["glue"]] = r["median_ms"]
    return {k: v for k, v in groups.items() if len(v) > 1}


def test_every_row_names_a_glue_path():
    assert all(p in GLUE_PATHS for by_path in _groups().values() for p in by_path)


def test_the_default_was_measured_against_another_path_on_each_backend():
    groups = _groups()
    assert groups, "no per-rank rows with two glue paths: the default is unmeasured"
    backends = {key[1] for key, by_path in groups.items() if CUDA_DEFAULT in by_path}
    assert {"fla", "flashqla"} <= backends, backends


def test_the_default_is_the_fastest_measured_path():
    slower = {key: by_path for key, by_path in _groups().items()
              if CUDA_DEFAULT in by_path and by_path[CUDA_DEFAULT] > 1.01 * min(by_path.values())}
    assert not slower, f"GDN_CP_GLUE=auto runs {CUDA_DEFAULT!r}, slower than another measured path in: {slower}"
