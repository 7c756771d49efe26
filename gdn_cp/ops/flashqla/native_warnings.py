"""TileLang's compile warnings kept out of a process's stderr (issue 46).

TileLang compiles FlashQLA's kernels on first use, and its C++ passes warn through TVM's ``LOG(WARNING)``:
straight to file descriptor 2, past Python's logging and warnings filters, hundreds of lines on a cold
compile ("T.vectorized loop ... is lowered as a serial loop", "Buffer read before initialization"), none of
them the user's to act on. :func:`quiet_native_warnings` (called by ``flashqla_api()`` before anything
compiles) puts a pipe in place of fd 2, once per process, and starts a small child process (this file, run
as a script) that copies everything written to it to the real stderr, unchanged and in order, except those
records (:class:`LineFilter`). At exit the child prints one line counting what it hid.

Why a child process and not a thread: a thread needs the GIL, and TVM may write into a full pipe while
holding it (a deadlock); the child has no such tie. When this process ends, however it ends (an exception,
``os._exit``, SIGKILL), the pipe closes and the child writes what it still holds and exits: nothing is lost.
It ignores SIGINT / SIGTERM / SIGHUP for that reason (Ctrl-C reaches the whole process group); it stops at
the end of its input. At a normal exit this process puts fd 2 back and waits briefly for the child, so the
last lines are out before the process ends. Python's ``sys.stderr`` keeps working (it writes to fd 2). What
changes: stderr lines may come out a few milliseconds after stdout lines written later (two streams that
were ordered by write time on one terminal), and a line of stderr without its newline is held up to
:data:`HOLD_S` (TVM writes a record and its newline in two writes).

Nothing is done on a platform other than Linux, without an fd 2, with ``GDN_CP_NATIVE_WARNINGS=show``, or
when gdn_cp's log is at DEBUG (``gdn-cp -v``, also in ``gdn-cp run``'s ranks). Stdlib only at import: the
child runs this file by its path, without gdn_cp on ``sys.path``.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import select
import signal
import subprocess
import sys
import time
from typing import Optional

__all__ = ["HOLD_S", "LineFilter", "quiet_native_warnings", "quiet_tilelang_log"]

log = logging.getLogger(__name__)

HOLD_S = 0.2
"""How long an unfinished line (or an unfinished TileLang record) is held before it goes out as it is."""
EXIT_WAIT_S = 2.0
"""How long a normal exit waits for the child to write what it holds (longer where other processes, e.g.
workers forked later, still hold the pipe: then the child writes their output until they end)."""
MAX_RECORD_LINES = 256
"""A buffer-init record longer than this is not TileLang's: it goes out as it is."""

_HEADER = r"(?:\[[^\]]{1,40}\] )?(?:\S+:\d+)?: Warning: "
"""TVM's LOG(WARNING) header: ``[18:02:11] /src/x.cc:85: Warning: ``, or, as TileLang 0.1.15's wheel prints it on
the GPU machine (seen in run 2026-12-05f's log), ``[18:52:44] : Warning: `` (no file and line)."""
VECTORIZED = re.compile(
    _HEADER + r"T\.vectorized loop over `[^`]*` with extent .+? is lowered as a serial loop because TileLang could "
    r"not find a valid vectorization plan\. Scalar accumulator updates inside the loop are a common cause; move "
    r"reductions to T\.unroll or T\.serial if this is intended\.")
"""tilelang/src/transform/legalize_vectorized_loop.cc (TileLang 0.1.15), a whole line."""
BUFFER_INIT = re.compile(_HEADER + r"Buffer read before initialization: \d+ buffer\(s\) read before anything writes them")
BUFFER_INIT_END = re.compile(
    r"Initialize the buffer before its first read \(for example with .*\)\. If you believe this is a false positive, "
    r"disable the check by setting `PassConfigKey\.TL_DISABLE_BUFFER_INIT_CHECK` in the pass config\.")
"""tilelang/src/transform/verify_buffer_init.cc (TileLang 0.1.15): the header line, lines indented by two spaces
(``  [1] `dk_fragment` is read ...``, ``  --> file:line``, ``      T.gemm accumulates ...``), this last line."""


class LineFilter:
    """Bytes in, the same bytes out less TileLang's records; pure (the caller owns time and file descriptors).

    Only whole lines are dropped: a vectorized-loop line, or a buffer-init record from its header to its
    last line. A record cut short (another line, the input's end, :meth:`release`) goes out as it came. A
    line without its newline yet is held (it may be a record whose newline comes in the next write) until
    :meth:`release`; once part of a line went out, the rest of it follows at once."""

    def __init__(self) -> None:
        self.hidden = 0
        self.held_since: Optional[float] = None
        self._partial = b""
        self._record: list[bytes] = []
        self._mid_line = False

    def feed(self, data: bytes, now: float) -> bytes:
        """What of ``data`` (with what was held) goes out now; ``now`` starts the hold of what is kept."""
        out = []
        if self._mid_line:
            end = data.find(b"\n")
            if end < 0:
                return data
            out.append(data[:end + 1])
            data, self._mid_line = data[end + 1:], False
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        out += [self._line(line + b"\n") for line in lines]
        if not (self._partial or self._record):
            self.held_since = None
        elif self.held_since is None or lines:  # what is held now began in this write
            self.held_since = now
        return b"".join(out)

    def release(self) -> bytes:
        """What is held, as it is (its hold is over, or the input ended)."""
        out = b"".join(self._record) + self._partial
        self._mid_line = bool(self._partial)
        self._record, self._partial, self.held_since = [], b"", None
        return out

    def _line(self, line: bytes) -> bytes:
        text = line[:-1].decode("utf-8", "replace")
        if self._record:
            if BUFFER_INIT_END.fullmatch(text):
                self._record = []
                self.hidden += 1
                return b""
            if text.startswith("  ") and len(self._record) < MAX_RECORD_LINES:
                self._record.append(line)
                return b""
            held, self._record = b"".join(self._record), []
            return held + self._line(line)
        if VECTORIZED.fullmatch(text):
            self.hidden += 1
            return b""
        if BUFFER_INIT.fullmatch(text):
            self._record = [line]
            return b""
        return line


