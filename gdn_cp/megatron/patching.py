"""Install, check and revert a pinned Megatron-Core patch (``patches/megatron-core-<version>/``).

Each supported release (a pin, see :mod:`gdn_cp.megatron.pins`) has a patch folder holding one
unified diff per target file and a ``manifest.json`` with, per target (a path relative to the
folder that contains the ``megatron/`` package), the sha256 of the pristine and of the patched
file. Content hashes are the source of truth, never version strings: a Megatron-LM checkout
reports its own version in ``megatron/core/package_info.py`` (e.g. ``0.19.1``) while its target
files can be byte-identical to a release's. The pin of a tree is the one whose hashes its files
match (:func:`detect_pin`); messages name the version the tree reports and the pin it matched.

* ``check_patch`` reports each target as ``pristine`` / ``patched`` / ``modified`` (someone
  else's change or another megatron-core version) / ``missing``.
* ``apply_patch`` verifies that every target is pristine before touching anything, computes
  every patched file in memory (diff applied with exact context, result hash-checked), stages
  them as temporary files next to the targets and only then renames them into place (all files
  or none). The originals are kept as ``<file>.gdn_cp.orig``; in a git checkout that pattern is
  added to ``.git/info/exclude`` (never to a tracked ``.gitignore``), so ``git status`` lists only
  the patched files. Applying an applied patch is a no-op that says so.
* ``revert_patch`` restores byte-identical pristine files (from the backup, or by reversing the
  diff; either way hash-checked), removes the backups and the exclude lines it added. Reverting
  a pristine tree is a no-op. (``pip uninstall megatron-core`` does not know the backups: it
  leaves them, and their folders, behind; revert before uninstalling.)

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
import sys
from pathlib import Path
from typing import Iterable, Mapping, Optional, Union

from .pins import PINNED_VERSION, PINS, Pin, get_pin
from .unified_diff import DiffError, apply_unified_diff, make_unified_diff

__all__ = [
    "PINNED_VERSION",
    "PATCH_NAME",
    "PRISTINE",
    "PATCHED",
    "MODIFIED",
    "MISSING",
    "PARTIAL",
    "describe_state",
    "BACKUP_SUFFIX",
    "PatchError",
    "MegatronNotFound",
    "PatchTarget",
    "PatchResult",
    "patch_dir",
    "load_manifest",
    "find_megatron_root",
    "megatron_version",
    "detect_pin",
    "describe_tree",
    "file_matches_pin",
    "pin_of_layer_class",
    "check_patch",
    "overall_state",
    "apply_patch",
    "revert_patch",
    "git_exclude_file",
    "build_patch_files",
]

_logger = logging.getLogger(__name__)

PATCH_NAME = get_pin().patch_folder  # the default pin's folder, e.g. "megatron-core-0.19.2"

PRISTINE = "pristine"
PATCHED = "patched"
MODIFIED = "modified"
MISSING = "missing"
PARTIAL = "partial"  # overall state only: some files pristine, the others patched

BACKUP_SUFFIX = ".gdn_cp.orig"
_TMP_SUFFIX = ".gdn_cp.tmp"
_EXCLUDE_LINES = ("# gdn-cp patch backups (`gdn-cp patch revert` removes these two lines)\n", f"*{BACKUP_SUFFIX}\n")

PathLike = Union[str, "os.PathLike[str]"]


class PatchError(RuntimeError):
    """The patch cannot be applied / reverted / checked; nothing was changed."""


class MegatronNotFound(PatchError):
    """No megatron-core where the caller pointed (or none importable): nothing was looked at."""


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
# the vendored patch folders
# --------------------------------------------------------------------------------------------
def _source_patches() -> Path:
    return Path(__file__).resolve().parents[2] / "patches"


def patch_dir(pin: Optional[str] = None):
    """The folder (a ``Traversable``) holding a pin's patch and manifest (default pin: the table's).

    Installed wheels carry it as the ``gdn_cp._patches`` package data; a source checkout that
    is used without installing falls back to the repository's top-level ``patches/`` folder.
    """
    name = get_pin(pin).patch_folder
    try:
        base = importlib.resources.files("gdn_cp._patches")
        cand = base / name
        if cand.is_dir() and (cand / "manifest.json").is_file():
            return cand
    except (ModuleNotFoundError, TypeError):
        pass
    cand = _source_patches() / name
    if (cand / "manifest.json").is_file():
        return cand
    raise PatchError(
        f"the patch folder {name}/ is missing from this gdn-cp installation "
        "(looked in the gdn_cp._patches package data and in the source tree's patches/); "
        "reinstall gdn-cp."
    )


def load_manifest(pin: Optional[str] = None) -> Manifest:
    """Read and sanity-check ``manifest.json`` of a pin's patch (default: the table's pin)."""
    d = patch_dir(pin)
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
    if manifest.megatron_core_version != get_pin(pin).version:
        raise PatchError(
            f"patch manifest in {d} is for megatron-core {manifest.megatron_core_version}, the pin table "
            f"says {get_pin(pin).version}; reinstall gdn-cp."
        )
    return manifest


def _read_patch_text(t: PatchTarget, pin: str) -> str:
    return (patch_dir(pin) / t.patch).read_text(encoding="utf-8")


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
            raise MegatronNotFound(f"{p} does not exist.")
        p = p.resolve()
        if _has_megatron_core(p):
            return p
        if p.name == "megatron" and (p / "core").is_dir():
            return p.parent
        if p.name == "core" and p.parent.name == "megatron":
            return p.parent.parent
        raise MegatronNotFound(
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
    raise MegatronNotFound(
        "megatron-core is not importable from this Python "
        f"(install it: {get_pin().install_command()}), or pass PATH: a Megatron-LM "
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


def _states(root: Path, manifest: Manifest) -> dict[str, str]:
    return {t.target: _file_state(_target_path(root, t), t) for t in manifest.files}


def detect_pin(root: Optional[PathLike] = None) -> Optional[Pin]:
    """The pin whose release files ``root`` holds (each target pristine or patched), or None.

    Goes by sha256 only, so a Megatron-LM checkout matches the release it shares files with
    whatever version string its ``package_info.py`` reports.
    """
    r = find_megatron_root(root)
    for pin in PINS.values():
        if set(_states(r, load_manifest(pin.version)).values()) <= {PRISTINE, PATCHED}:
            return pin
    return None


def file_matches_pin(path: PathLike, pin: Pin, *, patched: bool) -> bool:
    """Whether the file at ``path`` is one of ``pin``'s targets, pristine or (``patched``) patched."""
    p = Path(path)
    for t in load_manifest(pin.version).files:
        if p.as_posix().endswith("/" + t.target):
            try:
                return _file_state(p, t) == (PATCHED if patched else PRISTINE)
            except OSError:  # unreadable: not a match
                return False
    return False


