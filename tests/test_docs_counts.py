"""Counts and claims in the docs, read from the code that makes them true (issue #49: docs/errors.md said
tests/fuzz had 32 tests when 31 were collected, and that no gdn-cp command reads the tests' variables while
`gdn-cp run` reads GDN_CP_TEST_DIST_BACKEND)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from tests.conftest import start_smoke_run

ROOT = Path(__file__).resolve().parents[1]
ERRORS = (ROOT / "docs" / "errors.md").read_text()


def _one_line(text: str) -> str:
    return " ".join(text.split())


# pytest collecting tests/fuzz in a process of its own (seconds) starts in the background when the session starts
# (tests/conftest.py); the program drops the --out a smoke run is given
SMOKE_RUNS = {"fuzz_collected": ("-c", ["import sys, pytest; sys.exit(pytest.main(sys.argv[1:-2]))", "--collect-only",
                                        "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "fuzz")])}


@pytest.fixture(scope="module")
def fuzz_collected():
    return start_smoke_run(sys.modules[__name__], "fuzz_collected").result(timeout_s=300)


def test_the_fuzz_test_count_is_the_collected_one(fuzz_collected):
    code, printed, _ = fuzz_collected
    (collected,) = re.findall(r"^(\d+) tests? collected", printed, re.M) or [None]
    assert code == 0 and collected, printed[-4000:]
    (said,) = re.findall(r"with hypothesis \((\d+) tests\)", _one_line(ERRORS))
    assert int(said) == int(collected), f"docs/errors.md says tests/fuzz holds {said} tests; {collected} are collected"


def test_every_variable_the_package_names_beside_its_settings_is_said_in_the_docs():
    """The GDN_CP_* names gdn_cp's code holds as string constants (gdn_cp/env.py aside: it lists every name, to
    tell who reads it; docstrings only mention names) that are not the library's settings are ones a command looks at without taking a
    setting from: each is
    named in docs/errors.md with the command that does, and no sentence says that no command reads them."""
    from gdn_cp import env

    named = set()
    for path in (ROOT / "gdn_cp").rglob("*.py"):
        if path.name == "env.py" and path.parent.name == "gdn_cp":
            continue
        named |= {node.value for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Constant)
                  and isinstance(node.value, str) and re.fullmatch(r"GDN_CP_[A-Z0-9_]+", node.value)}
    others = sorted(named - set(env.SETTINGS))
    assert others, "the check found nothing: the package no longer names a tests' variable (update this test)"
    text = _one_line(ERRORS)
    for name in others:
        assert re.search(rf"`gdn-cp \w+` only notes `{name}`", text), f"docs/errors.md does not say which command reads {name}"
    assert "reads none of them" not in text and "reads none of them" not in _one_line(Path(env.__file__).read_text())
