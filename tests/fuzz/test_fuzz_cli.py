"""Fuzz the ``gdn-cp`` command in-process (``gdn_cp.cli.main(argv)``): route, doctor, patch, run,
selftest and the top level, with hostile argument strings (signs, sizes, separators, spaces,
empty items, other scripts' digits, unknown flags, missing flags).

The rule for a command: exit status 0, 1 or 2 and nothing else escapes; status 2 (a bad flag) prints
an error naming the flag on stderr and nothing on stdout (every check runs before any output);
status 0 prints what the documented syntax says it should, checked independently (the route's
first line and every rank's split sizes against Megatron's zigzag split counted per token; the
doctor's mode table against the head rule). ``gdn-cp run`` is stopped where it would spawn ranks:
its configuration is checked against the flags instead. ``patch apply`` / ``revert`` are only ever
pointed at throw-away folders.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import types
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gdn_cp.cli import main
from gdn_cp.cli.main_job import check_job
from gdn_cp.modes.spec import MODE_NAMES
from gdn_cp.layout.packings import cumsum0
from gdn_cp_testing.packings import zigzag_rows

from .common import HUGE_INTS, MAX_CP, MAX_TP, cli_int, cli_int_list, fuzz_settings

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the expected answers assume a machine without CUDA")


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``gdn-cp argv`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exit_:
            rc = 0 if exit_.code is None else exit_.code
    assert rc in (0, 1, 2), (argv, rc)
    return rc, out.getvalue(), err.getvalue()


def assert_flag_error(rc: int, out: str, err: str, *names: str) -> None:
    assert rc == 2, (rc, out, err)
    assert out == "", f"printed before failing: {out!r}"
    assert err.count("\n") == 1 and err.endswith("\n"), f"not one line on stderr: {err!r}"
    assert "error" in err and any(n in err for n in names), (names, err)


# ------------------------------------------------------------------------------------------
# argument strings
# ------------------------------------------------------------------------------------------
HOSTILE_TOKENS = ["", " ", "1_0", "١٢", "４", "+4", "0x10", "2.5", "1e3", "nan", "None", "True", "-", "--", "4 4",
                  "4,", " 8 ", "-0", "08", "2;4", "--cp", "-x", "\t2"]

int_texts = st.one_of(st.integers(-3, 70).map(str), st.sampled_from(HUGE_INTS).map(str),
                      st.sampled_from(HOSTILE_TOKENS), st.text(alphabet="0123456789-+_ ,.;e١４\t", max_size=6))


@st.composite
def list_texts(draw, item=int_texts, valid=None, always_valid=False):
    """A list argument: sometimes (``always_valid``: always) ``valid`` (a list of ints) written as
    the docs say, else items joined with the documented comma or with other separators."""
    if valid is not None and (always_valid or draw(st.booleans())):
        return draw(st.sampled_from([",", ", ", " , "])).join(map(str, draw(valid)))
    items = draw(st.lists(item, min_size=0, max_size=5))
    out = ""
    for i, text in enumerate(items):
        out += (draw(st.sampled_from([",", ",", ", ", ",,", ";", " ", "\t"])) if i else "") + text
    return out


def packing_lists(cp_min: int = 1, cp_max: int = 6):
    """Valid boundaries for some cp in ``[cp_min, cp_max]`` (lengths multiples of 2*cp, empty slots)."""
    return st.integers(cp_min, cp_max).flatmap(
        lambda cp: st.lists(st.integers(0, 4), min_size=1, max_size=4).map(lambda u: cumsum0(n * 2 * cp for n in u)))


def maybe_option(value: str) -> bool:
    """argparse may take a value starting with '-' for an option (not a plain negative integer);
    then it fails on its own (status 2) whatever the command would have said."""
    return isinstance(value, str) and value.startswith("-") and not re.fullmatch(r"-[0-9]+", value)


def argv_of(flags: dict) -> list[str]:
    argv = []
    for flag, value in flags.items():
        argv += [flag] if value is True else [flag, value]
    return argv


# ------------------------------------------------------------------------------------------
# gdn-cp route
# ------------------------------------------------------------------------------------------
def _route_syntax_errors(flags: dict) -> list[str]:
    """The given flags whose values argparse itself refuses (syntax, sign, choices)."""
    bad = []
    if "--cu" in flags and cli_int_list(flags["--cu"]) is None:
        bad.append("--cu")
    for flag, low in (("--cp", 1), ("--rank", 0), ("--conv-width", 1)):
        if flag in flags and (cli_int(flags[flag]) is None or cli_int(flags[flag]) < low):
            bad.append(flag)
    if flags.get("--direction", "both") not in ("both", "zigzag->contiguous", "contiguous->zigzag"):
        bad.append("--direction")
    return bad


def route_expectation(flags: dict):
    """``("flag", names)`` for a status-2 error naming one of ``names``, else ``("ok", cu, cp, rank,
    directions, width)``, from the documented rules alone."""
    missing = [flag for flag in ("--cu", "--cp") if flag not in flags]
    if missing:  # argparse names a bad value it met before it names a missing flag
        return "flag", ("required", *missing, *_route_syntax_errors(flags))
    cu, cp = cli_int_list(flags["--cu"]), cli_int(flags["--cp"])
    rank = cli_int(flags["--rank"]) if "--rank" in flags else None
    width = cli_int(flags.get("--conv-width", "4"))
    direction = flags.get("--direction", "both")
    if cu is None:
        return "flag", ("--cu",)
    if cp is None or cp < 1:
        return "flag", ("--cp",)
    if "--rank" in flags and (rank is None or rank < 0):
        return "flag", ("--rank",)
    if direction not in ("both", "zigzag->contiguous", "contiguous->zigzag"):
        return "flag", ("--direction",)
    if width is None or width < 1:
        return "flag", ("--conv-width",)
    if cp > 2**16:
        return "flag", ("--cp",)
    if width > 2**16:
        return "flag", ("--conv-width",)
    if not (len(cu) >= 2 and cu[0] == 0 and all(a <= b for a, b in zip(cu, cu[1:])) and cu[-1] <= 2**62
            and all(v <= 2**62 for v in cu) and all((b - a) % (2 * cp) == 0 for a, b in zip(cu, cu[1:]))):
        return "flag", ("--cu",)
    if rank is not None and rank >= cp:
        return "flag", ("--rank",)
    if rank is None and cp > 64:
        return "flag", ("--rank",)
    directions = ["zigzag->contiguous", "contiguous->zigzag"] if direction == "both" else [direction]
    return "ok", cu, cp, rank, directions, width


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def check_route_output(out: str, cu, cp, rank, directions, full: bool) -> None:
    """The header; then either one block per rank (``full``: --rank or --all) whose split sizes are
    counted per token from Megatron's zigzag split, or one summary line per rank whose rows sent and
    peers are counted the same way (for small packings)."""
    lines = out.splitlines()
    t = cu[-1]
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    assert lines[0] == (f"{_count(len(cu) - 1, 'sequence')} (lengths {min(lengths)}..{max(lengths)}, "
                        f"{_count(lengths.count(0), 'empty slot')}), T_global={t}, cp={cp}, T_local={t // cp}")
    ranks = list(range(cp)) if rank is None else [rank]
    t_local = t // cp
    zig = [zigzag_rows(cu, cp, r).tolist() for r in range(cp)] if t <= 4096 else None

    def in_slice(rows, p):
        return sum(p * t_local <= g < (p + 1) * t_local for g in rows)

    def counts(r):  # per direction: rows this rank sends to each rank
        to_contiguous = [in_slice(zig[r], p) for p in range(cp)]  # my zigzag rows, per contiguous slice
        from_zigzag = [in_slice(zig[p], r) for p in range(cp)]  # rank p's zigzag rows in my slice
        return to_contiguous, from_zigzag

    if not full:
        assert len(lines) == 2 + cp, out
        assert lines[-1].startswith("(--rank r: one rank's transfers")
        for r in ranks:
            line = lines[1 + r]
            assert line.startswith(f"rank {r}: "), line
            if zig is None:
                continue
            to_contiguous, from_zigzag = counts(r)
            for direction, per_peer in (("zigzag->contiguous", to_contiguous), ("contiguous->zigzag", from_zigzag)):
                if direction not in directions:
                    assert direction not in line
                    continue
                rows = sum(n for p, n in enumerate(per_peer) if p != r)
                peers = sum(1 for p, n in enumerate(per_peer) if p != r and n)
                assert f"{direction} sends {rows} of {t_local} rows to {_count(peers, 'rank')} (" in line, (line, rows)
        return
    assert [int(m) for m in re.findall(r"^# rank (\d+)$", out, re.M)] == ranks
    routes = re.findall(r"^route (\w+) -> (\w+)  cp=\d+ rank=(\d+).*\n.*\n  send splits \[(.*)\]\n  recv splits \[(.*)\]",
                        out, re.M)
    assert len(routes) == len(ranks) * len(directions)
    if zig is None:
        return
    for source, target, r, send, recv in routes:
        r = int(r)
        send = [int(v) for v in send.split(", ")] if send else []
        recv = [int(v) for v in recv.split(", ")] if recv else []
        to_contiguous, from_zigzag = counts(r)
        if (source, target) == ("zigzag", "contiguous"):
            assert (send, recv) == (to_contiguous, from_zigzag), (r, send, recv)
        else:
            assert (send, recv) == (from_zigzag, to_contiguous), (r, send, recv)


@fuzz_settings(150)
@given(data=st.data())
def test_route(data):
    flags = {}
    cp = data.draw(st.integers(1, 6))
    fair = data.draw(st.integers(0, 2)) > 0  # two in three cases: flags written as documented, cp matching
    if data.draw(st.integers(0, 9)):
        flags["--cu"] = data.draw(list_texts(valid=packing_lists(cp, cp), always_valid=fair))
    if data.draw(st.integers(0, 9)):
        flags["--cp"] = str(cp) if fair else data.draw(int_texts)
    if data.draw(st.booleans()):
        flags["--rank"] = data.draw(st.integers(0, cp - 1).map(str) if fair else int_texts)
    elif data.draw(st.booleans()):
        flags["--all"] = True
    if data.draw(st.integers(0, 3)) == 0:
        flags["--direction"] = data.draw(st.sampled_from(["both", "zigzag->contiguous", "contiguous->zigzag"]
                                                         + ([] if fair else ["zigzag", "ZIGZAG->contiguous", ""])))
    if data.draw(st.integers(0, 3)) == 0:
        flags["--conv-width"] = data.draw(st.integers(1, 5).map(str) if fair else int_texts)
    argv = ["route", *argv_of(flags)]
    extra = [] if fair else data.draw(st.sampled_from([[], ["--cpp", "2"], ["stray"], ["--rank"]]))
    rc, out, err = run_cli(argv + extra)
    expected = route_expectation(flags)
    if extra or any(maybe_option(v) for v in flags.values()):
        if rc == 2:  # argparse's own refusal (an unknown or half-given flag): still nothing printed
            assert out == "" and "error" in err
            return
        assert not extra, (argv, extra, rc)
    if expected[0] == "flag":
        assert_flag_error(rc, out, err, *expected[1])
        return
    _, cu, cp, rank, directions, width = expected
    assert rc == 0 and err == "", (argv, rc, err)
    check_route_output(out, cu, cp, rank, directions, full="--all" in flags or rank is not None)


def test_route_examples_from_the_issue():
    """The silent misparses of issue #14 are flag errors now (and nothing is printed first)."""
    for argv, flag in ((["--cu", "0,128 256", "--cp", "2"], "--cu"), (["--cu", "0,,8", "--cp", "2"], "--cu"),
                       (["--cu", "0," + "9" * 30, "--cp", "2"], "--cu"), (["--cu", "0,8", "--cp", "2", "--rank", "5"],
                                                                           "--rank")):
        assert_flag_error(*run_cli(["route", *argv]), flag)


