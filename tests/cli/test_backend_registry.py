"""A backend is its folder and one registry line: ``gdn-cp doctor``, ``gdn-cp selftest`` and the versions of a
result row loop over the registry (each ``BackendSpec``: its packages, versions, tolerances, selftest cases and
stack verdict), so a backend registered here, and nowhere else, shows up in all three."""

from __future__ import annotations

import types
from dataclasses import replace

import pytest


def _register(monkeypatch, name: str, *, devices=("cpu",), scale: float = 1.0):
    """Backend ``name`` registered the documented way (a package with ``SPEC`` and ``load``, one line in
    ``PACKAGES``): the reference kernels, their output multiplied by ``scale`` (1: right; else wrong)."""
    from gdn_cp.ops import registry
    from gdn_cp.ops.contract import BackendSpec, SelftestCase

    spec = BackendSpec(
        name=name, title=name.capitalize(), devices=devices, devices_why="a test's kernels", preference=9,
        packages=(f"{name}-kernels",), versions=lambda: {f"{name}_kernels": "1.2.3"}, tolerances={"float32": 5e-3},
        selftest=(SelftestCase("gdn", "float32"),),
        verdict=lambda: (f"{name.capitalize()} + kernels", f"{name}-kernels 1.2.3: a tested stack"),
    )

    def load(settings):
        reference = registry.PACKAGES["reference"].load({})
        rule = reference.chunk_gated_delta_rule

        def chunk_gated_delta_rule(*args, **kwargs):
            out = rule(*args, **kwargs)
            return (out[0] * scale, *out[1:]) if isinstance(out, tuple) else out * scale

        return replace(reference, spec=spec, chunk_gated_delta_rule=chunk_gated_delta_rule)

    package = types.SimpleNamespace(SPEC=spec, load=load)
    monkeypatch.setitem(registry.PACKAGES, name, package)
    monkeypatch.setitem(registry.BACKENDS, name, spec)
    return spec


def test_a_registered_backend_is_in_doctor_selftest_and_the_versions(monkeypatch):
    from gdn_cp.cli.doctor import run_doctor
    from gdn_cp.cli.selftest import run_selftest
    from gdn_cp.ops.versions import stack_versions

    _register(monkeypatch, "fake")
    _register(monkeypatch, "broken", scale=1.5)
    _register(monkeypatch, "gpuonly", devices=("cuda",))
    lines = []
    run_doctor(echo=lines.append)
    doctor = "\n".join(lines)
    for name in ("fake", "broken", "gpuonly"):
        assert f"\n  {f'{name}-kernels':<24} not installed\n" in doctor and f"{name.capitalize()} + kernels: {name}-kernels 1.2.3: a tested stack" \
            in doctor, doctor
    assert stack_versions()["fake_kernels"] == "1.2.3"

    report = run_selftest(gpu=False)
    text = report.text()
    assert "PASS fake/gdn/float32/cpu" in text and "FAIL broken/gdn/float32/cpu" in text, text
    assert "the Fake backend (a test's kernels) in float32 against the reference backend in float64" in text, text
    assert "not checked: the Gpuonly backend" in text and "fake_kernels=1.2.3" in text, text
    assert not report.ok  # the broken backend fails its tolerance
    assert any(c.name == "reference/gdn/float32/cpu" and c.ok for c in report.cases)


@pytest.mark.parametrize("name", ["reference", "fla", "flashqla"])
def test_every_backend_says_its_selftest_cases_and_their_tolerances(name):
    from gdn_cp.cli.selftest import CASES
    from gdn_cp.ops.registry import backend_spec

    spec = backend_spec(name)
    assert spec.selftest and all(c.kind in CASES and c.dtype in spec.tolerances for c in spec.selftest)
