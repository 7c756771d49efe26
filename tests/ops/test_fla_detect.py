"""The one FLA detector: what it reports for each kind of FLA install, probed once per process."""

from __future__ import annotations

import inspect
import types

import pytest

from gdn_cp.ops.fla import detect


def _fake_fla(*, kernels_take_cp=True, build_params=("cu_seqlens", "group", "conv1d_kernel_size", "cu_seqlens_cpu"),
              has_build=True, clamps=False, import_error=None):
    """import_module / find_spec fakes for an FLA with the given features."""

    # defined without a module (no source to read): the source-based features are False
    ns: dict = {}
    exec("def kernel(x, cp_context=None):\n    return x\ndef plain_kernel(x):\n    return x\n", ns)  # noqa: S102
    kernel, plain_kernel = ns["kernel"], ns["plain_kernel"]

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


def test_kernel_features_read_from_the_kernels_module(tmp_path, monkeypatch):
    """Grouped value heads and the in-kernel gate are read from the source of the module that defines
    chunk_gated_delta_rule (FLA checks HV % H and reads use_gate_in_kernel from **kwargs); the fused
    gated norm from fla.modules.fused_norm_gate."""
    import importlib
    import sys

    (tmp_path / "fake_gdr06.py").write_text(
        "def chunk_gated_delta_rule(q, k, v, g, beta, use_beta_sigmoid_in_kernel=False, cp_context=None, **kw):\n"
        "    H, HV = q.shape[2], v.shape[2]\n    assert HV % H == 0\n"
        "    use_gate_in_kernel = kw.get('use_gate_in_kernel'); dt_bias = kw.get('dt_bias')\n")
    (tmp_path / "fake_gdr04.py").write_text("def chunk_gated_delta_rule(q, k, v, g, beta, cp_context=None):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    new, old = importlib.import_module("fake_gdr06"), importlib.import_module("fake_gdr04")
    norm = types.SimpleNamespace(rms_norm_gated=lambda *a, **k: None)

    def importer(with_norm):
        def imp(name):
            if name == "fla.modules.fused_norm_gate" and with_norm:
                return norm
            raise ImportError(name)
        return imp

    f = detect._kernel_features(new.chunk_gated_delta_rule, importer(True))
    assert f == {"grouped_value_heads": True, "gate_in_kernel": True, "beta_sigmoid_in_kernel": True,
                 "fused_gated_norm": True}
    f = detect._kernel_features(old.chunk_gated_delta_rule, importer(False))
    assert not any(f.values())
    sys.modules.pop("fake_gdr06"), sys.modules.pop("fake_gdr04")


def test_stack_report_names_the_stack_and_each_choice(monkeypatch):
    monkeypatch.setattr(detect, "features", lambda: detect.FLAFeatures(
        None, None, "conv1d_kernel_size", zigzag_layout=True, grouped_value_heads=True, fused_gated_norm=True))
    monkeypatch.setattr(detect, "fla_version", lambda: "0.6.0")
    r = detect.stack_report()
    assert r["stack"].startswith("fla 0.6.0 + triton ")
    assert "key heads" in r["choices"]["grouped value heads"] and "zigzag" in r["choices"]["cp context"]
    assert "fused" in r["choices"]["gated norm"]
    monkeypatch.setattr(detect, "features", lambda: detect.FLAFeatures(None, "no cp_context"))
    r = detect.stack_report()
    assert "repeat_interleave" in r["choices"]["grouped value heads"] and "not usable" in r["choices"]["cp context"]


def test_gdn_kernel_backends_reads_flas_registry():
    """FLA >= 0.6 may hand chunk_gated_delta_rule to a registered backend (FlashQLA when flash_qla
    imports, on by default): the detector lists them best first and the stack report says which one
    FLA's dispatch would take and that gdn-cp's FLA backend runs FLA's Triton kernels all the same;
    an FLA without the registry (0.4.x) or none at all gives []."""

    class Backend:
        def __init__(self, name, available, enabled, priority):
            self.backend_type, self.package_name, self.env_var = name, name, f"FLA_{name.upper()}"
            self._a, self._e, self.priority = available, enabled, priority

        def is_available(self):
            return self._a

        def is_enabled(self):
            return self._e

    class Registry:
        def __init__(self, backends):
            self.backends = backends

        def _get_sorted_backends(self):
            return sorted(self.backends, key=lambda b: b.priority)

    def fake(backends):
        mods = {"fla.ops.gated_delta_rule": types.SimpleNamespace(),
                "fla.backends": types.SimpleNamespace(_operation_registries={"gated_delta_rule": Registry(backends)})}
        return lambda name: mods[name]

    found = detect.gdn_kernel_backends(fake([Backend("flash_qla", True, True, 3), Backend("tilelang", False, True, 1)]))
    assert [b["name"] for b in found] == ["tilelang", "flash_qla"]
    text = detect._kernel_backend_text(found)  # what would have run, and what gdn-cp's FLA backend runs instead
    assert text.startswith("FLA's Triton kernels: gdn-cp calls FLA's chunk_gated_delta_rule behind FLA's dispatch")
    assert "flash_qla" in text and "linear_cp_backend='flashqla'" in text
    off = detect.gdn_kernel_backends(fake([Backend("flash_qla", True, False, 3)]))
    assert detect._kernel_backend_text(off).startswith("FLA's Triton kernels") and "off" in detect._kernel_backend_text(off)

    def no_registry(name):
        raise ImportError(name)

    assert detect.gdn_kernel_backends(no_registry) == []
    assert detect._kernel_backend_text([]) == "FLA's Triton kernels"


def test_own_kernel_steps_behind_flas_dispatch():
    """FLA >= 0.6: ``chunk_gated_delta_rule`` is torch.compiler.disable(dispatch wrapper(FLA's own
    function)); the FLA backend calls the own function (FLA's Triton kernels), found by the file the
    dispatch wrapper's code lives in; an undispatched function (FLA 0.4.x) is taken as it is."""
    import functools

    def own(x):
        return ("triton", x)

    ns: dict = {}
    exec(compile("def make(fn):\n    def wrapper(*a, **k):\n        return ('flash_qla', a)\n    return wrapper\n",
                 "/site/fla/backends.py", "exec"), ns)  # noqa: S102 - a dispatch wrapper defined in fla/backends.py
    dispatch = functools.wraps(own)(ns["make"](own))

    @functools.wraps(dispatch)
    def outer(*a, **k):  # like torch.compiler.disable's wrapper
        return dispatch(*a, **k)

    fn, bypassed = detect.own_kernel(outer)
    assert bypassed and fn(1) == ("triton", 1) and outer(1) == ("flash_qla", (1,))
    assert detect.own_kernel(own) == (own, False)