def pin_of_layer_class(layer_cls: type) -> Pin:
    """The pin whose patched ``gdn.py`` defines ``layer_cls`` (Megatron's ``GatedDeltaNet``).

    With one pin in the table that pin is the answer. With several, the class's source file is
    matched by sha256 against each pin's manifest (the patched file), so a Megatron-LM checkout
    whose ``package_info.py`` reports another version string still gets the right adapter.
    """
    if len(PINS) == 1:
        return next(iter(PINS.values()))
    source = getattr(sys.modules.get(layer_cls.__module__), "__file__", None)
    for pin in PINS.values():
        if source is not None and file_matches_pin(source, pin, patched=True):
            return pin
    raise ValueError(
        f"{layer_cls.__module__}.{layer_cls.__qualname__} (from {source}) is not the patched file of any "
        f"megatron-core release this gdn-cp supports ({', '.join(PINS)}); run `gdn-cp patch check`"
    )


def _resolve_pin(root: Path, pin: Optional[str]) -> tuple[str, Manifest]:
    """The pin to act with: the one asked for, else the one the tree matches, else the default."""
    if pin is None:
        found = detect_pin(root)
        pin = found.version if found is not None else PINNED_VERSION
    try:
        return pin, load_manifest(pin)
    except ValueError as e:  # get_pin: unsupported version
        raise PatchError(str(e)) from None