# ------------------------------------------------------------------------------------------
# gdn-cp doctor
# ------------------------------------------------------------------------------------------
def _mode_legal(mode, k, v, tp, cp) -> bool:
    div = tp * cp if mode == "headwise" else tp
    return k % div == 0 and v % div == 0


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Throw-away paths: an empty folder, a plain file, and a path that does not exist."""
    root = tmp_path_factory.mktemp("fuzz_paths")
    (root / "empty").mkdir()
    (root / "file.txt").write_text("not megatron")
    return {"empty": str(root / "empty"), "file": str(root / "file.txt"), "missing": str(root / "missing")}


@CPU_ONLY
@fuzz_settings(80)
@given(data=st.data())
def test_doctor(folders, data):
    flags = {}
    if data.draw(st.booleans()):
        flags["--heads"] = data.draw(list_texts(valid=st.lists(st.sampled_from([1, 2, 3, 4, 8, 16, 32]),
                                                               min_size=2, max_size=2)))
    for flag in ("--tp", "--cp"):
        if data.draw(st.booleans()):
            flags[flag] = data.draw(st.one_of(st.integers(1, 8).map(str), int_texts))
    path_kind = data.draw(st.sampled_from([None, None, "empty", "file", "missing"]))
    if path_kind:
        flags["--path"] = folders[path_kind]
    rc, out, err = run_cli(["doctor", *argv_of(flags)])
    if any(maybe_option(v) for v in flags.values()) and rc == 2:
        assert out == ""
        return
    heads = cli_int_list(flags["--heads"]) if "--heads" in flags else [2, 2]
    tp, cp = (cli_int(flags.get(f, "1")) for f in ("--tp", "--cp"))
    if heads is None or len(heads) != 2 or min(heads) < 1:
        return assert_flag_error(rc, out, err, "--heads")
    if tp is None or not 1 <= tp <= MAX_TP:  # the one size limit (gdn_cp.checks), said by argparse
        return assert_flag_error(rc, out, err, "--tp")
    if cp is None or not 1 <= cp <= MAX_CP:
        return assert_flag_error(rc, out, err, "--cp")
    if path_kind == "missing":
        return assert_flag_error(rc, out, err, "--path")
    k, v = heads
    if "--heads" not in flags and ("--tp" in flags or "--cp" in flags):  # they only matter with --heads
        return assert_flag_error(rc, out, err, "--heads")
    if "--heads" in flags and v % k:
        return assert_flag_error(rc, out, err, "--heads")
    if path_kind in ("empty", "file"):  # nothing to look at: a bad argument, as for `gdn-cp patch`
        return assert_flag_error(rc, out, err, "--path")
    problems = []
    if "--heads" in flags:
        for mode in MODE_NAMES:
            assert re.search(rf"^  {mode:<10} {'legal  ' if _mode_legal(mode, k, v, tp, cp) else 'ILLEGAL'}", out, re.M), \
                (mode, out)
        if not any(_mode_legal(m, k, v, tp, cp) for m in MODE_NAMES):
            problems.append("no linear_cp_mode is legal")
    foreign = re.search(r"^megatron-core patch at .*: (\w+)$", out, re.M)
    if foreign and foreign.group(1) not in ("pristine", "patched"):
        problems.append("megatron-core at ")
    assert rc == (1 if problems else 0), (flags, rc, out)
    for problem in problems:
        assert re.search(rf"^problem: .*{re.escape(problem)}", out, re.M), (problem, out)


# ------------------------------------------------------------------------------------------
# gdn-cp patch (never pointed at the installed megatron-core for apply / revert)
# ------------------------------------------------------------------------------------------
@fuzz_settings(60)
@given(data=st.data())
def test_patch(folders, data):
    action = data.draw(st.sampled_from(["check", "check", "apply", "revert", "undo", None]))
    path_kind = data.draw(st.sampled_from(["empty", "file", "missing"] + ([None] if action == "check" else [])))
    argv = ["patch"] + ([action] if action else []) + ([folders[path_kind]] if path_kind else [])
    expect = data.draw(st.sampled_from([None, "pristine", "patched", "broken"]))
    if expect:
        argv += ["--expect", expect]
    before = {p: sorted(Path(folders["empty"]).iterdir()) for p in ("empty",)}
    rc, out, err = run_cli(argv)
    assert sorted(Path(folders["empty"]).iterdir()) == before["empty"]  # nothing was written
    if action not in ("check", "apply", "revert") or (expect and (action != "check" or expect == "broken")):
        return assert_flag_error(rc, out, err, "patch", "--expect", "argument", "unrecognized")
    if path_kind == "missing":  # nothing to look at: a bad argument (2), as for doctor --path
        assert rc == 2 and "does not exist" in err and out == "", (rc, out, err)
    elif path_kind in ("empty", "file"):
        assert rc == 2 and "neither a Megatron-LM checkout" in err and out == "", (rc, out, err)
    else:  # check on the importable megatron-core (CI installs and patches it)
        state = re.search(r"^state: (\w+)$", out, re.M)
        if state is None:
            assert rc == 1 and "error" in err
        elif expect:
            assert rc == (0 if state.group(1) == expect else 1)
        else:
            assert rc == (0 if state.group(1) in ("pristine", "patched") else 1)


def test_patch_messages_print_once(folders, caplog):
    """The patch tool's message reaches the user once: on stdout, not again as an INFO log line."""
    import logging

    from gdn_cp import patch

    caplog.set_level(logging.INFO, logger="gdn_cp.patch")
    if patch.overall_state(patch.check_patch()) != patch.PATCHED:
        pytest.skip("needs the installed megatron-core patched (CI patches it)")
    rc, out, _ = run_cli(["patch", "apply"])  # already patched: a no-op that says so
    assert rc == 0 and "already patched" in out
    assert not [r for r in caplog.records if "already patched" in r.getMessage() and r.levelno >= logging.INFO]


