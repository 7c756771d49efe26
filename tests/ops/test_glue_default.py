"""The glue's default on CUDA (``gdn_cp.ops.fused.CUDA_DEFAULT``, what ``GDN_CP_GLUE=auto`` runs, with every
lever at its default) is the path the committed per-rank GPU results measured fastest: in every (run, stack,
backend, spec, T, rank slice) of benchmarks/results/layer_full_glue.json where more than one variant ran, the
default's row is not slower than any other variant's (1% for run-to-run noise). A variant is the glue path
plus the lever the row switched away from its default (``lever_off``: e.g. the Triton glue's candidate
backward forms, or ``split_cat``; a lever that only picks the path, ``glue_<path>``, is the path). A default
can then never again ship unmeasured or slower."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from benchmarks.layer_full_math import GLUE_LEVERS
from gdn_cp.ops.fused import CUDA_DEFAULT, GLUE_PATHS

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "layer_full_glue.json"
DEFAULT = (CUDA_DEFAULT, None)


def _groups():
    """``{(run, stack, backend, spec, T, rank): {(glue path, lever_off): median ms}}``, groups of 2+ variants."""
    rows = [r for r in json.loads(RESULTS.read_text()) if r.get("status") == "ok" and r.get("glue")]
    groups = defaultdict(dict)
    for r in rows:
        key = (r["run_id"], r.get("stack"), r.get("gdn_cp_backend"), r.get("spec") or "local", r["T"],
               r.get("slice_rank"))
        lever = r.get("lever_off")
        variant = (r["glue"], None if lever in GLUE_LEVERS else lever)
        assert variant not in groups[key], f"two rows of {variant} in {key}"
        groups[key][variant] = r["median_ms"]
    return {k: v for k, v in groups.items() if len(v) > 1}


def test_every_row_names_a_glue_path():
    assert all(p in GLUE_PATHS for by_variant in _groups().values() for p, _ in by_variant)


def test_the_default_was_measured_against_another_path_on_each_backend():
    groups = _groups()
    assert groups, "no per-rank rows with two glue variants: the default is unmeasured"
    backends = {key[2] for key, by_variant in groups.items()
                if DEFAULT in by_variant and any(p != CUDA_DEFAULT for p, _ in by_variant)}
    assert {"fla", "flashqla"} <= backends, backends


def test_the_default_is_the_fastest_measured_variant():
    slower = {key: by_variant for key, by_variant in _groups().items()
              if DEFAULT in by_variant and by_variant[DEFAULT] > 1.01 * min(by_variant.values())}
    assert not slower, f"GDN_CP_GLUE=auto runs {CUDA_DEFAULT!r}, slower than another measured variant in: {slower}"
