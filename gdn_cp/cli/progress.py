"""A command's progress while it works: its report lines as they come, and on a terminal a bar.

:class:`Progress` prints every line at once through ``echo`` (stdout). Where stderr is a terminal it
also keeps a tqdm bar there (``steps`` done of the total, the step now running, the time spent and
left), shown only once the work has taken ``delay_s`` (a quick run stays as plain as before) and
redrawn every second from then on (its clock runs while a long step works); lines and log records
are written around the bar, never through it. Elsewhere (a pipe, a file, CI) there
is no bar: the lines alone say how far the work got. tqdm is a dependency of gdn-cp for this: one
pure-Python package without dependencies of its own, kept up for a decade.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Callable, Optional

__all__ = ["Progress"]

BAR_DELAY_S = 3.0
"""A run quicker than this shows no bar (tqdm's ``delay``)."""


class Progress(contextlib.AbstractContextManager):
    """``with Progress(echo, bar=...) as progress``: ``progress.line(text)`` prints a line,
    ``progress.start(total)`` sets the number of steps, ``progress.step(now)`` counts one done and
    names the next. ``bar=None``: a bar when stderr is a terminal."""

    def __init__(self, echo: Callable[[str], None] = print, *, bar: Optional[bool] = None, unit: str = "step",
                 delay_s: float = BAR_DELAY_S):
        self._echo = echo
        self._want_bar = _is_terminal(sys.stderr) if bar is None else bar
        self._unit = unit
        self._delay_s = delay_s
        self._bar = None
        self._redirect = None
        self._started = 0.0
        self._stop = threading.Event()
        self._ticker: Optional[threading.Thread] = None

    def __enter__(self) -> "Progress":
        if self._want_bar:
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._redirect = logging_redirect_tqdm()  # log records (the ranks' too) printed around the bar
            self._redirect.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        if self._redirect is not None:
            self._redirect.__exit__(*exc)
            self._redirect = None

    def start(self, total: int, description: str = "") -> None:
        """The bar, ``total`` steps long (nothing where there is no bar)."""
        if self._want_bar and self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=description, unit=self._unit, file=sys.stderr, delay=self._delay_s,
                             leave=False, dynamic_ncols=True)
            self._started = time.monotonic()
            self._ticker = threading.Thread(target=self._tick, name="gdn-cp-progress", daemon=True)
            self._ticker.start()

    def _shown(self) -> bool:
        return self._bar is not None and time.monotonic() - self._started >= self._delay_s

    def _tick(self) -> None:
        """Draw the bar once ``delay_s`` has passed, then once a second (tqdm draws only when counted)."""
        if self._stop.wait(self._delay_s):
            return
        while True:
            bar = self._bar
            if bar is None:
                return
            bar.refresh()
            if self._stop.wait(1.0):
                return

    def line(self, text: str) -> None:
        """``text`` through ``echo``; once the bar shows, it is cleared first and drawn again after."""
        if not self._shown():
            self._echo(text)
            return
        with self._bar.external_write_mode():
            self._echo(text)

    def step(self, now: str = "") -> None:
        """One step done; ``now`` names what runs next (the bar's description)."""
        if self._bar is not None:
            if now:
                self._bar.set_description_str(now, refresh=False)
            self._bar.update(1)

    def describe(self, now: str) -> None:
        """Name what runs now, without counting a step."""
        if self._bar is not None:
            self._bar.set_description_str(now, refresh=self._shown())

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False