def test_missing_megatron_hint_works_for_this_python(monkeypatch):
    from gdn_cp import patch
    from gdn_cp.pins import get_pin

    monkeypatch.setattr(patch.tree.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(patch.PatchError) as info:
        patch.find_megatron_root()
    assert get_pin().install_command() in str(info.value)
    assert "--ignore-requires-python" in get_pin().install_command((3, 11))
    assert get_pin().install_command((3, 12)) == f"python -m pip install {get_pin().requirement}"


# ------------------------------------------------------------------------------------------
# gdn-cp run (stopped before it spawns ranks) and gdn-cp selftest
# ------------------------------------------------------------------------------------------
def run_expectation(flags: dict):
    cps = cli_int_list(flags.get("--cp", "2,4"))
    if cps is None or min(cps) < 1 or max(cps) > 64 or len(set(cps)) != len(cps):
        return "flag", ("--cp",)
    modes = None
    if "--modes" in flags:
        modes = [m.strip() for m in flags["--modes"].split(",")]
        if any(m not in MODE_NAMES for m in modes) or len(set(modes)) != len(modes):
            return "flag", ("--modes",)
    # argparse refuses the first bad value in the order the flags were given (test_run_flags: this order)
    heads = cli_int_list(flags.get("--heads", "4,8"))
    if heads is None or len(heads) != 2 or min(heads) < 1 or max(heads) > 256 or heads[1] % heads[0]:
        return "flag", ("--heads",)
    seqs = cli_int(flags.get("--sequences", "37"))
    if seqs is None or not 1 <= seqs <= 2**16:
        return "flag", ("--sequences",)
    tokens = cli_int(flags.get("--tokens-per-rank", "1024"))
    if tokens is None or not 2 <= tokens <= 2**20 or tokens % 2:
        return "flag", ("--tokens-per-rank",)
    for flag, choices in (("--dtype", ("float32", "float64", "bfloat16")), ("--device", ("cpu", "cuda")),
                          ("--backend", ("reference", "fla")), ("--dist-backend", ("gloo", "nccl"))):
        if flag in flags and flags[flag] not in choices:
            return "flag", (flag,)
    # after parsing, check_job refuses the job before spawning; when several of these apply, which
    # one it names first is not a documented rule: any of them
    device = flags.get("--device", "cpu")
    refusals = [flag for flag, bad in (("--device", device == "cuda"), ("--backend", flags.get("--backend") == "fla"),
                                       ("--dist-backend", flags.get("--dist-backend") == "nccl"))
                if bad]  # no CUDA here
    for mode in modes or ():  # a mode asked for by name must run at every CP size (TP=1)
        if mode == "headwise" and any(h % cp for h in heads for cp in cps):
            refusals.append("--modes headwise cannot run")
    if refusals:
        return "flag", tuple(refusals)
    return "ok", dict(cp_sizes=tuple(cps), modes=None if modes is None else tuple(modes), num_sequences=seqs,
                      tokens_per_rank=tokens, dtype=flags.get("--dtype", "float32"), device="cpu",
                      backend="reference", dist_backend="gloo")


@CPU_ONLY
@fuzz_settings(120)
@given(data=st.data())
def test_run_flags(data):
    flags = {}
    if data.draw(st.booleans()):
        flags["--cp"] = data.draw(list_texts(valid=st.lists(st.integers(1, 8), min_size=1, max_size=3)))
    if data.draw(st.integers(0, 2)) == 0:
        flags["--modes"] = data.draw(list_texts(item=st.sampled_from(list(MODE_NAMES) + ["ring", "", " chunkwise",
                                                                                          "auto"])))
    if data.draw(st.integers(0, 2)) == 0:
        flags["--heads"] = data.draw(list_texts(valid=st.lists(st.sampled_from([1, 2, 3, 4, 8, 16]), min_size=2,
                                                               max_size=2)))
    for flag, valid in (("--sequences", st.integers(1, 40)), ("--tokens-per-rank", st.integers(1, 64))):
        if data.draw(st.integers(0, 2)) == 0:
            flags[flag] = data.draw(st.one_of(valid.map(str), int_texts))
    for flag, choices in (("--dtype", ["float32", "float64", "bfloat16", "float16", ""]), ("--device", ["cpu", "cuda", "tpu"]),
                          ("--backend", ["reference", "fla", "triton"]), ("--dist-backend", ["gloo", "nccl", "mpi"])):
        if data.draw(st.integers(0, 3)) == 0:
            flags[flag] = data.draw(st.sampled_from(choices))
    seen = []

    def fake_run_job(cfg, echo, **kw):
        check_job(cfg)  # what run_job does first; then it would spawn ranks
        seen.append(cfg)
        return types.SimpleNamespace(exit_code=0)

    with mock.patch("gdn_cp.cli.main_job.run_job", fake_run_job):
        rc, out, err = run_cli(["run", *argv_of(flags)])
    if any(maybe_option(v) for v in flags.values()) and rc == 2:
        assert out == "" and not seen
        return
    expected = run_expectation(flags)
    if expected[0] == "flag":
        assert not seen or rc == 2
        return assert_flag_error(rc, out, err, *expected[1])
    assert rc == 0 and len(seen) == 1, (flags, rc, err)
    got = seen[0]
    for field, want in expected[1].items():
        assert getattr(got, field) == want, (field, getattr(got, field), want)


@CPU_ONLY
@fuzz_settings(12)
@given(flags=st.lists(st.sampled_from(["--gpu", "--json", "--cpu", "-x"]), max_size=2, unique=True))
def test_selftest_flags(flags):
    rc, out, err = run_cli(["selftest", *flags])
    if set(flags) - {"--gpu", "--json"}:
        return assert_flag_error(rc, out, err, "unrecognized")
    if "--gpu" in flags:  # on a CPU machine: the FLA check cannot run, said before anything runs
        return assert_flag_error(rc, out, err, "--gpu")
    assert rc == 0, (flags, rc, out)
    if "--json" in flags:
        report = json.loads(out)
        assert report["ok"] is True and "the FLA backend" in report["not_checked"][0]


@fuzz_settings(40)
@given(argv=st.lists(st.one_of(st.sampled_from(["route", "doctor", "selftest", "-v", "--version", "-h", "help", "",
                                                "--", "rout", "--verbose"]), int_texts), max_size=2))
def test_top_level(argv):
    """Anything that is not a known command is a flag error; ``--version`` and ``-h`` succeed; no
    exception escapes. (``run`` and ``patch`` are left out: their tests above keep them from
    spawning ranks or writing files.)"""
    rc, out, err = run_cli(argv)
    if argv[:1] in (["-h"], ["--version"]):
        assert rc == 0 and out
    elif "-h" in argv or "--version" in argv:
        assert rc in (0, 2)  # argparse acts on them where it meets them, before unknown arguments
    elif not argv or argv in (["-v"], ["--verbose"]):
        assert rc == 2 and out == "" and err.count("\n") == 1 and "usage: gdn-cp --help" in err  # no command
    elif argv[0] not in ("route", "doctor", "selftest", "-v", "--verbose", "-h", "--version"):
        assert rc == 2 and out == "" and "error" in err and err.count("\n") == 1, err


def test_every_flag_has_help():
    """Every option of every command says what it is (``--help`` lines), and lists are comma-separated."""
    from gdn_cp.cli import build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # noqa: SLF001 - argparse keeps them here
    for name, sub in commands.items():
        subs = [sub] + [p for a in sub._actions if hasattr(a, "choices") and isinstance(a.choices, dict)  # noqa: SLF001
                        for p in a.choices.values()]
        for p in subs:
            for action in p._actions:  # noqa: SLF001
                if action.dest != "help" and not isinstance(action.choices, dict):
                    assert action.help, (name, p.prog, action.option_strings or action.dest)
