"""TileLang's compile warnings kept off stderr (gdn_cp/ops/flashqla/native_warnings.py, issue 46).

:class:`LineFilter` is tested in this process; the filter itself (a pipe in place of fd 2, a child process
behind it) only in processes of their own: pytest captures fd 2 itself (tests/conftest.py sets
``GDN_CP_NATIVE_WARNINGS=show`` for the session). The records are written as TVM's ``LOG(WARNING)`` writes
them: the header and the text in one write, the newline in the next.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from gdn_cp.ops.flashqla import native_warnings
from gdn_cp.ops.flashqla.native_warnings import LineFilter

ROOT = Path(__file__).resolve().parents[2]

# tilelang/src/transform/legalize_vectorized_loop.cc and verify_buffer_init.cc (TileLang 0.1.15), behind TVM's header
VECTORIZED = (b"[18:02:11] /workspace/tilelang/src/transform/legalize_vectorized_loop.cc:85: Warning: T.vectorized loop "
              b"over `i` with extent 4 is lowered as a serial loop because TileLang could not find a valid vectorization "
              b"plan. Scalar accumulator updates inside the loop are a common cause; move reductions to T.unroll or "
              b"T.serial if this is intended.")
BUFFER_INIT = (b"[18:02:12] /workspace/tilelang/src/transform/verify_buffer_init.cc:394: Warning: Buffer read before "
               b"initialization: 2 buffer(s) read before anything writes them\n"
               b"  [1] `dk_fragment` is read before anything writes it\n"
               b"  --> /site-packages/flash_qla/ops/hopper/bwd.py:212:8\n"
               b"      T.gemm accumulates into C, so an uninitialized accumulator adds into stale contents. Add "
               b"`T.clear(C)` before the gemm, or pass `clear_accum=True`.\n"
               b"  [2] `acc_s` is read before anything writes it\n"
               b"Initialize the buffer before its first read (for example with `T.clear`, `T.fill`, or a `T.copy` into "
               b"it). If you believe this is a false positive, disable the check by setting "
               b"`PassConfigKey.TL_DISABLE_BUFFER_INIT_CHECK` in the pass config.")


def _through(chunks, lines: LineFilter | None = None) -> bytes:
    lines = lines or LineFilter()
    return b"".join(lines.feed(c, 0.0) for c in chunks) + lines.release()


def test_only_tilelang_records_are_dropped_however_the_bytes_arrive():
    writes = [b"one\n", VECTORIZED, b"\n", b"two\n  indented, not a record\n", BUFFER_INIT, b"\n", VECTORIZED, b"\n",
              b"three\n"]
    wanted = b"one\ntwo\n  indented, not a record\nthree\n"
    lines = LineFilter()
    assert _through(writes, lines) == wanted and lines.hidden == 3
    stream = b"".join(writes)
    assert _through([stream[i:i + 1] for i in range(len(stream))]) == wanted  # byte by byte
    assert _through([stream[i:i + 97] for i in range(0, len(stream), 97)]) == wanted


@pytest.mark.parametrize("line", [
    VECTORIZED.replace(b"[18:02:11] /workspace/tilelang/src", b"[2026-12-05 18:02:11.123] src"),  # another header
    VECTORIZED.replace(b"[18:02:11] ", b""),  # no time
    VECTORIZED.replace(b"extent 4", b"extent (n + 3) // 4"),
    # as TileLang 0.1.15's wheel printed it on the GPU machine (run 2026-12-05g's log): no file, no line
    VECTORIZED.replace(b"[18:02:11] /workspace/tilelang/src/transform/legalize_vectorized_loop.cc:85", b"[19:04:03] "),
])
def test_tolerant_of_the_header_and_the_loop(line):
    assert _through([line, b"\n"]) == b""


@pytest.mark.parametrize("line", [
    VECTORIZED + b"Traceback (most recent call last):",  # another write landed before the record's newline
    b"Traceback: " + VECTORIZED,
    VECTORIZED.replace(b"Warning: ", b"Error: "),
    VECTORIZED.split(b"Warning: ")[1],  # the text without TVM's header: somebody else's
])
def test_a_line_that_is_not_exactly_a_record_goes_out(line):
    assert _through([line + b"\n"]) == line + b"\n"


def test_the_gpu_machines_own_log_keeps_only_what_is_not_tilelangs():
    """Run 2026-12-05f's stage log as the GPU printed it (16 ranks' stderr, TileLang compiling FlashQLA): every
    vectorization and buffer-init record dropped, every other line kept in order."""
    text = (ROOT / "benchmarks" / "results" / "runs" / "run_2026-12-05f" / "run.log").read_bytes()
    lines = LineFilter()
    out = _through([text], lines)
    assert b"serial loop" not in out and b"Buffer read before initialization" not in out
    assert b"Initialize the buffer" not in out and lines.hidden == text.count(b"serial loop") + text.count(b"Buffer read")
    kept = [ln for ln in text.splitlines(keepends=True)
            if b": Warning: " not in ln and not ln.startswith((b"  [1] `", b"  --> ", b"Initialize the buffer"))]
    assert out == b"".join(kept)


def test_a_record_cut_short_goes_out_as_it_came():
    head = BUFFER_INIT.rsplit(b"\n", 1)[0] + b"\n"  # without its last line
    assert _through([head, b"after\n"]) == head + b"after\n"  # another line ended it
    assert _through([head]) == head  # the input ended
    lines = LineFilter()
    assert lines.feed(head, 1.0) == b"" and lines.held_since == 1.0
    assert lines.release() == head  # its hold was over
    assert lines.feed(b"x\n", 2.0) == b"x\n"


def test_an_unfinished_line_is_held_then_the_rest_of_it_goes_out_at_once():
    lines = LineFilter()
    assert lines.feed(b"ok\nprogress 10%\r", 5.0) == b"ok\n" and lines.held_since == 5.0
    assert lines.feed(b"progress 20%\r", 5.1) == b"" and lines.held_since == 5.0  # appending does not extend the hold
    assert lines.release() == b"progress 10%\rprogress 20%\r"
    assert lines.feed(b"progress 30%\r", 5.3) == b"progress 30%\r"  # part of the line went out: the rest follows
    assert lines.feed(b"done\nnext", 5.4) == b"done\n" and lines.held_since == 5.4
    assert lines.feed(b" line\n", 5.5) == b"next line\n" and lines.held_since is None


def test_not_wanted_at_debug_or_with_show(monkeypatch):
    """The cases that leave fd 2 alone (the others replace it: tested in processes of their own)."""
    logger = logging.getLogger("gdn_cp")
    level = logger.level
    try:
        monkeypatch.setenv("GDN_CP_NATIVE_WARNINGS", "hide")
        logger.setLevel(logging.DEBUG)  # as `gdn-cp -v` (its ranks: the root logger at DEBUG)
        assert native_warnings.quiet_native_warnings() is False
        logger.setLevel(logging.WARNING)
        monkeypatch.setenv("GDN_CP_NATIVE_WARNINGS", "show")
        assert native_warnings.quiet_native_warnings() is False
        assert native_warnings._FILTER is None
        monkeypatch.setenv("GDN_CP_NATIVE_WARNINGS", "quiet")
        with pytest.raises(ValueError, match="GDN_CP_NATIVE_WARNINGS='quiet'.*use one of hide, show"):
            native_warnings.quiet_native_warnings()
    finally:
        logger.setLevel(level)


SCRIPT = """
import logging, os, signal, sys
# Python's own Ctrl-C handler, also where the session itself started with SIGINT ignored (a shell's background job
# passes that on, and Python then installs none): the interrupt case tests the filter, not how pytest was started
signal.signal(signal.SIGINT, signal.default_int_handler)
VECTORIZED, BUFFER_INIT, how = eval(sys.argv[1]), eval(sys.argv[2]), sys.argv[3]
if how == "debug":
    logging.basicConfig(level=logging.DEBUG)
