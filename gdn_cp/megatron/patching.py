"""Install, check and revert the pinned Megatron-Core patch (``patches/megatron-core-0.19.2``).

The patch folder holds one unified diff per target file and a ``manifest.json`` with, per
target (a path relative to the folder that contains the ``megatron/`` package), the sha256 of
the pristine and of the patched file. Content hashes are the source of truth:

* ``check_patch`` reports each target as ``pristine`` / ``patched`` / ``modified`` (someone
  else's change or another megatron-core version) / ``missing``.
* ``apply_patch`` verifies that every target is pristine before touching anything, computes
  every patched file in memory (diff applied with exact context, result hash-checked), stages
  them as temporary files next to the targets and only then renames them into place (all files
  or none). The originals are kept as ``<file>.gdn_cp.orig``. Applying an applied patch is a
  no-op that says so.
* ``revert_patch`` restores byte-identical pristine files (from the backup, or by reversing the
  diff; either way hash-checked) and removes the backups. Reverting a pristine tree is a no-op.

No function here prints; they return results and log. Errors are :class:`PatchError` with a
message that says what is wrong and what to do; nothing has been changed when one is raised.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources
import importlib.util
import json
import logging
import os
import re
from pathlib import Path
from typing import Iterable, Mapping, Optional, Union

__all__ = [
    "PINNED_VERSION",
    "PATCH_NAME",
    "PRISTINE",
    "PATCHED",
    "MODIFIED",
    "MISSING",
    "PARTIAL",
    "BACKUP_SUFFIX",
    "PatchError",
    "PatchTarget",
    "PatchResult",
    "patch_dir",
    "load_manifest",
    "find_megatron_root",
    "megatron_version",
    "check_patch",
    "overall_state",
    "apply_patch",
    "revert_patch",
    "apply_unified_diff",
]

_logger = logging.getLogger(__name__)

PINNED_VERSION = "0.19.2"
PATCH_NAME = f"megatron-core-{PINNED_VERSION}"

PRISTINE = "pristine"
PATCHED = "patched"
MODIFIED = "modified"
MISSING = "missing"
PARTIAL = "partial"  # overall state only: some files pristine, the others patched

BACKUP_SUFFIX = ".gdn_cp.orig"
_TMP_SUFFIX = ".gdn_cp.tmp"

PathLike = Union[str, "os.PathLike[str]"]


class PatchError(RuntimeError):
    """The patch cannot be applied / reverted / checked; nothing was changed."""


@dataclasses.dataclass(frozen=True)
class PatchTarget:
    target: str  # relative to the folder containing megatron/, '/'-separated
    patch: str  # file name of the unified diff in the patch folder
    sha256_pristine: str
    sha256_patched: str


@dataclasses.dataclass(frozen=True)
class Manifest:
    megatron_core_version: str
    version_file: str
    files: tuple[PatchTarget, ...]


@dataclasses.dataclass(frozen=True)
class PatchResult:
    """What ``apply_patch`` / ``revert_patch`` did."""

    root: Path
    action: str  # "applied" | "already_patched" | "reverted" | "already_pristine"
    files: dict[str, str]  # target -> state afterwards
    changed: tuple[str, ...]  # targets whose content was rewritten
    message: str


# --------------------------------------------------------------------------------------------
# the vendored patch folder
# --------------------------------------------------------------------------------------------
def patch_dir():
    """The folder (a ``Traversable``) holding the pinned patch and its manifest.

    Installed wheels carry it as the ``gdn_cp._patches`` package data; a source checkout that
    is used without installing falls back to the repository's top-level ``patches/`` folder.
    """
    try:
        base = importlib.resources.files("gdn_cp._patches")
        cand = base / PATCH_NAME
        if cand.is_dir() and (cand / "manifest.json").is_file():
            return cand
    except (ModuleNotFoundError, TypeError):
        pass
    cand = Path(__file__).resolve().parents[2] / "patches" / PATCH_NAME
    if (cand / "manifest.json").is_file():
        return cand
    raise PatchError(
        f"the pinned patch folder {PATCH_NAME}/ is missing from this gdn-cp installation "
        "(looked in the gdn_cp._patches package data and in the source tree's patches/); "
        "reinstall gdn-cp."
    )


def load_manifest() -> Manifest:
    """Read and sanity-check ``manifest.json`` of the pinned patch."""
    d = patch_dir()
    try:
        raw = json.loads((d / "manifest.json").read_text(encoding="utf-8"))
        files = tuple(
            PatchTarget(
                target=f["target"],
                patch=f["patch"],
                sha256_pristine=f["sha256_pristine"],
                sha256_patched=f["sha256_patched"],
            )
            for f in raw["files"]
        )
        manifest = Manifest(
            megatron_core_version=raw["megatron_core_version"],
            version_file=raw.get("version_file", "megatron/core/package_info.py"),
            files=files,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise PatchError(f"corrupt patch manifest in {d}: {e!r}; reinstall gdn-cp.") from e
    if not files:
        raise PatchError(f"patch manifest in {d} lists no files; reinstall gdn-cp.")
    return manifest


def _read_patch_text(t: PatchTarget) -> str:
    return (patch_dir() / t.patch).read_text(encoding="utf-8")


# --------------------------------------------------------------------------------------------
# locating megatron
# --------------------------------------------------------------------------------------------
def _has_megatron_core(root: Path) -> bool:
    return (root / "megatron" / "core").is_dir()


def find_megatron_root(path: Optional[PathLike] = None) -> Path:
    """The folder that contains the ``megatron/`` package (the manifest's paths are relative to it).

    ``path`` may be a Megatron-LM checkout, a site-packages folder holding megatron-core, the
    ``megatron`` package folder itself, or its ``megatron/core`` folder. Without ``path``, the
    ``megatron`` package importable by this Python is used; it is located with
    ``importlib.util.find_spec`` without importing ``megatron.core``.
    """
    if path is not None:
        p = Path(path).expanduser()
        if not p.exists():
            raise PatchError(f"{p} does not exist.")
        p = p.resolve()
        if _has_megatron_core(p):
            return p
        if p.name == "megatron" and (p / "core").is_dir():
            return p.parent
        if p.name == "core" and p.parent.name == "megatron":
            return p.parent.parent
        raise PatchError(
            f"{p} is neither a Megatron-LM checkout, a site-packages folder with megatron-core, "
            "nor the megatron package folder (no megatron/core inside)."
        )
    try:
        spec = importlib.util.find_spec("megatron")
    except (ImportError, ValueError) as e:
        spec = None
        _logger.debug("find_spec('megatron') failed: %r", e)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        if (Path(loc) / "core").is_dir():
            return Path(loc).resolve().parent
    raise PatchError(
        "megatron-core is not importable from this Python "
        f"(python -m pip install megatron-core=={PINNED_VERSION}), or pass PATH: a Megatron-LM "
        "checkout, a site-packages folder or the megatron package folder."
    )


_VERSION_RE = {
    k: re.compile(rf"^{k}\s*=\s*(\S+)", re.MULTILINE) for k in ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE")
}


def megatron_version(root: PathLike) -> Optional[str]:
    """megatron-core's version read from ``megatron/core/package_info.py`` (not imported), or None."""
    f = Path(root) / "megatron" / "core" / "package_info.py"
    try:
        text = f.read_text(encoding="utf-8")
    except OSError:
        return None
    parts = {}
    for k, rx in _VERSION_RE.items():
        m = rx.search(text)
        if m is None:
            return None
        parts[k] = m.group(1).strip().strip("'\"")
    return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}{parts['PRE_RELEASE']}"


