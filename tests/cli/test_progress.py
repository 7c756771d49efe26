"""gdn_cp.cli.progress (the bar of `gdn-cp run` on a terminal, plain lines elsewhere) and the ranks of
gdn_cp.cli.launch talking while they work (events and log records reach the parent as they come)."""

from __future__ import annotations

import io
import logging
import time

import pytest

from gdn_cp.cli.launch import RankError, run_ranks
from gdn_cp.cli.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_no_bar_where_stderr_is_not_a_terminal(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    lines = []
    with Progress(lines.append, delay_s=0.0) as progress:
        progress.start(3, "cp=2 CP=1 reference")
        progress.line("a line")
        progress.step("cp=2 chunkwise")
    assert lines == ["a line"] and err.getvalue() == ""


def test_a_bar_on_a_terminal_after_its_delay_with_the_lines_around_it(monkeypatch):
    """A run quicker than the delay draws nothing; past it the bar is drawn (and redrawn while a step runs),
    names the step running, and every line still goes through echo, the bar cleared around it."""
    term = _Terminal()
    monkeypatch.setattr("sys.stderr", term)
    lines = []
    with Progress(lines.append, delay_s=5.0) as progress:  # quick: no bar
        progress.start(2, "cp=2 CP=1 reference")
        progress.line("first")
        progress.step("cp=2 chunkwise")
    assert lines == ["first"] and "cp=2" not in term.getvalue()
    with Progress(lines.append, delay_s=0.05, unit="step") as progress:
        progress.start(2, "cp=2 CP=1 reference")
        time.sleep(0.3)  # the ticker draws it without a step
        drawn = term.getvalue()
        progress.line("second")
        progress.step("cp=2 chunkwise")
        after = term.getvalue()
    assert "cp=2 CP=1 reference:   0%" in drawn and "0/2" in drawn, drawn
    assert "cp=2 chunkwise:  50%" in after and "1/2" in after, after
    assert lines == ["first", "second"]


def _talk(ctx, n):
    import torch.distributed as dist

    dist.barrier()  # both ranks joined (a rank that returns at once would close the group under the other's join)
    logging.getLogger("gdn_cp.test_talk").debug("debug from %d", ctx.rank)
    logging.getLogger("gdn_cp.test_talk").warning("warning from %d", ctx.rank)
    for i in range(n):
        ctx.emit({"rank": ctx.rank, "i": i})
    if ctx.rank == 1 and n < 0:
        raise RuntimeError("rank 1 fails")
    return ctx.rank * 10


@pytest.mark.slow
def test_ranks_send_events_and_log_records_as_they_work(caplog):
    caplog.set_level(logging.DEBUG, logger="gdn_cp.test_talk")
    events = []
    assert run_ranks(2, _talk, 3, on_event=lambda rank, payload: events.append((rank, payload["i"])),
                     log_level=logging.DEBUG, timeout_s=120) == [0, 10]
    for rank in (0, 1):
        assert [i for r, i in events if r == rank] == [0, 1, 2]
    messages = sorted(r.getMessage() for r in caplog.records if r.name == "gdn_cp.test_talk")
    assert messages == ["rank 0: debug from 0", "rank 0: warning from 0", "rank 1: debug from 1",
                        "rank 1: warning from 1"], messages
    caplog.clear()
    with pytest.raises(RankError, match="rank 1 fails"):  # a failure still ends the run with its traceback
        run_ranks(2, _talk, -1, log_level=logging.WARNING, timeout_s=120)
    assert sorted(r.getMessage() for r in caplog.records if r.name == "gdn_cp.test_talk") == [
        "rank 0: warning from 0", "rank 1: warning from 1"]