if how == "fake":  # through the backend's own entry, FlashQLA's CPU stand-in behind it
    logging.basicConfig(level=logging.INFO)
    from tests.ops import fake_flashqla
    from gdn_cp.ops.flashqla.kernels import flashqla_api
    fake_flashqla.install()
    flashqla_api()
    print(flashqla_api() is flashqla_api(), flush=True)
else:
    from gdn_cp.ops.flashqla.native_warnings import quiet_native_warnings
    print(quiet_native_warnings(), quiet_native_warnings(), flush=True)
os.write(2, b"line 1\\n")
os.write(2, VECTORIZED); os.write(2, b"\\n")
sys.stderr.write("line 2 from sys.stderr\\n")
os.write(2, BUFFER_INIT); os.write(2, b"\\n")
os.write(2, b"line 3 ")
if how == "exit":
    os._exit(3)
if how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if how == "interrupt":  # as Ctrl-C: SIGINT to the whole process group, the filter too
    import time
    time.sleep(0.3)
    os.killpg(0, signal.SIGINT)
    time.sleep(30)
os.write(2, b"continued\\n"); os.write(2, VECTORIZED); os.write(2, b"\\n")
if how == "many":
    for i in range(3000):
        os.write(2, b"%d %s\\n" % (i, b"x" * 60))
        if i % 7 == 0:
            os.write(2, VECTORIZED); os.write(2, b"\\n")
raise RuntimeError("boom")
"""


def _run(how: str, setting: str = "hide") -> SimpleNamespace:
    """The script's pid, exit status, stdout and stderr (read to the end: the filter's end too)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), GDN_CP_NATIVE_WARNINGS=setting)
    with subprocess.Popen([sys.executable, "-c", SCRIPT, repr(VECTORIZED), repr(BUFFER_INIT), how], env=env, cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True) as proc:
        out, err = proc.communicate(timeout=60)
    return SimpleNamespace(pid=proc.pid, returncode=proc.returncode, stdout=out, stderr=err)


