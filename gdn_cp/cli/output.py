"""What every ``gdn-cp`` command shares when it talks: the exit-status rule, the error line, counts.

The rule is written once, here (:data:`EXIT_STATUS`); ``gdn-cp --help`` prints it, each command's
``--help`` says what "found something wrong" means for that command, and docs/errors.md "Exit status"
quotes it (``tests/cli/test_cli.py`` checks that the three agree and that every command keeps it).
"""

from __future__ import annotations

import sys
import textwrap
from typing import Optional

__all__ = ["EXIT_FOUND_PROBLEM", "EXIT_OK", "EXIT_STATUS", "EXIT_USAGE", "CommandError", "count", "exit_epilog",
           "print_error", "print_warning"]

EXIT_OK, EXIT_FOUND_PROBLEM, EXIT_USAGE = 0, 1, 2
EXIT_STATUS = (
    "Exit status of every gdn-cp command: 0 done, nothing wrong found; 1 the command ran and found "
    "something wrong (what, each command's --help says); 2 nothing was done: a bad flag or argument, "
    "a bad GDN_CP_* environment variable, or a path, device or package this machine does not have "
    "(one line on stderr, nothing on stdout). Output cut short by its reader (| head) ends quietly."
)


def exit_epilog(found_problem: str) -> str:
    """The line each command's ``--help`` ends with: the rule, and what 1 means for it (wrapped,
    for the parsers that print their epilog as written)."""
    return textwrap.fill(f"Exit status: 0 / 1 / 2 as for every gdn-cp command (gdn-cp --help); 1 here: "
                         f"{found_problem}.", width=100)


class CommandError(Exception):
    """A command stops: ``str(self)`` is the one-line reason, ``status`` the exit status (default 2:
    nothing was done)."""

    def __init__(self, message: str, status: int = EXIT_USAGE):
        super().__init__(message)
        self.status = status


def print_error(prog: str, message: str) -> None:
    """``<prog>: error: <message>`` on stderr: argparse's own form, so every error of every
    command reads alike."""
    print(f"{prog}: error: {message}", file=sys.stderr)


def print_warning(prog: str, message: str) -> None:
    """``<prog>: warning: <message>`` on stderr: something the command goes on despite."""
    print(f"{prog}: warning: {message}", file=sys.stderr, flush=True)


def count(n: int, noun: str, plural: Optional[str] = None) -> str:
    """``1 sequence``, ``2 sequences``, ``0 sequences`` (``plural`` for irregular nouns)."""
    return f"{n} {noun if n == 1 else (plural or noun + 's')}"