_STATE_TEXT = {
    PRISTINE: "its target files (by sha256) are the megatron-core {pin} release's, not patched",
    PATCHED: "its target files (by sha256) are the megatron-core {pin} release's with the gdn-cp patch",
    PARTIAL: "its target files (by sha256) are the megatron-core {pin} release's, partially patched (some "
    "patched, the others not): run `gdn-cp patch revert`, then `gdn-cp patch apply`",
    MODIFIED: "its target files (by sha256) are not the megatron-core {pin} release's, patched or not: local "
    "edits, another release, or another gdn-cp version's patch",
    MISSING: "some of its target files are missing",
}


def describe_state(state: str, pin: Optional[str] = None) -> str:
    """What an :func:`overall_state` word means for the tree, in words (``patch check``, ``doctor``
    and the patch tool's messages all say it this way)."""
    return _STATE_TEXT[state].format(pin=get_pin(pin).version)


def describe_tree(root: PathLike, pin: Optional[str] = None) -> str:
    """One line: the version string the tree reports, and what its target files are.

    E.g. ``megatron-core 0.19.1 according to megatron/core/package_info.py; its target files (by
    sha256) are the megatron-core 0.19.2 release's with the gdn-cp patch``.
    """
    r = find_megatron_root(root)
    pin, manifest = _resolve_pin(r, pin)
    v = megatron_version(r)
    found = f"megatron-core {v} according to {manifest.version_file}" if v else f"no version readable from {manifest.version_file}"
    return f"{found}; {describe_state(overall_state(_states(r, manifest)), pin)}"


def check_patch(root: Optional[PathLike] = None, pin: Optional[str] = None) -> dict[str, str]:
    """State of each target file: ``pristine`` | ``patched`` | ``modified`` | ``missing``.

    ``root``: anything :func:`find_megatron_root` accepts (default: the importable megatron).
    ``pin``: the release to compare with (default: the one the files match, else the table's).
    """
    r = find_megatron_root(root)
    return _states(r, _resolve_pin(r, pin)[1])


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


def _is_installed(root: Path) -> bool:
    """``root`` is where pip installed megatron-core (site-packages: its ``*.dist-info`` is there)."""
    return any(root.glob("megatron_core-*.dist-info")) or any(root.glob("megatron_core-*.egg-info"))


def _is_checkout(root: Path) -> bool:
    """A Megatron-LM source tree, possibly inside a git work tree: not an installed package, even
    one whose site-packages lies inside a repository (a virtual environment in a checkout: git does
    not track its files, so neither `git checkout` advice nor exclude lines belong to it)."""
    if _is_installed(root):
        return False
    return _find_git(root) is not None or (root / "pretrain_gpt.py").is_file()


def _foreign_error(root: Path, states: Mapping[str, str], manifest: Manifest, verb: str) -> PatchError:
    """Target files that are neither the release's nor the patched ones. When the other targets are
    the release's, these are local edits of the pinned release (a Megatron-LM checkout reporting
    another version string included): the fix is to restore them. When none is, the tree is
    another release, which this gdn-cp has no patch for."""
    bad = [f"{t} is {s}" for t, s in states.items() if s in (MODIFIED, MISSING)]
    pin = manifest.megatron_core_version
    v = megatron_version(root)
    found = (
        f"This tree reports megatron-core {v} ({manifest.version_file})"
        if v
        else f"Could not read megatron-core's version from {manifest.version_file}"
    )
    edited = " ".join(t for t, s in states.items() if s in (MODIFIED, MISSING))
    reinstall = f"reinstall megatron-core=={pin} ({get_pin(pin).install_command(reinstall=True)})"
    if any(s in (PRISTINE, PATCHED) for s in states.values()):
        why = (
            f"the other target files are the megatron-core {pin} release's, so these are local edits of "
            f"that release (or another gdn-cp version's patch); the patch applies only to files identical to "
            f"the release's (sha256)"
        )
        fixes = [f"restore them: `git checkout -- {edited}` in a git checkout"] if _is_checkout(root) else []
        fixes.append(reinstall)
    else:
        why = (
            f"the patch is pinned to megatron-core {pin} and applies only to files identical to that "
            f"release's (sha256); this gdn-cp supports megatron-core {', '.join(PINS)} only"
        )
        fixes = [f"install megatron-core=={pin} ({get_pin(pin).install_command()})"]
        if _is_checkout(root):
            refs = get_pin(pin).matching_refs
            seen = f" (e.g. {', '.join(refs)})" if refs else ""
            fixes.append(f"in a Megatron-LM checkout, check out a commit whose files match the {pin} release{seen}")
    return PatchError(
        f"cannot {verb} the patch in {root}: " + "; ".join(bad) + f". {found}; {why}. Fix: "
        + ", or ".join(fixes) + ". Nothing was changed."
    )


