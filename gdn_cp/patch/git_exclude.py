"""Git checkouts: keep the patch's backups out of ``git status`` through ``info/exclude``.

Only the repository's ``info/exclude`` is touched (never a tracked ``.gitignore``), and only for a
source checkout (:func:`gdn_cp.patch.tree.is_checkout`); git itself is never run.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Optional

from .tree import BACKUP_SUFFIX, PathLike, find_git, is_checkout

__all__ = ["git_exclude_file", "add_git_exclude", "remove_git_exclude"]

_logger = logging.getLogger(__name__)

_EXCLUDE_LINES = ("# gdn-cp patch backups (`gdn-cp patch revert` removes these two lines)\n", f"*{BACKUP_SUFFIX}\n")


def git_exclude_file(root: PathLike) -> Optional[Path]:
    """``info/exclude`` of the git repository whose work tree holds ``root``, or None.

    Handles a plain ``.git`` folder and the ``.git`` file of a worktree or submodule
    (``gitdir: ...``, with ``commondir`` for worktrees), without running git.
    """
    dot_git = find_git(Path(root))
    if dot_git is None:
        return None
    git_dir = dot_git
    if dot_git.is_file():
        m = re.match(r"gitdir:\s*(.+)", dot_git.read_text(encoding="utf-8").strip())
        if m is None:
            return None
        git_dir = (dot_git.parent / m.group(1).strip()).resolve()
        common = git_dir / "commondir"
        if common.is_file():
            git_dir = (git_dir / common.read_text(encoding="utf-8").strip()).resolve()
    return git_dir / "info" / "exclude" if git_dir.is_dir() else None


def add_git_exclude(root: Path) -> Optional[Path]:
    """Add the backup pattern to the repository's ``info/exclude`` (once), for a checkout only.
    Returns the file."""
    exclude = git_exclude_file(root) if is_checkout(root) else None
    if exclude is None:
        return None
    try:
        text = exclude.read_text(encoding="utf-8") if exclude.exists() else ""
        if _EXCLUDE_LINES[1] in _lines(text):
            return exclude
        exclude.parent.mkdir(parents=True, exist_ok=True)
        sep = "" if text == "" or text.endswith("\n") else "\n"
        exclude.write_text(text + sep + "".join(_EXCLUDE_LINES), encoding="utf-8")
    except OSError as e:
        _logger.warning("could not add %s to %s (git status will list the backups): %s", _EXCLUDE_LINES[1].strip(), exclude, e)
        return None
    return exclude


def remove_git_exclude(root: Path) -> None:
    """Remove the two lines :func:`add_git_exclude` added, leaving the rest of the file as it was."""
    exclude = git_exclude_file(root)
    if exclude is None or not exclude.exists():
        return
    try:
        text = exclude.read_text(encoding="utf-8")
        block = "".join(_EXCLUDE_LINES)
        if block in text:
            exclude.write_text(text.replace(block, "", 1), encoding="utf-8")
    except OSError as e:
        _logger.warning("could not remove the gdn-cp lines from %s: %s", exclude, e)


def _lines(text: str) -> list[str]:
    """Lines of ``text`` with their ends (a last line without one gets ``\\n``)."""
    return [line if line.endswith("\n") else line + "\n" for line in text.splitlines(keepends=True)]
