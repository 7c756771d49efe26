"""The rules every ``gdn-cp`` command keeps (gdn_cp/cli/command.py, output.py): help lists each command
once, ``-v`` anywhere, one exit-status rule, quiet on a closed pipe, counted nouns; route's summary;
selftest says what it checked; the package layout the README describes."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from gdn_cp.cli import build_parser, main
from gdn_cp.cli.output import EXIT_STATUS

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ("run", "route", "patch", "doctor", "selftest")
# argv that get as far as printing, on a CPU machine, quickly (run is stopped before spawning below)
PRINTING = {
    "route": ["route", "--cu", "0,8,16", "--cp", "2", "--all"],
    "doctor": ["doctor", "--heads", "16,32"],
    "patch": ["patch", "check"],
    "selftest": ["selftest"],
    "run": ["run", "--cp", "2"],
    "--help": ["--help"],
}


def test_top_level_help_lists_each_command_once(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    for command in COMMANDS:
        listed = [line for line in out.splitlines() if re.match(rf"\s+{command}\s", line)]
        assert len(listed) == 1, (command, listed)
    assert " ".join(EXIT_STATUS.split()) in " ".join(out.split())


@pytest.mark.parametrize("argv", [
    ["route", "--cu", "0,8", "--cp", "2"],
    ["doctor"],
    ["patch", "check"],
    ["selftest"],
    ["run"],
])
def test_verbose_goes_before_or_after_the_command(argv):
    parser = build_parser()
    assert parser.parse_args(argv).verbose is False
    assert parser.parse_args(["-v", *argv]).verbose is True
    assert parser.parse_args([*argv, "-v"]).verbose is True
    assert parser.parse_args([*argv, "--verbose"]).verbose is True


def test_every_command_help_states_the_one_rule(capsys):
    parser = build_parser()
    for argv in ([c] for c in COMMANDS + ("patch apply", "patch check", "patch revert")):
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args([*argv[0].split(), "--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert exit_.value.code == 0
        assert "Exit status: 0 / 1 / 2 as for every gdn-cp command (gdn-cp --help); 1 here:" in out, argv
        assert "1 otherwise" not in out and "2 on bad flags" not in out, argv


def test_no_command_is_a_usage_error(capsys):
    assert main([]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err == "gdn-cp: error: name a COMMAND (run, route, patch, doctor, selftest); " \
        "usage: gdn-cp --help\n", cap.err


@pytest.mark.parametrize("argv,prog,says", [
    (["run", "--cp", "1_0"], "gdn-cp run", "argument --cp: '1_0' is not an integer"),
    (["run", "--cp", "0,,8"], "gdn-cp run", "argument --cp: expected a comma-separated list without empty items"),
    (["run", "--heads", "128 256"], "gdn-cp run", "argument --heads:"),
    (["run", "--bogus"], "gdn-cp run", "unrecognized arguments: --bogus"),
    (["run", "--dtype", "half"], "gdn-cp run", "argument --dtype: invalid choice: 'half'"),
    (["route", "--cu", "0,8"], "gdn-cp route", "the following arguments are required: --cp"),
    (["route", "--cu", "0,8", "--cp", "2", "--rank", "0", "--all"], "gdn-cp route", "not allowed with argument"),
    (["doctor", "--cp", "x"], "gdn-cp doctor", "argument --cp: 'x' is not an integer"),
    (["doctor", "--heads", "4,8", "--cp", "99999999999999999999999"], "gdn-cp doctor", "must be <= 65536"),
    (["patch"], "gdn-cp patch", "the following arguments are required"),
    (["patch", "apply", "--bogus"], "gdn-cp patch apply", "unrecognized arguments: --bogus"),
    (["patch", "check", "--expect", "x"], "gdn-cp patch check", "argument --expect: invalid choice"),
    (["selftest", "--gpuu"], "gdn-cp selftest", "unrecognized arguments: --gpuu"),
    (["rout"], "gdn-cp", "invalid choice: 'rout'"),
    (["--bogus"], "gdn-cp", "unrecognized arguments: --bogus"),
])
def test_a_bad_flag_is_one_line_on_stderr(capsys, argv, prog, says):
    """docs/errors.md "Exit status": 2, one line on stderr naming the command and the flag, nothing on stdout;
    argparse's usage block is behind --help (the line says so)."""
    try:
        rc = main(argv)
    except SystemExit as exit_:
        rc = exit_.code
    cap = capsys.readouterr()
    assert rc == 2 and cap.out == "", (rc, cap)
    assert cap.err.count("\n") == 1 and cap.err.startswith(f"{prog}: error: "), cap.err
    assert says in cap.err and cap.err.rstrip().endswith(f"; usage: {prog} --help"), cap.err


