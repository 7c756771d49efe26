"""The one FLA detector: what it reports for each kind of FLA install, probed once per process."""

from __future__ import annotations

import inspect
import types

import pytest

from gdn_cp.ops.fla import detect


def _fake_fla(*, kernels_take_cp=True, build_params=("cu_seqlens", "group", "conv1d_kernel_size", "cu_seqlens_cpu"),
              has_build=True, clamps=False, import_error=None):
    """import_module / find_spec fakes for an FLA with the given features."""

    def kernel(x, cp_context=None):
        return x

    def plain_kernel(x):
        return x

    def build(*args, **kwargs):
        return None

    build.__signature__ = inspect.Signature(
        [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in build_params]
    )
    modules = {
        "fla.ops.gated_delta_rule": types.SimpleNamespace(
            chunk_gated_delta_rule=kernel if kernels_take_cp else plain_kernel),
        "fla.modules.convolution": types.SimpleNamespace(causal_conv1d=kernel if kernels_take_cp else plain_kernel),
        "fla.ops.cp": types.SimpleNamespace(**({"build_cp_context": build} if has_build else {})),
        "fla.ops.cp.context": types.SimpleNamespace(FLACPContext=types.SimpleNamespace(
            __dataclass_fields__={"pre_num_conv_tokens": None} if clamps else {})),
    }

    def import_module(name):
        if import_error is not None:
            raise import_error
        return modules[name]

    return import_module, (lambda name: object())


def test_not_installed():
    f = detect.probe(import_module=lambda n: pytest.fail("imported"), find_spec=lambda name: None)
    assert "not installed" in f.import_error and f.cp_context_error == f.import_error


def test_import_fails_with_any_exception():
    f = detect.probe(*_fake_fla(import_error=KeyError("STAGE")))
    assert f.import_error == "importing fla failed: KeyError: 'STAGE'" and f.cp_context_error == f.import_error


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        (dict(has_build=False), "fla.ops.cp.build_cp_context is not importable (AttributeError"),
        (dict(kernels_take_cp=False), "take no cp_context argument"),
        (dict(build_params=("cu_seqlens", "group")), "takes no conv kernel size argument"),
    ],
)
def test_kernels_import_but_the_cp_context_does_not_fit(kwargs, reason):
    f = detect.probe(*_fake_fla(**kwargs))
    assert f.import_error is None and reason in f.cp_context_error


def test_full_features():
    f = detect.probe(*_fake_fla(build_params=("cu_seqlens", "group", "kernel_size", "layout"), clamps=True))
    assert f == detect.FLAFeatures(None, None, "kernel_size", False, True, True)
    f = detect.probe(*_fake_fla())
    assert f == detect.FLAFeatures(None, None, "conv1d_kernel_size", True, False, False)


def test_probed_once_per_process(monkeypatch):
    calls = []
    monkeypatch.setattr(detect, "probe", lambda: calls.append(1) or detect.FLAFeatures(None, None, "kernel_size"))
    detect.features.cache_clear()
    try:
        for _ in range(3):
            assert detect.has_cp_context() and detect.fla_available() and detect.detect_fla_cp("cuda")[0]
        assert len(calls) == 1
    finally:
        detect.features.cache_clear()


def test_other_devices_never_look_at_fla(monkeypatch):
    monkeypatch.setattr(detect, "features", lambda: pytest.fail("looked at FLA"))
    assert detect.detect_fla_cp("cpu") == (False, "device is 'cpu', FLA's CP kernels need CUDA")


def test_this_machine_never_raises():
    ok, why = detect.detect_fla_cp()
    assert isinstance(ok, bool) and why
    assert isinstance(detect.has_zigzag_layout(), bool)