def _hid(n: int, proc: SimpleNamespace) -> str:
    return (f"gdn-cp: hid {n} TileLang compile warnings of process {proc.pid} (FlashQLA's kernels; "
            "GDN_CP_NATIVE_WARNINGS=show, or gdn-cp -v, shows them)\n")


def test_a_process_hides_them_and_keeps_everything_else_in_order():
    proc = _run("crash")
    assert proc.returncode == 1 and proc.stdout == b"True True\n"
    err = proc.stderr.decode()
    head, tail = err.split("Traceback", 1)
    assert head == "line 1\nline 2 from sys.stderr\nline 3 continued\n"
    assert tail.endswith("RuntimeError: boom\n" + _hid(3, proc)) and "Warning" not in tail


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_nothing_is_lost_when_the_process_dies(how):
    proc = _run(how)
    assert proc.returncode == (3 if how == "exit" else -9)
    assert proc.stderr.decode() == "line 1\nline 2 from sys.stderr\nline 3 " + _hid(2, proc)


def test_ctrl_c_reaches_the_process_and_its_traceback_comes_through():
    proc = _run("interrupt")
    assert proc.returncode == -signal.SIGINT  # Python ends a KeyboardInterrupt by the signal
    err = proc.stderr.decode()
    assert err.startswith("line 1\nline 2 from sys.stderr\nline 3 Traceback (most recent call last):\n")
    assert err.endswith("KeyboardInterrupt\n" + _hid(2, proc)) and "Warning" not in err


def test_many_lines_across_the_pipe_in_order():
    proc = _run("many")
    err = proc.stderr.decode().split("\n")
    numbered = [line for line in err if line[:1].isdigit()]
    assert numbered == [f"{i} {'x' * 60}" for i in range(3000)]
    assert err[-2] == _hid(3 + 429, proc).rstrip("\n") and "Warning" not in proc.stderr.decode()


@pytest.mark.parametrize("how, setting", [("crash", "show"), ("debug", "hide")])
def test_show_and_debug_leave_stderr_as_it_was(how, setting):
    proc = _run(how, setting)
    assert proc.stdout == b"False False\n"
    err = proc.stderr
    want = (b"line 1\n" + VECTORIZED + b"\nline 2 from sys.stderr\n" + BUFFER_INIT + b"\nline 3 continued\n" + VECTORIZED
            + b"\n")
    assert err.startswith(want) and err.endswith(b"RuntimeError: boom\n") and b"gdn-cp: hid" not in err


def test_flashqla_api_hides_them_before_anything_compiles():
    proc = _run("fake")
    assert proc.stdout == b"True\n"
    err = proc.stderr.decode()
    said = ("INFO:gdn_cp.ops.flashqla.native_warnings:TileLang's compile warnings (C++, on stderr) are hidden while "
            "FlashQLA's kernels compile: GDN_CP_NATIVE_WARNINGS=show, or gdn_cp's log at DEBUG (gdn-cp -v), shows them\n")
    assert said in err and err.split(said, 1)[1].startswith("line 1\nline 2 from sys.stderr\nline 3 continued\n")
    assert "Warning" not in err and err.endswith(_hid(3, proc))


def test_tilelangs_info_lines_are_kept_out_unless_shown(monkeypatch):
    """TileLang's import sets its logger ``tilelang`` to INFO with a handler of its own (stdout): two lines per kernel
    compiled. After quiet_tilelang_log its INFO records are dropped and its warnings kept; with
    ``GDN_CP_NATIVE_WARNINGS=show`` or gdn_cp's log at DEBUG it is left at INFO."""
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.levelname)

    tilelang = logging.getLogger("tilelang")
    gdn_cp_log = logging.getLogger("gdn_cp")
    saved = (tilelang.level, tilelang.propagate, gdn_cp_log.level)
    handler = Keep()
    tilelang.addHandler(handler)
    tilelang.propagate = False
    try:
        gdn_cp_log.setLevel(logging.WARNING)
        for env, debug, quiet in (("show", False, False), ("hide", True, False), ("hide", False, True)):
            monkeypatch.setenv("GDN_CP_NATIVE_WARNINGS", env)
            gdn_cp_log.setLevel(logging.DEBUG if debug else logging.WARNING)
            tilelang.setLevel(logging.INFO)  # as TileLang's import leaves it
            records.clear()
            assert native_warnings.quiet_tilelang_log() is quiet
            logging.getLogger("tilelang.jit.kernel").info("TileLang begins to compile kernel `k`")
            logging.getLogger("tilelang.jit.kernel").warning("a warning of TileLang's")
            assert records == (["WARNING"] if quiet else ["INFO", "WARNING"]), (env, debug, records)
    finally:
        tilelang.removeHandler(handler)
        tilelang.setLevel(saved[0])
        tilelang.propagate = saved[1]
        gdn_cp_log.setLevel(saved[2])
