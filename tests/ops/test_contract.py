"""Every backend satisfies the one contract; the registry and the kernel packages' imports stay light."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from gdn_cp.ops import BACKENDS, Backend, get_backend
from gdn_cp.ops.contract import NativeCPCore

REPO = Path(__file__).resolve().parents[2]


def _compatible(impl, proto) -> list[str]:
    """Problems making ``impl`` unusable where the protocol method ``proto`` is called."""
    want = [p for p in inspect.signature(proto).parameters.values() if p.name != "self"]
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
    backend = get_backend(name)
    assert isinstance(backend, Backend)
    for member in ("causal_conv1d", "chunk_gated_delta_rule", "native_cp_core"):
        assert _compatible(getattr(backend, member), getattr(Backend, member)) == [], (name, member)


def test_native_cp_cores():
    assert get_backend("reference").native_cp_core(object()) is None
    for name, core in (("fla", "cp_context_core"), ("flashqla", "inter_card_core")):
        backend = get_backend(name)
        assert backend.native_cp_core(None) is None  # no group: nothing to be parallel over
        assert _compatible(getattr(backend, core), NativeCPCore.__call__) == []


def test_the_registry_is_torch_free_and_chooses_by_device():
    """The command line reads the registry without torch; a backend's entry names its module directly."""
    assert _imports_after("from gdn_cp.ops.registry import BACKENDS; import gdn_cp.cli.run").count("torch") == 0
    from gdn_cp.ops.registry import ORACLE, choose_backend_name

    for name, spec in BACKENDS.items():
        assert spec.module().__name__ == f"gdn_cp.ops.{name}" and "cpu" in BACKENDS[ORACLE].devices
    assert choose_backend_name("cpu") == ORACLE and choose_backend_name("cuda", deterministic=True) == ORACLE
    want = "fla" if BACKENDS["fla"].problem() is None else ORACLE  # FLA where it imports (never on a CPU machine)
    assert choose_backend_name("cuda") == want  # FlashQLA only where the head dims and dtype are known


def test_unknown_backend():
    with pytest.raises(ValueError, match=r"backend must be one of \('reference', 'fla', 'flashqla'\), got 'triton'"):
        get_backend("triton")


def test_fla_package_exports_what_it_lists():
    fla = get_backend("fla")
    missing = [n for n in fla.__all__ if not hasattr(fla, n)]
    assert not missing and len(fla.__all__) == len(set(fla.__all__))
    submodules = (set(fla.detect.__all__) | set(fla.kernels.__all__) | set(fla.native_cp.__all__)
                  | set(fla.norm.__all__))
    assert set(fla.__all__) == submodules


def test_flashqla_package_exports_what_it_lists():
    flashqla = get_backend("flashqla")
    missing = [n for n in flashqla.__all__ if not hasattr(flashqla, n)]
    assert not missing and len(flashqla.__all__) == len(set(flashqla.__all__))
    assert set(flashqla.__all__) == (set(flashqla.detect.__all__) | set(flashqla.kernels.__all__)
                                     | set(flashqla.native_cp.__all__))


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
