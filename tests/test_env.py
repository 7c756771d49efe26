"""gdn_cp.env: every GDN_CP_* variable in one table, checked in one place, before any command runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from gdn_cp import env
from gdn_cp.cli import main

ROOT = Path(__file__).resolve().parent.parent
_NAME = re.compile(r"\bGDN_CP_[A-Z0-9_]*[A-Z0-9]\b")


def _names_used_in_the_repository() -> dict[str, str]:
    """Every GDN_CP_* name in the code, tests, benchmarks, CI and docs: name -> a file using it."""
    found = {}
    for folder in ("gdn_cp", "tests", "benchmarks", "docker", ".ci", "docs"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and path.suffix in (".py", ".sh", ".md", "", ".txt", ".yml", ".toml") \
                    and "__pycache__" not in path.parts:
                for name in _NAME.findall(path.read_text(errors="replace")):
                    found.setdefault(name, str(path.relative_to(ROOT)))
    for name in _NAME.findall((ROOT / "README.md").read_text()):
        found.setdefault(name, "README.md")
    return found


def test_every_variable_used_anywhere_is_in_the_table():
    """A GDN_CP_* variable added to a script or test without a row in gdn_cp/env.py SETTINGS would be
    refused by every gdn-cp command as "not a gdn-cp setting": add the row (who reads it, what it sets)."""
    used = _names_used_in_the_repository()
    used.pop("GDN_CP_CHUNKWISE_PAHT", None)  # this file's example typo
    missing = {name: where for name, where in used.items() if name not in env.SETTINGS}
    assert missing == {}, f"add these to gdn_cp.env.SETTINGS: {missing}"
    unused = sorted(set(env.SETTINGS) - set(used))
    assert unused == [], f"rows nobody reads any more: {unused}"


@pytest.mark.parametrize("name,bad,accepts", [
    ("GDN_CP_CHUNKWISE_PATH", "bogus", "use one of auto, native, generic"),
    ("GDN_CP_TEST_DIST_BACKEND", "mpi", "use one of gloo, nccl"),
    ("GDN_CP_TEST_PG_TIMEOUT", "soon", "use a number of seconds > 0"),
    ("GDN_CP_TEST_PG_TIMEOUT", "-5", "use a number of seconds > 0"),
    ("GDN_CP_TEST_FAST_AUTOTUNE", "yes", "use one of 0, 1"),
    ("GDN_CP_CHUNKWISE_PAHT", "generic", "is not a gdn-cp setting (a typo?)"),
])
def test_bad_settings_stop_every_command_before_it_starts(monkeypatch, capsys, name, bad, accepts):
    """One line on stderr naming the variable, its value and what it accepts; exit 2; nothing on
    stdout; and nothing spawned (gdn-cp run would spawn ranks next)."""
    from gdn_cp.cli import main_job

    monkeypatch.setattr(main_job, "run_job", lambda *a, **k: pytest.fail("ran with a bad setting"))
    monkeypatch.setenv(name, bad)
    for argv in (["run"], ["route", "--cu", "0,8", "--cp", "2"], ["doctor"], ["patch", "check"], ["selftest"]):
        assert main(argv) == 2, argv
        cap = capsys.readouterr()
        assert cap.out == "", (argv, cap.out)
        assert cap.err.startswith(f"gdn-cp {argv[0]}{' check' if argv[0] == 'patch' else ''}: error: "), cap.err
        assert f"{name}" in cap.err and accepts in cap.err and len(cap.err.strip().splitlines()) == 1, cap.err


def test_read_gives_defaults_and_checked_values(monkeypatch):
    for name in env.SETTINGS:
        monkeypatch.delenv(name, raising=False)
    assert env.read("GDN_CP_CHUNKWISE_PATH") == "auto"
    assert env.read("GDN_CP_TEST_PG_TIMEOUT") == 180.0
    monkeypatch.setenv("GDN_CP_TEST_PG_TIMEOUT", "2.5")
    assert env.read("GDN_CP_TEST_PG_TIMEOUT") == 2.5
    monkeypatch.setenv("GDN_CP_CHUNKWISE_PATH", "")  # empty: the default
    assert env.read("GDN_CP_CHUNKWISE_PATH") == "auto"
    env.check_environment()


def test_a_bad_setting_never_reaches_the_ranks_of_gdn_cp_run():
    """The example of issue #19, end to end: one line, exit 2, no traceback, no rank spawned."""
    r = subprocess.run([sys.executable, "-m", "gdn_cp.cli", "run"], capture_output=True, text=True, timeout=300,
                       env={**_clean_env(), "GDN_CP_CHUNKWISE_PATH": "bogus"})
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "Traceback" not in r.stderr, r.stderr
    assert "GDN_CP_CHUNKWISE_PATH='bogus'" in r.stderr


def _clean_env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith(env.PREFIX)}
