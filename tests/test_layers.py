"""The package keeps its layer order: every import of gdn_cp goes to the importer's layer or below
(layout -> comm -> ops -> modes -> megatron -> cli; checks, env and nvtx at the bottom; the patch tool above
megatron and below the command line, so nothing on the forward path imports it), nothing in it
imports the test machinery (gdn_cp_testing, tests, benchmarks), which is not shipped, and only comm/
calls torch.distributed (``gdn-cp run``'s launcher, which starts the process groups, excepted). Read
from the source (function-level imports included), so it costs no import."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gdn_cp"
ORDER = ("checks", "env", "nvtx", "pins", "layout", "comm", "ops", "modes", "megatron", "patch", "cli")
NOT_SHIPPED = ("gdn_cp_testing", "tests", "benchmarks")
FLOOR = {"checks": 0, "env": 0, "nvtx": 0, **{name: i for i, name in enumerate(ORDER[3:], start=1)}}


def _layer(module: str) -> str | None:
    """``gdn_cp.modes.spec`` -> ``modes``; None for the package root's own names (``__version__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in FLOOR else None


def _imports(path: Path) -> list[str]:
    """The modules ``path`` imports, relative imports resolved."""
    package = list(path.relative_to(ROOT).with_suffix("").parts[:-1])  # an __init__'s is its own folder
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - (node.level - 1)] if node.level else []
            target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            found += [target] if node.module else [f"{target}.{a.name}" for a in node.names]
    return found


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_go_down(path):
    source = _layer(".".join(path.relative_to(ROOT).with_suffix("").parts))
    if source is None:  # gdn_cp/__init__.py
        return
    imported = [m for m in _imports(path) if m == "gdn_cp" or m.startswith("gdn_cp.")]
    up = [m for m in imported if _layer(m) is not None and FLOOR[_layer(m)] > FLOOR[source]]
    assert not up, f"{path.relative_to(ROOT)} ({source}) imports from a higher layer: {up}"


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_shipped_imports_the_test_machinery(path):
    found = [m for m in _imports(path) if m.split(".")[0] in NOT_SHIPPED]
    assert not found, f"{path.relative_to(ROOT)} imports {found}, which the wheel does not ship"


def test_the_order_names_every_part_of_the_package():
    parts = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if p.name not in ("__init__.py", "__pycache__") and (p.is_dir() or p.suffix == ".py")}
    assert parts == set(ORDER)


DISTRIBUTED_ALLOWED = ("gdn_cp/comm/", "gdn_cp/cli/launch.py")


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_only_comm_calls_torch_distributed(path):
    rel = path.relative_to(ROOT).as_posix()
    if rel.startswith(DISTRIBUTED_ALLOWED):
        return
    tree = ast.parse(path.read_text())
    found = [m for m in _imports(path) if m == "torch.distributed" or m.startswith("torch.distributed.")]
    found += [f"line {n.lineno}: torch.distributed.{n.attr}" for n in ast.walk(tree)
              if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "distributed"
              and isinstance(n.value.value, ast.Name) and n.value.value.id == "torch"]
    assert not found, f"{rel} calls torch.distributed outside gdn_cp/comm/: {found}; add what it needs to gdn_cp.comm"


def test_the_pins_import_nothing_of_gdn_cp_but_the_integer_rule():
    """``gdn_cp/pins/`` (the supported releases) sits low so that the patch tool can read it alone:
    it imports ``gdn_cp.checks`` and itself, never layout, comm, ops, modes or megatron."""
    found = {str(path.relative_to(ROOT)): m for path in sorted((PACKAGE / "pins").rglob("*.py"))
             for m in _imports(path) if (m == "gdn_cp" or m.startswith("gdn_cp."))
             and not m.startswith(("gdn_cp.pins", "gdn_cp.checks"))}
    assert found == {}, found


PATCH_TOOL_MODULES = 20  # gdn_cp, checks, pins (5), patch (8): the patch tool and the releases it reads


def test_importing_the_patch_tool_loads_a_handful_of_modules_and_no_torch():
    """``import gdn_cp.patch`` (a fresh interpreter) loads the patch tool, the pins and the integer rule:
    no layer of the forward path, and no torch."""
    import json
    import subprocess
    import sys

    code = ("import json, sys; import gdn_cp.patch; "
            "print(json.dumps([sorted(m for m in sys.modules if m == 'gdn_cp' or m.startswith('gdn_cp.')), "
            "'torch' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    modules, torch_loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert not torch_loaded
    assert len(modules) <= PATCH_TOOL_MODULES, modules
    layers = {m.split(".")[1] for m in modules if m.count(".") >= 1}
    assert layers <= {"checks", "pins", "patch"}, layers
