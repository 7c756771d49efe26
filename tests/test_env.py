"""gdn_cp.env (the library's GDN_CP_* variables) and gdn_cp_testing.env (the tests' and benchmarks'):
every variable in one of the two tables, checked before a command, the test session or the GPU suite
runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from gdn_cp import env
from gdn_cp.cli import main
from gdn_cp_testing import env as test_env

ROOT = Path(__file__).resolve().parent.parent
_NAME = re.compile(r"\bGDN_CP_[A-Z0-9_]*[A-Z0-9]\b")


def _names_used_in_the_repository() -> dict[str, str]:
    """Every GDN_CP_* name in the code, tests, benchmarks, CI and docs: name -> a file using it."""
    found = {}
    for folder in ("gdn_cp", "gdn_cp_testing", "tests", "benchmarks", "docker", ".ci", "docs"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and path.suffix in (".py", ".sh", ".md", "", ".txt", ".yml", ".toml") \
                    and "__pycache__" not in path.parts:
                for name in _NAME.findall(path.read_text(errors="replace")):
                    found.setdefault(name, str(path.relative_to(ROOT)))
    for name in _NAME.findall((ROOT / "README.md").read_text()):
        found.setdefault(name, "README.md")
    return found


def test_every_variable_used_anywhere_is_in_a_table():
    """A GDN_CP_* variable added to a script or test without a row in gdn_cp/env.py (what the library
    reads) or gdn_cp_testing/env.py (what the tests and benchmarks read) would be refused by the test
    session and the GPU suite as "not a gdn-cp setting": add the row (who reads it, what it sets)."""
    used = _names_used_in_the_repository()
    # the examples of typos and of names nothing reads (this file, docs/errors.md, gdn-cp run's warning)
    for example in ("GDN_CP_CHUNKWISE_PAHT", "GDN_CP_STAGE", "GDN_CP_BOGUS", "GDN_CP_PG_TIMEOUT", "GDN_CP_DIST_BACKEND"):
        used.pop(example, None)
    missing = {name: where for name, where in used.items() if name not in test_env.ALL_SETTINGS}
    assert missing == {}, f"add these to gdn_cp.env.SETTINGS or gdn_cp_testing.env.SETTINGS: {missing}"
    unused = sorted(set(test_env.ALL_SETTINGS) - set(used))
    assert unused == [], f"rows nobody reads any more: {unused}"
    assert {s.read_by for s in env.SETTINGS.values()} == {"gdn_cp"}  # the library's table: the library's alone
    assert {s.read_by for s in test_env.SETTINGS.values()} == {"tests", "benchmarks"}


@pytest.mark.parametrize("name,bad,accepts", [
    ("GDN_CP_CHUNKWISE_PATH", "bogus", "use one of auto, native, generic"),
    ("GDN_CP_CHUNKWISE_SWAP", "middle", "use one of auto, hidden, core"),
    ("GDN_CP_CHUNKWISE_PAHT", "generic", "is not a gdn-cp setting (a typo?); did you mean GDN_CP_CHUNKWISE_PATH "),
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


def test_the_tests_variables_are_not_the_commands_business(monkeypatch, capsys):
    """A variable only the tests or benchmarks read (or a name close to none of the library's) does not
    stop a gdn-cp command: the test session and the GPU suite check those."""
    monkeypatch.setenv("GDN_CP_STACK", "bogus")
    monkeypatch.setenv("GDN_CP_BOGUS", "1")
    with pytest.raises(SystemExit) as exit_:  # fails on the path (an argument error), not on the environment
        main(["patch", "check", "/nope"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "GDN_CP_" not in err and "/nope" in err, err


@pytest.mark.parametrize("name,bad,accepts", [
    ("GDN_CP_TEST_DIST_BACKEND", "mpi", "use one of gloo, nccl"),
    ("GDN_CP_TEST_PG_TIMEOUT", "soon", "use a number of seconds > 0"),
    ("GDN_CP_TEST_PG_TIMEOUT", "-5", "use a number of seconds > 0"),
    ("GDN_CP_TEST_PG_TIMEOUT", "1e-9", "at least 1"),  # issue #32: accepted, then failed inside gloo
    ("GDN_CP_TEST_FAST_AUTOTUNE", "yes", "use one of 0, 1"),
    ("GDN_CP_CHUNKWISE_PAHT", "generic", "is not a gdn-cp setting (a typo?); did you mean GDN_CP_CHUNKWISE_PATH "),
    ("GDN_CP_BOGUS", "1", "is not a gdn-cp setting (a typo?)"),
    # read by the tests and the benchmarks only (issue #25: said before anything else runs)
    ("GDN_CP_FUZZ_EXAMPLES", "abc", "use a whole number >= 1"),
    ("GDN_CP_FUZZ_EXAMPLES", "1_000", "use a whole number >= 1"),
    ("GDN_CP_STACK", "bogus", "use one of fla042, fla060"),
    ("GDN_CP_STAGES", "tests+args layer", "use stages of tests, tests_core, tests_megatron, flashqla_tests"),
    ("GDN_CP_SUITE_TIMEOUT", "7m", "use a whole number >= 1"),
    ("GDN_CP_GPU_TP_DTYPES", "float16", "use a comma-separated list of bfloat16, float32"),
    ("GDN_CP_ALLOW_SKIP_MEGATRON", "yes", "use one of 0, 1"),
    ("GDN_CP_README_COMMAND", "torchrun x", "use a JSON list of strings"),
])
def test_bad_settings_stop_the_tests_and_the_gpu_suite(name, bad, accepts):
    """What the test session and benchmarks/gpu_suite.sh check first: one line naming the variable, its
    value and what it accepts, exit 2."""
    r = subprocess.run([sys.executable, "-m", "gdn_cp_testing.env", "--check"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env={**_clean_env(), name: bad})
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r
    assert f"{name}" in r.stderr and accepts in r.stderr, r.stderr


def test_read_gives_defaults_and_checked_values(monkeypatch):
    for name in test_env.ALL_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    assert env.read("GDN_CP_CHUNKWISE_PATH") == "auto"
    assert test_env.read("GDN_CP_TEST_PG_TIMEOUT") == 180.0
    monkeypatch.setenv("GDN_CP_TEST_PG_TIMEOUT", "2.5")
    assert test_env.read("GDN_CP_TEST_PG_TIMEOUT") == 2.5
    monkeypatch.setenv("GDN_CP_CHUNKWISE_PATH", "")  # empty: the default
    assert env.read("GDN_CP_CHUNKWISE_PATH") == "auto"
    env.check_environment()
    test_env.check_environment()


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


def test_every_setting_has_a_rule_or_says_it_is_free_form():
    """A value is checked by its rule; only paths and a script's arguments are free-form."""
    free = sorted(n for n, s in test_env.ALL_SETTINGS.items() if s.parse is env.any_text)
    assert free == ["GDN_CP_BENCHMARKS", "GDN_CP_GLUE_KERNELS_ARGS", "GDN_CP_GPU_RESULTS",
                    "GDN_CP_LAYER_FULL_ARGS", "GDN_CP_LAYER_FULL_B_ARGS", "GDN_CP_MEGATRON_SDIST", "GDN_CP_MLM", "GDN_CP_SLIM",
                    "GDN_CP_SYNCS_ARGS", "GDN_CP_TE", "GDN_CP_TEST_OUTCOMES", "GDN_CP_TL", "GDN_CP_TMP",
                    "GDN_CP_TRAIN_MLM_ARGS", "GDN_CP_WGRADS_ARGS"], free
    for name, setting in test_env.ALL_SETTINGS.items():  # every default passes its own rule
        if setting.default:
            setting.parse(setting.default)


@pytest.mark.parametrize("value", ["tests", "tests layer_full", "tests+args syncs", "glue_kernels"])
def test_the_stage_lists_the_readme_and_the_suite_use_are_accepted(value):
    assert test_env.read("GDN_CP_STAGES", {"GDN_CP_STAGES": value})


def test_the_suite_stages_are_the_stages_of_gpu_suite_sh():
    text = (ROOT / "benchmarks" / "gpu_suite.sh").read_text()
    body = text[text.index("run_stage() {"):text.index("RC=0")]
    stages = [name for case in re.findall(r"^    ([\w|]+)\)$", body, re.M) for name in case.split("|")]
    assert tuple(stages) == test_env.SUITE_STAGES


@pytest.mark.parametrize("stages,mib,refused", [
    ("tests_core+tests_megatron+train_mlm", 81559, True),  # run 2026-12-07c's call on an H100
    ("layer_full flashqla_tests+train_mlm", 81559, True),
    ("tests_core+tests_megatron+train_mlm", 143771, False),  # an H200 ran them together (runs 2026-12-03a/b)
    ("tests_core+tests_megatron train_mlm", 81559, False),  # one after another
    ("train_mlm+layer_full", 81559, False),  # no test stage beside it
])
def test_the_suite_refuses_training_beside_tests_on_an_80_gb_card(stages, mib, refused):
    """gpu_suite.sh runs the rule with this machine's memory (its exact ``python3 -c`` line, run here): exit 1 and
    one line naming the fix where refused, before any stage."""
    text = (ROOT / "benchmarks" / "gpu_suite.sh").read_text()
    (snippet,) = re.findall(r"python3 -c '([^']*side_by_side_problem[^']*)'", text)
    r = subprocess.run([sys.executable, "-c", snippet, stages, str(mib)], capture_output=True, text=True, timeout=60,
                       cwd=ROOT, env=_clean_env())
    assert r.returncode == (1 if refused else 0), r
    assert not refused or ("Fix: run them one after another" in r.stderr and len(r.stderr.splitlines()) == 1), r
    r = subprocess.run([sys.executable, "-c", snippet, stages, ""], capture_output=True, timeout=60, cwd=ROOT,
                       env=_clean_env())
    assert r.returncode == 0, r  # no nvidia-smi answer: nothing to judge by


def test_an_unknown_name_gets_a_short_line_with_the_closest_names(monkeypatch):
    monkeypatch.setenv("GDN_CP_STAGE", "tests")
    with pytest.raises(ValueError) as err:
        test_env.check_environment()
    text = str(err.value)
    assert "did you mean GDN_CP_STAGES?" in text and "GDN_CP_CHUNKWISE_PATH" not in text and len(text) < 300, text


def test_python_dash_m_lists_and_checks():
    for module, settings in (("gdn_cp.env", env.SETTINGS), ("gdn_cp_testing.env", test_env.ALL_SETTINGS)):
        r = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True, timeout=120, cwd=ROOT,
                           env=_clean_env())
        assert r.returncode == 0 and len(r.stdout.splitlines()) == len(settings), r
    r = subprocess.run([sys.executable, "-m", "gdn_cp.env", "--check"], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env={**_clean_env(), "GDN_CP_CHUNKWISE_SWAP": "bogus"})
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1 and "GDN_CP_CHUNKWISE_SWAP='bogus'" in r.stderr


