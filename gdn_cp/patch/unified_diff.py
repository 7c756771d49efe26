"""Single-file unified diffs: apply one exactly (no fuzz, no offset, reversible) and make one.

The patch tool (:mod:`gdn_cp.patch`) ships its Megatron changes as ordinary unified
diffs (``patch -p1`` applies them too) and applies them itself, so that nothing outside Python is
needed and every hunk must match exactly. Lines are split on ``\\n`` only: Python's
``str.splitlines`` would also split on form feeds and other separators that source files contain.
Pure Python; no file access.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

__all__ = ["DiffError", "Hunk", "split_lines", "parse_unified_diff", "apply_unified_diff", "make_unified_diff"]

_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_NO_NEWLINE = "\\ No newline at end of file\n"


class DiffError(ValueError):
    """The diff is malformed, or its context does not match the text it is applied to."""


@dataclass(frozen=True)
class Hunk:
    """One hunk: ``old`` lines at 1-based ``old_start`` become ``new`` lines (each keeps its ``\\n``)."""

    old_start: int
    old: tuple[str, ...]
    new_start: int
    new: tuple[str, ...]


def split_lines(text: str) -> list[str]:
    """Split on ``\\n`` only, keeping the line ends (the last line may lack one)."""
    parts = text.split("\n")
    lines = [p + "\n" for p in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


def parse_unified_diff(diff_text: str) -> list[Hunk]:
    """The hunks of a single-file unified diff. Text before the ``---``/``+++`` header is ignored."""
    lines = split_lines(diff_text)
    i = 0
    while i < len(lines) and not lines[i].startswith("--- "):
        i += 1
    if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
        raise DiffError("malformed unified diff: no '--- '/'+++ ' header.")
    i += 2
    hunks = []
    while i < len(lines):
        m = _HUNK_RE.match(lines[i])
        if m is None:
            if lines[i].strip() == "":
                i += 1
                continue
            raise DiffError(f"malformed unified diff: unexpected line {lines[i]!r}.")
        old_start, old_len = int(m.group(1)), int(m.group(2) or "1")
        new_start, new_len = int(m.group(3)), int(m.group(4) or "1")
        i += 1
        old: list[str] = []
        new: list[str] = []
        last = None
        while i < len(lines) and (len(old) < old_len or len(new) < new_len or lines[i].startswith("\\")):
            line = lines[i]
            tag, body = line[:1], line[1:]
            if tag == "\\":  # "\ No newline at end of file": the previous line has no '\n'
                if last in (" ", "-") and old:
                    old[-1] = old[-1].rstrip("\n")
                if last in (" ", "+") and new:
                    new[-1] = new[-1].rstrip("\n")
            elif tag == " " or line == "\n":  # some tools drop the space of an empty context line
                body = body if tag == " " else "\n"
                old.append(body)
                new.append(body)
            elif tag == "-":
                old.append(body)
            elif tag == "+":
                new.append(body)
            else:
                raise DiffError(f"malformed unified diff: unexpected hunk line {line!r}.")
            if tag != "\\":
                last = tag if tag in " -+" else " "
            i += 1
        if len(old) != old_len or len(new) != new_len:
            raise DiffError(
                f"malformed unified diff: hunk at -{old_start},{old_len} has {len(old)} old and "
                f"{len(new)} new lines, its header says {old_len} and {new_len}."
            )
        hunks.append(Hunk(old_start, tuple(old), new_start, tuple(new)))
    if not hunks:
        raise DiffError("malformed unified diff: no hunks.")
    return hunks


def apply_unified_diff(text: str, diff_text: str, *, reverse: bool = False, name: str = "") -> str:
    """Apply a single-file unified diff to ``text`` with exact context (no fuzz, no offset).

    ``reverse=True`` undoes it. Raises :class:`DiffError` if any hunk does not match exactly.
    """
    lines = split_lines(text)
    shift = 0
    for h in parse_unified_diff(diff_text):
        old_start, old, new = (h.new_start, h.new, h.old) if reverse else (h.old_start, h.old, h.new)
        pos = (old_start - 1 if old else old_start) + shift
        if pos < 0 or tuple(lines[pos : pos + len(old)]) != old:
            raise DiffError(
                f"{name or 'file'}: the diff's context does not match at line {old_start} (unexpected file content)."
            )
        lines[pos : pos + len(old)] = new
        shift += len(new) - len(old)
    return "".join(lines)


def make_unified_diff(old: str, new: str, path: str, *, context: int = 3) -> str:
    """A ``--- a/path`` / ``+++ b/path`` unified diff turning ``old`` into ``new``.

    What :func:`apply_unified_diff` and ``patch -p1`` apply; a missing final newline is marked
    the standard way. Empty when the texts are equal.
    """
    out = []
    for line in difflib.unified_diff(
        split_lines(old), split_lines(new), f"a/{path}", f"b/{path}", n=context, lineterm="\n"
    ):
        if line.startswith(("---", "+++")):
            line = line.rstrip("\n") + "\n"  # difflib adds no date: "--- a/path\n"
        out.append(line if line.endswith("\n") else line + "\n" + _NO_NEWLINE)
    return "".join(out)
