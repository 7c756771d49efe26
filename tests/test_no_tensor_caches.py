"""No ``functools`` cache sits on a function that takes tensors (or other per-call data), anywhere in
the shipped package, the test kit or the benchmarks.

Such a cache keeps the last activation (and its autograd graph) alive, answers a later call on the
same objects with a stale result (after an in-place change; without a ``grad_fn`` after a no-grad
call) and raises ``TypeError: unhashable`` on a list argument. One shipped on FlashQLA's conv
(2026-12-02). A cached function may take only hashable settings: names, numbers, types."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("gdn_cp", "gdn_cp_testing", "benchmarks")
CACHES = {"lru_cache", "cache", "cached_property"}
# annotations and parameter names that mean per-call data, never a setting
DATA_WORDS = ("Tensor", "Sequence", "list", "dict", "set", "ndarray", "Boundaries", "ProcessGroup")
DATA_NAMES = {"x", "q", "k", "v", "g", "beta", "qkv", "weight", "bias", "halo", "hidden", "hidden_states",
              "cu_seqlens", "cu", "tensor", "t", "group", "plan"}


def _is_cache(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
    return name in CACHES


def cached_functions_taking_data(source: str, filename: str = "<source>") -> list[str]:
    """``name(param)`` of every cached function in ``source`` with a parameter that holds per-call data."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not any(map(_is_cache, node.decorator_list)):
            continue
        args = node.args
        for arg in args.posonlyargs + args.args + args.kwonlyargs + [a for a in (args.vararg, args.kwarg) if a]:
            if arg.arg in ("self", "cls"):
                continue
            note = ast.unparse(arg.annotation) if arg.annotation is not None else ""
            if arg.arg in DATA_NAMES or any(w in note for w in DATA_WORDS):
                found.append(f"{filename}:{node.lineno} {node.name}({arg.arg}: {note or '?'})")
    return found


def test_the_check_sees_a_cache_on_a_tensor_function():
    bad = (
        "import functools, torch\n"
        "@functools.lru_cache(maxsize=1)\n"
        "def causal_conv1d(x: torch.Tensor, weight, *, cu_seqlens):\n"
        "    return x\n"
        "@functools.lru_cache(maxsize=1)\n"
        "def features():\n"
        "    return 1\n"
    )
    found = cached_functions_taking_data(bad)
    assert len(found) == 3 and all("causal_conv1d" in f for f in found), found


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_cache_on_functions_that_take_tensors(folder):
    found = [hit for path in sorted((ROOT / folder).rglob("*.py"))
             for hit in cached_functions_taking_data(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, "functools caches on functions that take per-call data:\n" + "\n".join(found)