class _Out:
    """The real stderr; once a write fails (the reader went away) the rest is dropped, while the input is still
    read to its end, so that no writer ever blocks on a full pipe or gets EPIPE."""

    def __init__(self, fd: int) -> None:
        self.fd, self.broken = fd, False

    def write(self, data: bytes) -> None:
        while data and not self.broken:
            try:
                data = data[os.write(self.fd, data):]
            except OSError:
                self.broken = True


def _child_main(note: str) -> None:
    """The child: stdin (the pipe) to fd 2 (the real stderr) through a :class:`LineFilter`; ``note``: the line
    written at the end when something was hidden (``{n}``: how many)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    lines, out = LineFilter(), _Out(2)
    while True:
        wait = None if lines.held_since is None else max(0.0, lines.held_since + HOLD_S - time.monotonic())
        if not select.select([0], [], [], wait)[0]:
            out.write(lines.release())
            continue
        data = os.read(0, 1 << 16)
        if not data:
            break
        out.write(lines.feed(data, time.monotonic()))
    out.write(lines.release())
    if lines.hidden and note:
        out.write(note.replace("{n}", str(lines.hidden)).encode() + b"\n")


_FILTER: Optional[subprocess.Popen] = None


def _shown() -> bool:
    """TileLang's own output is wanted: ``GDN_CP_NATIVE_WARNINGS=show``, or gdn_cp's log at DEBUG (``gdn-cp -v``)."""
    from ...env import NATIVE_WARNINGS_ENV, read  # here, not at the top: the child runs this file without gdn_cp

    return read(NATIVE_WARNINGS_ENV) == "show" or log.isEnabledFor(logging.DEBUG)


def quiet_tilelang_log() -> bool:
    """TileLang's Python logger (``tilelang``, which its import sets to INFO with a handler of its own that writes to
    stdout) at WARNING: its two INFO lines per kernel compiled ("TileLang begins to compile kernel ...", once per rank:
    64 lines in a cold ``gdn-cp run --backend flashqla --cp 2``, run 2026-12-07s) kept out of the default output; its
    warnings still shown. Call after TileLang's import. False (left alone) where its output is wanted (:func:`_shown`)."""
    if _shown():
        return False
    logger = logging.getLogger("tilelang")
    if logger.getEffectiveLevel() < logging.WARNING:
        logger.setLevel(logging.WARNING)
    return True


def quiet_native_warnings() -> bool:
    """Once per process: TileLang's compile warnings kept out of fd 2 (see the module's docstring). True when
    the filter runs (started now or before); False where it is not wanted (``GDN_CP_NATIVE_WARNINGS=show``,
    gdn_cp's log at DEBUG) or cannot run (not Linux, no fd 2, no child process)."""
    global _FILTER
    if _FILTER is not None:
        return True
    from ...env import NATIVE_WARNINGS_ENV

    if _shown():
        return False
    if not sys.platform.startswith("linux") or not sys.executable:
        return False
    try:
        os.fstat(2)
    except OSError:
        return False
    _FILTER = _start(f"gdn-cp: hid {{n}} TileLang compile warnings of process {os.getpid()} (FlashQLA's kernels; "
                     f"{NATIVE_WARNINGS_ENV}=show, or gdn-cp -v, shows them)")
    if _FILTER is not None:
        log.info("TileLang's compile warnings (C++, on stderr) are hidden while FlashQLA's kernels compile: "
                 "%s=show, or gdn_cp's log at DEBUG (gdn-cp -v), shows them", NATIVE_WARNINGS_ENV)
    return _FILTER is not None


def _start(note: str) -> Optional[subprocess.Popen]:
    """The child started and fd 2 replaced by its pipe; None (fd 2 untouched) when the child does not start."""
    if sys.stderr is not None:
        sys.stderr.flush()
    read_end, write_end = os.pipe()
    real = os.dup(2)  # non-inheritable: only the child gets it, as its fd 2
    try:
        child = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), note], stdin=read_end,
                                 stdout=subprocess.DEVNULL, stderr=real)
    except OSError as err:
        log.debug("TileLang's compile warnings stay on stderr: the filter process did not start (%s)", err)
        os.close(write_end)
        os.close(real)
        return None
    finally:
        os.close(read_end)
    os.dup2(write_end, 2)
    os.close(write_end)
    atexit.register(_restore, real, child, os.getpid())
    return child


def _restore(real: int, child: subprocess.Popen, pid: int) -> None:
    """At a normal exit: fd 2 back to the real stderr (this process's end of the pipe closes), then a short
    wait for the child to write what it holds. A forked process that inherited the handler does nothing."""
    if os.getpid() != pid:
        return
    try:
        if sys.stderr is not None:
            sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os.dup2(real, 2)
    try:
        child.wait(EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
        pass


if __name__ == "__main__":
    _child_main(sys.argv[1] if len(sys.argv) > 1 else "")