def test_a_bad_flag_is_one_line_from_the_console_script():
    r = subprocess.run([sys.executable, "-m", "gdn_cp.cli", "run", "--cp", "1_0"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r


class _ClosedPipe(io.TextIOBase):
    """A stdout whose reader went away, as ``| head`` leaves it."""

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    def fileno(self):
        raise io.UnsupportedOperation("no file descriptor")


@pytest.mark.parametrize("name", sorted(PRINTING))
def test_a_closed_pipe_ends_every_command_quietly(monkeypatch, capsys, name):
    """No BrokenPipeError traceback, whatever the command; exit 141 as a Unix tool killed by SIGPIPE."""
    from gdn_cp.cli import main_job

    from gdn_cp.cli import selftest

    monkeypatch.setattr(main_job, "run_ranks", lambda *a, **k: pytest.fail("spawned after its output was gone"))
    # the selftest's report, without its seconds of kernels (its wording is tested below)
    monkeypatch.setattr(selftest, "run_selftest", lambda gpu: selftest.SelftestReport(True, gpu, {}, []))
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    if name == "--help":  # argparse itself ignores a failed write of its help, then exits 0
        with pytest.raises(SystemExit) as exit_:
            main(PRINTING[name])
        assert exit_.value.code == 0
    else:
        assert main(PRINTING[name]) == 141
    assert "Traceback" not in capsys.readouterr().err


def test_a_closed_pipe_through_a_real_pipe():
    """A reader gone before the command writes (as after ``| head`` has its lines): quiet, 141, also
    for output small enough to sit in Python's buffer until exit."""
    import os

    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout as a user has it
    proc = subprocess.Popen([sys.executable, "-m", "gdn_cp.cli", "route", "--cu", "0,8", "--cp", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=buffered)
    proc.stdout.close()  # the reader goes away before anything is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err


def test_route_prints_a_summary_by_default(capsys):
    """cp=64 is 64 lines plus a header and a hint, not every transfer; --rank / --all give those."""
    cu = ",".join(str(128 * i) for i in range(65))
    assert main(["route", "--cu", cu, "--cp", "64"]) == 0
    summary = capsys.readouterr().out.splitlines()
    assert len(summary) == 66 and summary[0].startswith("64 sequences (lengths 128..128, 0 empty slots)")
    assert main(["route", "--cu", cu, "--cp", "64", "--rank", "5"]) == 0
    one = capsys.readouterr().out
    assert "# rank 5" in one and "send -> rank" in one and "# rank 6" not in one
    assert main(["route", "--cu", "0,8", "--cp", "2"]) == 0
    assert capsys.readouterr().out.startswith("1 sequence (lengths 8..8, 0 empty slots)")  # not "1 sequences"


def test_selftest_on_a_cpu_says_what_it_did_not_check(capsys):
    """Without a GPU the report says which backend was compared with what, and that FLA was not."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the CPU report")
    assert main(["selftest"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("gdn-cp selftest: OK\n  checked: the reference backend (plain torch) in float32 against "
                          "itself in float64 on the CPU"), out
    assert "not checked: the FLA backend (torch" in out and "sees no CUDA GPU)" in out
    assert "not checked: context parallelism" in out
    assert "FLA vs reference" not in out


def test_the_package_root_shows_the_layers():
    """gdn_cp/ holds the five layer folders, cli/ above them, the patch tool beside them, the supported
    releases (pins/) below them, and the three layer-0 modules (checks, env, nvtx: every layer may use them); the command-line modules live in
    gdn_cp/cli/ (issue #19)."""
    root = ROOT / "gdn_cp"
    folders = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name != "__pycache__")
    files = sorted(p.name for p in root.iterdir() if p.is_file() and p.suffix == ".py")
    assert folders == ["cli", "comm", "layout", "megatron", "modes", "ops", "patch", "pins"]
    assert files == ["__init__.py", "checks.py", "env.py", "nvtx.py"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"gdn-cp": "gdn_cp.cli:main"}


def test_python_dash_m_runs_the_command():
    import gdn_cp

    for flag in ("--version", "-V"):  # issue #41: -V was refused
        r = subprocess.run([sys.executable, "-m", "gdn_cp.cli", flag], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout == f"gdn-cp {gdn_cp.__version__}\n", r


@pytest.mark.parametrize("argv", [
    ["run", "--modes", "headwise", "--cp", "3"],          # the flags together: a mode that cannot split the heads
    ["run", "--cp", "1_0"],                               # a flag argparse refuses
    ["patch", "apply", "/nonexistent"],                  # a PATH that does not exist
    ["doctor", "--tp", "2"],                              # --tp without --heads
    ["route", "--cu", "0,8", "--cp", "2", "--rank", "5"],  # a rank that is not one
])
def test_argument_errors_answer_before_torch_is_imported(argv):
    """Issue #41: errors found after parsing took 3-7 s on a busy machine, torch imported first. They
    answer from the parsed flags alone (exit 2, one line that names the fix)."""
    code = ("import sys\nfrom gdn_cp.cli import main\ntry:\n    rc = main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    rc = e.code\nsys.exit(rc if 'torch' not in sys.modules else 99)\n")
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, (r.returncode, r.stderr)
    assert re.search(r"; (pass|use|add|leave|usage:) ", r.stderr), r.stderr  # names a fix (or the help that does)


def test_route_json_is_the_plan_the_summary_describes(capsys):
    """`gdn-cp route --json`: per rank, each route's transfers add up to its split sizes, and the rows that
    leave the rank are the summary line's."""
    import json

    argv = ["route", "--cu", "0,8,24,24,56", "--cp", "2"]
    assert main(argv) == 0
    summary = capsys.readouterr().out
    assert main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["cu"] == [0, 8, 24, 24, 56] and plan["t_local"] == 28 and [r["rank"] for r in plan["ranks"]] == [0, 1]
    for rank in plan["ranks"]:
        for route in rank["routes"]:
            sent = [0] * plan["cp"]
            for peer, _start, rows, _local in route["send_transfers"]:
                sent[peer] += rows
            assert sent == route["send_splits"], route
            assert (f"{route['source']}->{route['target']} sends {route['rows_leaving']} of 28 rows"
                    in summary.splitlines()[1 + rank["rank"]]), summary
    assert main([*argv, "--json", "--rank", "1"]) == 0
    assert [r["rank"] for r in json.loads(capsys.readouterr().out)["ranks"]] == [1]


def test_route_answers_without_importing_torch():
    """Issue #49: `gdn-cp route --cu 0,100,200 --cp 2` took 2-7 s, torch imported for integer work. The
    layout math imports torch only where it makes a tensor: route runs where torch cannot import at all."""
    code = ("import contextlib, io, json, sys\nsys.modules['torch'] = None  # any import of torch fails\n"
            "from gdn_cp.cli import main\nout = []\n"
            "for argv in json.loads(sys.argv[1]):  # one process for every call (each start costs a second)\n"
            "    o, e = io.StringIO(), io.StringIO()\n"
            "    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):\n"
            "        code = main(argv)\n"
            "    out.append([code, o.getvalue(), e.getvalue()])\n"
            "print(json.dumps(out))\n")
    calls = [["route", "--cu", "0,100,200", "--cp", "2", *extra] for extra in ([], ["--all"], ["--json", "--rank", "1"],
                                                                              ["-q"])]
    r = subprocess.run([sys.executable, "-c", code, json.dumps(calls)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    for argv, (returncode, stdout, stderr) in zip(calls, json.loads(r.stdout), strict=True):
        assert returncode == 0 and stderr == "", (argv, stderr)
        assert ("T_global=200" in stdout) or ('"t_global": 200' in stdout), (argv, stdout)


def test_each_command_help_says_what_its_own_v_and_q_print(capsys):
    """Issue #49: every command's -v / -q help described `gdn-cp run`. Each now shows its own pair (written
    once, in gdn_cp.cli.command.VERBOSITY), and no other command's."""
    from gdn_cp.cli.command import VERBOSITY

    assert set(VERBOSITY) == set(COMMANDS)
    parser = build_parser()
    for argv in ([c] for c in COMMANDS + ("patch apply", "patch check", "patch revert")):
        with pytest.raises(SystemExit):
            parser.parse_args([*argv[0].split(), "--help"])
        out = " ".join(capsys.readouterr().out.split())
        command = argv[0].split()[0]
        for name, (more, less) in VERBOSITY.items():
            assert (more in out and less in out) == (name == command), (argv, name)


def _lines(capsys, argv) -> tuple[int, list[str]]:
    status = main(argv)  # (selftest's seconds per check differ from run to run)
    return status, [re.sub(r" \([0-9.]+s\)$", "", line) for line in capsys.readouterr().out.splitlines()]


@pytest.mark.parametrize("command", ["route", "patch", "doctor", "selftest"])
def test_q_prints_less_and_v_more(capsys, command):
    """Issue #49: -q did nothing for doctor, route and patch (17 lines either way). Each command's -q prints
    a part of its report (the part its help names), -v more (route: every rank in full, as --all; the others:
    the whole report and more)."""
    argv = {"route": ["route", "--cu", "0,8,24,24,56", "--cp", "2"], "patch": ["patch", "check"],
            "doctor": ["doctor", "--heads", "16,32"], "selftest": ["selftest"]}[command]
    status, plain = _lines(capsys, argv)
    quiet_status, quiet = _lines(capsys, [*argv, "-q"])
    loud_status, loud = _lines(capsys, ["-v", *argv])
    assert status == quiet_status == loud_status
    assert quiet and len(quiet) < len(plain) < len(loud), (quiet, plain, loud)
    assert all(line in plain for line in quiet), (quiet, plain)
    assert command == "route" or all(line in loud for line in plain), (plain, loud)
    if command == "route":
        assert quiet == plain[:1] and quiet[0].startswith("4 sequences (lengths 0..32, 1 empty slot), T_global=56")
        assert loud == _lines(capsys, [*argv, "--all"])[1]  # -v: every rank in full, as --all
    elif command == "patch":
        assert quiet == [plain[-1]] and quiet[0].startswith("state: ")
        assert sum(line.strip().startswith("sha256 ") for line in loud) == sum(line.startswith("  ") for line in plain)
    elif command == "doctor":
        assert quiet == [line for line in plain if line.startswith("problem: ") or "auto       -> " in line]
        assert any(line.strip().startswith("auto") for line in quiet), quiet
        gdn_cp_folder = str(ROOT / "gdn_cp")
        assert any(line.strip() == f"from {gdn_cp_folder}" for line in loud), loud
    else:
        assert quiet[0] == plain[0] and all(line.startswith(("gdn-cp selftest:", "  FAIL", "      ", "  note:"))
                                            for line in quiet), quiet
