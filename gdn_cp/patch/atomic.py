"""Write several files all or none: stage each next to its target, then rename into place, and put
the originals back if a rename fails."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterable, Mapping, Optional

from ..pins import PatchError

__all__ = ["atomic_replace_all", "remove_quietly"]

_logger = logging.getLogger(__name__)

_TMP_SUFFIX = ".gdn_cp.tmp"

def _check_writable(paths: Iterable[Path]) -> None:
    dirs = sorted({p.parent for p in paths})
    bad = [str(d) for d in dirs if not os.access(d, os.W_OK)]
    if bad:
        raise PatchError(
            "not writable: " + ", ".join(bad) + ". Run with permission to write there (e.g. the "
            "user that installed megatron-core, or sudo), or install megatron-core into a virtual "
            "environment you own. Nothing was changed."
        )


def _write_file(path: Path, data: bytes, mode: Optional[int]) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if mode is not None:
        os.chmod(path, mode)


def remove_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as e:  # pragma: no cover - best effort cleanup
        _logger.warning("could not remove %s: %s", path, e)


def atomic_replace_all(
    contents: Mapping[Path, bytes],
    originals: Mapping[Path, bytes],
    extra_files: Optional[Mapping[Path, bytes]] = None,
) -> None:
    """Write every ``contents`` file or none of them.

    Stage all new contents (and ``extra_files``, e.g. backups) first; if staging fails, remove
    what was staged. Then rename the staged files onto their targets; if a rename fails, put the
    ``originals`` back for the targets already replaced.
    """
    _check_writable(list(contents) + list(extra_files or {}))
    staged: list[tuple[Path, Path]] = []
    written_extra: list[Path] = []
    try:
        for path, data in contents.items():
            tmp = path.with_name(path.name + _TMP_SUFFIX)
            mode = path.stat().st_mode & 0o7777 if path.exists() else None
            staged.append((tmp, path))
            _write_file(tmp, data, mode)
        for path, data in (extra_files or {}).items():
            written_extra.append(path)
            _write_file(path, data, None)
    except OSError as e:
        for tmp, _ in staged:
            remove_quietly(tmp)
        for p in written_extra:
            remove_quietly(p)
        raise PatchError(
            f"could not write next to the targets ({e}). Run with permission to write there (e.g. "
            "the user that installed megatron-core, or sudo), or install megatron-core into a "
            "virtual environment you own. Nothing was changed."
        ) from e

    done: list[Path] = []
    try:
        for tmp, path in staged:
            os.replace(tmp, path)
            done.append(path)
    except OSError as e:
        rollback_errors = []
        for path in done:
            try:
                tmp = path.with_name(path.name + _TMP_SUFFIX)
                _write_file(tmp, originals[path], path.stat().st_mode & 0o7777)
                os.replace(tmp, path)
            except OSError as e2:  # pragma: no cover - disk gone mid-operation
                rollback_errors.append(f"{path}: {e2}")
        for tmp, _ in staged:
            remove_quietly(tmp)
        for p in written_extra:
            remove_quietly(p)
        if rollback_errors:  # pragma: no cover
            raise PatchError(
                f"renaming into place failed ({e}) and restoring failed too: "
                + "; ".join(rollback_errors)
                + ". Reinstall megatron-core to recover."
            ) from e
        raise PatchError(f"renaming into place failed ({e}); the originals were restored. Check the disk (free space, "
                         "permissions) and run the command again.") from e