def test_gpu_suite_checks_the_environment_before_anything_else():
    lines = [line for line in (ROOT / "benchmarks" / "gpu_suite.sh").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    assert lines[:3] == ['set -uo pipefail', 'cd "$(dirname "$0")/.." || exit 1',
                         'python3 -m gdn_cp_testing.env --check || exit 2'], lines[:3]


def test_a_bad_setting_stops_the_test_session_naming_it():
    """Issue #25: GDN_CP_FUZZ_EXAMPLES=abc gave four collection errors ("invalid literal for int()")
    that did not name the variable."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                        "tests/fuzz"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**_clean_env(), "GDN_CP_FUZZ_EXAMPLES": "abc"})
    assert r.returncode == 4, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "GDN_CP_FUZZ_EXAMPLES='abc': use a whole number >= 1" in r.stderr and "invalid literal" not in r.stdout + r.stderr


def test_the_library_knows_the_names_of_the_tests_table():
    """gdn_cp.env.CLONE_NAMES (what a wheel ships, so the command can tell the tests' names from names
    nothing reads) is the tests' and benchmarks' table, reader by reader."""
    shipped = {n: r for r, names in env.CLONE_NAMES.items() for n in names}
    table = {n: s.read_by for n, s in test_env.SETTINGS.items()}
    assert shipped == table, ("a row of gdn_cp_testing.env.SETTINGS needs its name in gdn_cp.env.CLONE_NAMES too (by "
                              f"reader): add {sorted(set(table.items()) - set(shipped.items()))}, remove "
                              f"{sorted(set(shipped.items()) - set(table.items()))}")
    assert not set(env.SETTINGS) & {n for names in env.CLONE_NAMES.values() for n in names}


def test_doctor_says_who_reads_each_variable(monkeypatch, capsys):
    """Issue #41: GDN_CP_PG_TIMEOUT and GDN_CP_DIST_BACKEND (guessed from the tests' GDN_CP_TEST_*) were
    listed by doctor under "environment:" as if they were used. Each variable set now says who reads it."""
    import json

    for name in env.set_names():
        monkeypatch.delenv(name)
    variables = {"GDN_CP_CHUNKWISE_PATH": "generic", "GDN_CP_TEST_PG_TIMEOUT": "10", "GDN_CP_STACK": "fla042",
                 "GDN_CP_PG_TIMEOUT": "0.0001", "GDN_CP_DIST_BACKEND": "nccl"}
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    lines = {line.split("=")[0].strip(): line for line in out.splitlines() if line.startswith("  GDN_CP_")}
    assert set(lines) == set(variables), out
    assert lines["GDN_CP_CHUNKWISE_PATH"].endswith("gdn-cp's setting")
    assert "the tests' (a clone's test suite reads it; gdn-cp does not)" in lines["GDN_CP_TEST_PG_TIMEOUT"]
    assert "the benchmarks'" in lines["GDN_CP_STACK"]
    for name in ("GDN_CP_PG_TIMEOUT", "GDN_CP_DIST_BACKEND"):
        assert "read by nothing: unset it" in lines[name], lines[name]
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    readers = {v["name"]: v["read_by"] for v in report["environment"]}
    assert readers == {"GDN_CP_CHUNKWISE_PATH": "gdn_cp", "GDN_CP_TEST_PG_TIMEOUT": "tests",
                       "GDN_CP_STACK": "benchmarks", "GDN_CP_PG_TIMEOUT": "nothing", "GDN_CP_DIST_BACKEND": "nothing"}


def test_run_warns_once_about_names_nothing_reads(monkeypatch, capsys):
    """One line on stderr for every GDN_CP_* name nothing reads (the run goes on, exit 0); none for a
    library setting or a name of the tests."""
    from gdn_cp.cli import main_job

    for name in env.set_names():
        monkeypatch.delenv(name)
    monkeypatch.setattr(main_job, "run_job", lambda cfg, **k: main_job.JobResult())
    monkeypatch.setenv("GDN_CP_PG_TIMEOUT", "0.0001")
    monkeypatch.setenv("GDN_CP_DIST_BACKEND", "nccl")
    monkeypatch.setenv("GDN_CP_FUZZ_EXAMPLES", "5")
    monkeypatch.setenv("GDN_CP_CHUNKWISE_SWAP", "core")
    assert main(["run"]) == 0
    err = capsys.readouterr().err
    assert err == ("gdn-cp run: warning: nothing reads GDN_CP_DIST_BACKEND, GDN_CP_PG_TIMEOUT (neither a gdn-cp "
                   "setting, `python3 -m gdn_cp.env`, nor a name of a clone's tests or benchmarks); this run takes its "
                   "settings from its flags (gdn-cp run --help): unset them\n"), err
    monkeypatch.delenv("GDN_CP_PG_TIMEOUT")
    monkeypatch.delenv("GDN_CP_DIST_BACKEND")
    assert main(["run"]) == 0 and capsys.readouterr().err == ""


def _errors_doc_variables() -> dict[str, str]:
    text = (ROOT / "docs" / "errors.md").read_text()
    section = text[text.index("## Environment variables"):]
    section = section[:section.find("\n## ", 1) if "\n## " in section[1:] else len(section)]
    return dict(re.findall(r"^\| `(GDN_CP_\w+)` \| `([^`]*)` \|", section, re.M))


def test_docs_errors_lists_every_library_variable_with_its_default():
    """Issue #41: docs/errors.md named two of the library's three variables. Its table is gdn_cp.env's."""
    assert _errors_doc_variables() == {name: s.default for name, s in env.SETTINGS.items()}