# --------------------------------------------------------------------------------------------
# git checkouts: keep the backups out of `git status`
# --------------------------------------------------------------------------------------------
def _find_git(root: Path) -> Optional[Path]:
    """The ``.git`` (folder, or file of a worktree / submodule) of the work tree holding ``root``."""
    for folder in (root, *root.parents):
        dot_git = folder / ".git"
        if dot_git.exists():
            return dot_git
    return None


def git_exclude_file(root: PathLike) -> Optional[Path]:
    """``info/exclude`` of the git repository whose work tree holds ``root``, or None.

    Handles a plain ``.git`` folder and the ``.git`` file of a worktree or submodule
    (``gitdir: ...``, with ``commondir`` for worktrees), without running git.
    """
    dot_git = _find_git(Path(root))
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


def _add_git_exclude(root: Path) -> Optional[Path]:
    """Add the backup pattern to the repository's ``info/exclude`` (once), for a checkout only.
    Returns the file."""
    exclude = git_exclude_file(root) if _is_checkout(root) else None
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


def _remove_git_exclude(root: Path) -> None:
    """Remove the two lines :func:`_add_git_exclude` added, leaving the rest of the file as it was."""
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
def _diff(text: str, t: PatchTarget, pin: str, *, reverse: bool = False) -> str:
    try:
        return apply_unified_diff(text, _read_patch_text(t, pin), reverse=reverse, name=t.target)
    except DiffError as e:
        raise PatchError(f"{e} Nothing was changed.") from None


