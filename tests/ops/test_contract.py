"""Every backend satisfies the one contract (its members declared once, optional ones with their default;
its facts in its spec); the registry and the kernel packages' imports stay light."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import torch

from gdn_cp.ops import BACKENDS, Backend, GDNShape, get_backend
from gdn_cp.ops.contract import NativeCPCore, check_backend

REPO = Path(__file__).resolve().parents[2]


def _compatible(impl, reference) -> list[str]:
    """Problems making ``impl`` unusable where the reference backend's kernel ``reference`` is called."""
    want = [p for p in inspect.signature(reference).parameters.values() if p.name not in ("self", "chunk_size")]
    have = inspect.signature(impl).parameters
    problems = [f"missing {p.name}" for p in want if p.name not in have]
    problems += [f"{p.name} is {have[p.name].kind.name}, not {p.kind.name}" for p in want
                 if p.name in have and have[p.name].kind != p.kind]
    problems += [f"{p.name} has no default" for p in want
                 if p.name in have and p.default is not p.empty and have[p.name].default is p.empty]
    names = {p.name for p in want}
    problems += [f"extra {n} has no default" for n, p in have.items() if n not in names and p.default is p.empty]
    return problems


@pytest.mark.parametrize("name", list(BACKENDS))
def test_backend_satisfies_the_contract(name):
    """Every member is declared by the contract; the kernels take the reference backend's arguments."""
    backend, reference = get_backend(name), get_backend("reference")
    assert isinstance(backend, Backend) and backend.spec is BACKENDS[name] and backend.name == name
    assert {f.name for f in dataclasses.fields(backend)} == {f.name for f in dataclasses.fields(Backend)}
    for member in ("causal_conv1d", "chunk_gated_delta_rule"):
        assert _compatible(getattr(backend, member), getattr(reference, member)) == [], (name, member)
    assert get_backend(name) is backend  # loaded once


def test_optional_members_default_to_not_offered():
    """A backend without an optional member holds a default that says so; callers never look one up."""
    bare = Backend(BACKENDS["reference"], causal_conv1d=print, chunk_gated_delta_rule=print)
    assert bare.native_cp_core(object()) is None and bare.native_zigzag_cp_core(object()) is None
    assert bare.chunk_state_summary is None and bare.fused_gated_rms_norm() is None
    assert "no native context-parallel core" in bare.native_cp_problem()
    assert bare.check_native_rows([0, 8], 2, 4) is None
    assert get_backend("reference").chunk_state_summary is not None  # the reference backend offers its own


def test_native_cp_cores():
    assert get_backend("reference").native_cp_core(object()) is None
    for name, core in (("fla", "cp_context_core"), ("flashqla", "inter_card_core")):
        backend = get_backend(name)
        assert backend.native_cp_core(None) is None  # no group: nothing to be parallel over
        native_cp = importlib.import_module(f"gdn_cp.ops.{name}.native_cp")
        assert _compatible(getattr(native_cp, core), NativeCPCore.__call__) == []


def test_facts_are_declared_once_and_checked_by_the_kernels():
    """Head dims and dtypes live in the spec; the kernels' refusal and the registry's reason say the same."""
    fla, flashqla = BACKENDS["fla"], BACKENDS["flashqla"]
    assert fla.layer_problem((8, 64), "float32").startswith("head_k_dim=8 is outside what FLA")
    assert fla.layer_problem((128, 128), "float32") is None and fla.layer_problem(None, None) is None
    assert flashqla.layer_problem((128, 128), "float32") == "FlashQLA takes bfloat16 / float16 activations only, not float32"
    assert "chosen where the layer's head dims and dtype are known" in flashqla.layer_problem(None, "bfloat16")
    assert flashqla.layer_problem((128, 256), "bfloat16") is None
    shape = GDNShape(num_k_heads=1, num_v_heads=2, head_k_dim=128, head_v_dim=128)
    with pytest.raises(ValueError, match=r"^FlashQLA takes bfloat16 / float16 activations only, not float32\. Fix:"):
        get_backend("flashqla").check_shape(shape, torch.float32)
    get_backend("fla").check_shape(shape, torch.float32)
    get_backend("reference").check_shape(GDNShape(num_k_heads=1, num_v_heads=1, head_k_dim=3, head_v_dim=5),
                                         torch.float64)


def test_a_module_is_not_a_backend():
    with pytest.raises(TypeError, match="must be a gdn_cp.ops.Backend"):
        check_backend(importlib.import_module("gdn_cp.ops.reference.conv"))


def test_the_registry_is_torch_free_and_chooses_by_device():
    """The command line reads the registry without torch; a backend's entry names its module directly."""
    assert _imports_after("from gdn_cp.ops.registry import BACKENDS; import gdn_cp.cli.run").count("torch") == 0
    from gdn_cp.ops.registry import ORACLE, PACKAGES, choose_backend_name

    for name, spec in BACKENDS.items():
        assert PACKAGES[name].__name__ == f"gdn_cp.ops.{name}" and PACKAGES[name].SPEC is spec
    assert "cpu" in BACKENDS[ORACLE].devices
    assert choose_backend_name("cpu") == ORACLE and choose_backend_name("cuda", deterministic=True) == ORACLE
    want = "fla" if BACKENDS["fla"].problem() is None else ORACLE  # FLA where it imports (never on a CPU machine)
    assert choose_backend_name("cuda") == want  # FlashQLA only where the head dims and dtype are known


def test_unknown_backend():
    with pytest.raises(ValueError, match=r"backend must be one of \('reference', 'fla', 'flashqla'\), got 'triton'"):
        get_backend("triton")


def test_importing_a_backend_package_imports_no_torch():
    """A backend's package declares it (SPEC, load) without torch: the registry and the command line read it."""
    mods = _imports_after("import gdn_cp.ops.fla, gdn_cp.ops.flashqla, gdn_cp.ops.reference")
    assert not {"torch", "fla", "flash_qla", "triton"} & set(mods), mods


def _imports_after(code: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "; import sys; print(sorted({m.split('.')[0] for m in sys.modules}))"],
        capture_output=True, text=True, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": ""}, check=True,
    ).stdout
    return eval(out)  # noqa: S307 - our own printed list


def test_fla_backend_import_does_not_import_fla():
    mods = _imports_after("from gdn_cp.ops import get_backend; get_backend('fla')")
    assert "fla" not in mods and "triton" not in mods


def test_flashqla_backend_import_and_probe_import_no_kernel_library():
    """Importing the backend, and asking why it cannot run on this CPU machine, imports neither
    FlashQLA, TileLang nor FLA (the probe stops at the first missing piece)."""
    mods = _imports_after("from gdn_cp.ops import BACKENDS, get_backend; get_backend('flashqla'); "
                          "BACKENDS['flashqla'].problem()")
    assert not {"flash_qla", "tilelang", "fla", "triton"} & set(mods), mods