# --------------------------------------------------------------------------------------------
# unified diffs
# --------------------------------------------------------------------------------------------
_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _split_lines(text: str) -> list[str]:
    """Split on '\\n' only (str.splitlines would also split on \\f, \\x1c, ...), keeping ends."""
    parts = text.split("\n")
    lines = [p + "\n" for p in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


def _parse_hunks(diff_text: str) -> list[tuple[int, list[str], int, list[str]]]:
    lines = _split_lines(diff_text)
    i = 0
    while i < len(lines) and not lines[i].startswith("--- "):
        i += 1
    if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
        raise PatchError("malformed unified diff: no '--- '/'+++ ' header.")
    i += 2
    hunks = []
    while i < len(lines):
        m = _HUNK_RE.match(lines[i])
        if m is None:
            if lines[i].strip() == "":
                i += 1
                continue
            raise PatchError(f"malformed unified diff: unexpected line {lines[i]!r}.")
        old_start, old_len = int(m.group(1)), int(m.group(2) or "1")
        new_start, new_len = int(m.group(3)), int(m.group(4) or "1")
        i += 1
        old: list[str] = []
        new: list[str] = []
        last: Optional[str] = None
        while i < len(lines) and (len(old) < old_len or len(new) < new_len or lines[i].startswith("\\")):
            line = lines[i]
            tag, body = line[:1], line[1:]
            if tag == "\\":  # "\ No newline at end of file": strip the previous line's '\n'
                if last in (" ", "-") and old:
                    old[-1] = old[-1].rstrip("\n")
                if last in (" ", "+") and new:
                    new[-1] = new[-1].rstrip("\n")
            elif tag == " " or line == "\n":
                body = body if tag == " " else "\n"
                old.append(body)
                new.append(body)
            elif tag == "-":
                old.append(body)
            elif tag == "+":
                new.append(body)
            else:
                raise PatchError(f"malformed unified diff: unexpected hunk line {line!r}.")
            if tag != "\\":
                last = tag if tag in " -+" else " "
            i += 1
        if len(old) != old_len or len(new) != new_len:
            raise PatchError("malformed unified diff: hunk lengths do not match its header.")
        hunks.append((old_start, old, new_start, new))
    if not hunks:
        raise PatchError("malformed unified diff: no hunks.")
    return hunks


def apply_unified_diff(text: str, diff_text: str, *, reverse: bool = False, name: str = "") -> str:
    """Apply a single-file unified diff to ``text`` with exact context (no fuzz, no offset).

    ``reverse=True`` undoes it. Raises :class:`PatchError` if any hunk does not match exactly.
    """
    lines = _split_lines(text)
    shift = 0
    for old_start, old, new_start, new in _parse_hunks(diff_text):
        if reverse:
            old_start, old, new_start, new = new_start, new, old_start, old
        pos = (old_start - 1 if old else old_start) + shift
        if lines[pos : pos + len(old)] != old:
            raise PatchError(
                f"{name or 'file'}: the diff's context does not match at line {old_start} "
                "(unexpected file content)."
            )
        lines[pos : pos + len(old)] = new
        shift += len(new) - len(old)
    return "".join(lines)


# --------------------------------------------------------------------------------------------
# state
# --------------------------------------------------------------------------------------------
def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _target_path(root: Path, t: PatchTarget) -> Path:
    return root.joinpath(*t.target.split("/"))


def _file_state(path: Path, t: PatchTarget) -> str:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return MISSING
    h = _sha256(data)
    if h == t.sha256_pristine:
        return PRISTINE
    if h == t.sha256_patched:
        return PATCHED
    return MODIFIED


def _root(root: Optional[PathLike]) -> Path:
    return find_megatron_root(root)


def check_patch(root: Optional[PathLike] = None) -> dict[str, str]:
    """State of each target file: ``pristine`` | ``patched`` | ``modified`` | ``missing``.

    ``root``: anything :func:`find_megatron_root` accepts (default: the importable megatron).
    """
    r = _root(root)
    return {t.target: _file_state(_target_path(r, t), t) for t in load_manifest().files}


def overall_state(states: Mapping[str, str]) -> str:
    """One word for a ``check_patch`` result: pristine, patched, partial, modified or missing."""
    values = set(states.values())
    if values == {PRISTINE}:
        return PRISTINE
    if values == {PATCHED}:
        return PATCHED
    if MISSING in values:
        return MISSING
    if MODIFIED in values:
        return MODIFIED
    return PARTIAL


def _version_note(root: Path, manifest: Manifest) -> str:
    v = megatron_version(root)
    if v is None:
        return (
            f" Could not read megatron-core's version from {manifest.version_file}; this patch "
            f"is pinned to megatron-core {manifest.megatron_core_version}."
        )
    if v != manifest.megatron_core_version:
        return (
            f" This is megatron-core {v}, but the patch is pinned to megatron-core "
            f"{manifest.megatron_core_version}: install megatron-core=="
            f"{manifest.megatron_core_version} (or use a gdn-cp release made for {v})."
        )
    return ""


def _foreign_error(root: Path, states: Mapping[str, str], manifest: Manifest, verb: str) -> PatchError:
    bad = [f"{t} is {s}" for t, s in states.items() if s in (MODIFIED, MISSING)]
    note = _version_note(root, manifest)
    if not note:
        note = (
            f" The files differ from both the pristine megatron-core "
            f"{manifest.megatron_core_version} and the patched ones (someone else changed them): "
            f"restore the originals (reinstall megatron-core=={manifest.megatron_core_version}, "
            "or `git checkout` them in a Megatron-LM checkout) and try again."
        )
    return PatchError(f"cannot {verb} the patch in {root}: " + "; ".join(bad) + "." + note + " Nothing was changed.")


# --------------------------------------------------------------------------------------------
# atomic multi-file write
# --------------------------------------------------------------------------------------------
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


def _remove_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as e:  # pragma: no cover - best effort cleanup
        _logger.warning("could not remove %s: %s", path, e)


def _atomic_replace_all(
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
            _remove_quietly(tmp)
        for p in written_extra:
            _remove_quietly(p)
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
            _remove_quietly(tmp)
        for p in written_extra:
            _remove_quietly(p)
        if rollback_errors:  # pragma: no cover
            raise PatchError(
                f"renaming into place failed ({e}) and restoring failed too: "
                + "; ".join(rollback_errors)
                + ". Reinstall megatron-core to recover."
            ) from e
        raise PatchError(f"renaming into place failed ({e}); the originals were restored.") from e


# --------------------------------------------------------------------------------------------
# apply / revert
# --------------------------------------------------------------------------------------------
def apply_patch(root: Optional[PathLike] = None) -> PatchResult:
    """Apply the pinned patch to the megatron-core at ``root`` (default: the importable one).

    Every target must be pristine (hash-checked) before anything is written; all files are
    replaced or none. Already patched: a no-op (``action == "already_patched"``).
    """
    r = _root(root)
    manifest = load_manifest()
    states = {t.target: _file_state(_target_path(r, t), t) for t in manifest.files}
    overall = overall_state(states)
    if overall == PATCHED:
        msg = f"megatron-core at {r} is already patched; nothing to do."
        _logger.info(msg)
        return PatchResult(r, "already_patched", dict(states), (), msg)
    if overall in (MODIFIED, MISSING):
        raise _foreign_error(r, states, manifest, "apply")
    if overall == PARTIAL:
        patched = [t for t, s in states.items() if s == PATCHED]
        raise PatchError(
            f"megatron-core at {r} is partially patched ({', '.join(patched)} patched, the rest "
            "pristine). Run `gdn-cp patch revert` to restore the originals, then "
            "`gdn-cp patch apply`. Nothing was changed."
        )

    contents: dict[Path, bytes] = {}
    originals: dict[Path, bytes] = {}
    backups: dict[Path, bytes] = {}
    for t in manifest.files:
        path = _target_path(r, t)
        original = path.read_bytes()
        if _sha256(original) != t.sha256_pristine:  # changed since we looked
            raise PatchError(f"{path} changed while patching; nothing was changed, try again.")
        new_text = apply_unified_diff(original.decode("utf-8"), _read_patch_text(t), name=t.target)
        new = new_text.encode("utf-8")
        if _sha256(new) != t.sha256_patched:
            raise PatchError(
                f"the vendored diff for {t.target} does not produce the expected file "
                "(corrupt gdn-cp installation); reinstall gdn-cp. Nothing was changed."
            )
        contents[path] = new
        originals[path] = original
        backups[path.with_name(path.name + BACKUP_SUFFIX)] = original

    _atomic_replace_all(contents, originals, extra_files=backups)
    files = check_patch(r)
    if overall_state(files) != PATCHED:  # pragma: no cover - would mean a concurrent writer
        raise PatchError(f"after applying, the files are {files}; run `gdn-cp patch check`.")
    msg = (
        f"patched megatron-core {manifest.megatron_core_version} at {r} "
        f"({len(contents)} files; originals kept as *{BACKUP_SUFFIX})."
    )
    _logger.info(msg)
    return PatchResult(r, "applied", files, tuple(t.target for t in manifest.files), msg)


def revert_patch(root: Optional[PathLike] = None) -> PatchResult:
    """Restore the byte-identical pristine files at ``root`` (default: the importable megatron).

    Works from a fully or partially patched tree; a pristine tree is a no-op
    (``action == "already_pristine"``). Foreign modifications: :class:`PatchError`, nothing changed.
    """
    r = _root(root)
    manifest = load_manifest()
    states = {t.target: _file_state(_target_path(r, t), t) for t in manifest.files}
    overall = overall_state(states)
    if overall in (MODIFIED, MISSING):
        raise _foreign_error(r, states, manifest, "revert")

    contents: dict[Path, bytes] = {}
    originals: dict[Path, bytes] = {}
    for t in manifest.files:
        if states[t.target] != PATCHED:
            continue
        path = _target_path(r, t)
        current = path.read_bytes()
        backup = path.with_name(path.name + BACKUP_SUFFIX)
        restored: Optional[bytes] = None
        try:
            b = backup.read_bytes()
            if _sha256(b) == t.sha256_pristine:
                restored = b
            else:
                _logger.warning("ignoring %s: not the pristine file", backup)
        except FileNotFoundError:
            pass
        if restored is None:
            text = apply_unified_diff(
                current.decode("utf-8"), _read_patch_text(t), reverse=True, name=t.target
            )
            restored = text.encode("utf-8")
            if _sha256(restored) != t.sha256_pristine:
                raise PatchError(
                    f"reversing the diff of {t.target} does not give the pristine file "
                    "(corrupt gdn-cp installation); reinstall megatron-core "
                    f"{manifest.megatron_core_version}. Nothing was changed."
                )
        contents[path] = restored
        originals[path] = current

    if contents:
        _atomic_replace_all(contents, originals)
    for t in manifest.files:  # backups are no longer needed once every file is pristine
        path = _target_path(r, t)
        backup = path.with_name(path.name + BACKUP_SUFFIX)
        if backup.exists():
            _remove_quietly(backup)
    files = check_patch(r)
    if not contents:
        msg = f"megatron-core at {r} is not patched; nothing to do."
        _logger.info(msg)
        return PatchResult(r, "already_pristine", files, (), msg)
    changed = tuple(t.target for t in manifest.files if _target_path(r, t) in contents)
    msg = f"restored the pristine megatron-core {manifest.megatron_core_version} files at {r}."
    _logger.info(msg)
    return PatchResult(r, "reverted", files, changed, msg)