def apply_patch(root: Optional[PathLike] = None, pin: Optional[str] = None) -> PatchResult:
    """Apply a pin's patch to the megatron-core at ``root`` (default: the importable one).

    ``pin``: default the release whose files the tree matches (by sha256). Every target must be
    pristine before anything is written; all files are replaced or none. Already patched: a
    no-op (``action == "already_patched"``).
    """
    r = find_megatron_root(root)
    pin, manifest = _resolve_pin(r, pin)
    states = _states(r, manifest)
    overall = overall_state(states)
    if overall == PATCHED:
        msg = f"megatron-core at {r} is already patched ({describe_tree(r, pin)}); nothing to do."
        _logger.debug(msg)  # the message is returned (the CLI prints it): not logged twice
        return PatchResult(r, "already_patched", dict(states), (), msg)
    if overall in (MODIFIED, MISSING):
        raise _foreign_error(r, states, manifest, "apply")
    if overall == PARTIAL:
        patched = [t for t, s in states.items() if s == PATCHED]
        raise PatchError(
            f"megatron-core at {r} is partially patched ({', '.join(patched)} patched, the other "
            "target files not). Run `gdn-cp patch revert` to restore the originals, then "
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
        new = _diff(original.decode("utf-8"), t, pin).encode("utf-8")
        if _sha256(new) != t.sha256_patched:
            raise PatchError(
                f"the vendored diff for {t.target} does not produce the expected file "
                "(corrupt gdn-cp installation); reinstall gdn-cp. Nothing was changed."
            )
        contents[path] = new
        originals[path] = original
        backups[path.with_name(path.name + BACKUP_SUFFIX)] = original

    _atomic_replace_all(contents, originals, extra_files=backups)
    files = _states(r, manifest)
    if overall_state(files) != PATCHED:  # pragma: no cover - would mean a concurrent writer
        raise PatchError(f"after applying, the files are {files}; run `gdn-cp patch check`.")
    exclude = _add_git_exclude(r)
    git_note = f"; *{BACKUP_SUFFIX} listed in {exclude}, so git status shows only the patched files" if exclude else ""
    msg = (
        f"patched megatron-core at {r} ({describe_tree(r, pin)}): {len(contents)} files; originals "
        f"kept as *{BACKUP_SUFFIX}{git_note}."
    )
    _logger.debug(msg)  # the message is returned (the CLI prints it): not logged twice
    return PatchResult(r, "applied", files, tuple(t.target for t in manifest.files), msg)


def revert_patch(root: Optional[PathLike] = None, pin: Optional[str] = None) -> PatchResult:
    """Restore the byte-identical pristine files at ``root`` (default: the importable megatron).

    Works from a fully or partially patched tree; a pristine tree is a no-op
    (``action == "already_pristine"``). Foreign modifications: :class:`PatchError`, nothing changed.
    Removes the backups and the ``info/exclude`` lines that ``apply_patch`` added.
    """
    r = find_megatron_root(root)
    pin, manifest = _resolve_pin(r, pin)
    states = _states(r, manifest)
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
            restored = _diff(current.decode("utf-8"), t, pin, reverse=True).encode("utf-8")
            if _sha256(restored) != t.sha256_pristine:
                raise PatchError(
                    f"reversing the diff of {t.target} does not give the pristine file "
                    f"(corrupt gdn-cp installation); reinstall megatron-core {pin}. Nothing was changed."
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
    _remove_git_exclude(r)
    files = _states(r, manifest)
    if not contents:
        msg = f"megatron-core at {r} is not patched; nothing to do."
        _logger.debug(msg)  # the message is returned (the CLI prints it): not logged twice
        return PatchResult(r, "already_pristine", files, (), msg)
    changed = tuple(t.target for t in manifest.files if _target_path(r, t) in contents)
    msg = f"restored the pristine files at {r} ({describe_tree(r, pin)})."
    _logger.debug(msg)  # the message is returned (the CLI prints it): not logged twice
    return PatchResult(r, "reverted", files, changed, msg)


# --------------------------------------------------------------------------------------------
# making a patch folder (maintainers)
# --------------------------------------------------------------------------------------------
def _patch_header(pin: Pin) -> str:
    return (
        f"gdn-cp patch for megatron-core {pin.version} (the PyPI release; gdn_cp/megatron/pins lists "
        "Megatron-LM refs with the same files).\n"
        "Apply with `gdn-cp patch apply` (hash-checked, atomic, revertible); manifest.json beside this "
        "file holds the sha256 of the pristine and patched file.\n"
        "Made by gdn_cp.megatron.patching.build_patch_files from a pristine and a patched tree.\n\n"
    )


def build_patch_files(pristine_root: PathLike, patched_root: PathLike, targets: Iterable[str], pin: Optional[str] = None,
                      out_dir: Optional[PathLike] = None) -> Path:
    """Write a pin's patch folder (one ``<file>.patch`` per target and ``manifest.json``).

    ``pristine_root`` / ``patched_root``: folders holding ``megatron/`` as released and as
    gdn-cp changes it; ``targets``: paths relative to them. Writes into ``out_dir`` (default:
    the source tree's ``patches/<pin folder>``) and returns it. For maintainers: edit a copy of
    the release, run this, commit the folder; tests check the folder reproduces the edit.
    """
    p = get_pin(pin)
    out = Path(out_dir) if out_dir is not None else _source_patches() / p.patch_folder
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for target in targets:
        old = (Path(pristine_root) / target).read_bytes()
        new = (Path(patched_root) / target).read_bytes()
        diff = make_unified_diff(old.decode("utf-8"), new.decode("utf-8"), target)
        if not diff:
            raise PatchError(f"{target} is the same in both trees; nothing to patch there.")
        name = target.rsplit("/", 1)[-1] + ".patch"
        (out / name).write_text(_patch_header(p) + diff, encoding="utf-8")
        files.append({"target": target, "patch": name, "sha256_pristine": _sha256(old), "sha256_patched": _sha256(new)})
    manifest = {
        "format": 1,
        "name": "gdn-cp megatron-core patch",
        "megatron_core_version": p.version,
        "source": f"megatron-core {p.version} from PyPI; Megatron-LM refs with the same target files: "
        + (", ".join(p.matching_refs) or "none checked"),
        "version_file": "megatron/core/package_info.py",
        "paths_relative_to": "the folder that contains the megatron/ package (a Megatron-LM checkout or site-packages)",
        "files": files,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return out
