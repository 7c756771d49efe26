"""A megatron-core tree: where it is, which version it reports, and the state of its target files.

A target file is ``pristine`` (the release's), ``patched`` (the release's with the gdn-cp patch),
``modified`` (someone else's change, or another release) or ``missing``, by sha256 against the
pin's manifest; a tree is one of those or ``partial`` (some pristine, the others patched).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from pathlib import Path
from typing import Mapping, Optional, Union

from ..pins import PINNED_VERSION, PINS, Manifest, PatchError, PatchTarget, Pin, get_pin, load_manifest
from ..pins.manifest import sha256_hex

__all__ = [
    "PRISTINE", "PATCHED", "MODIFIED", "MISSING", "PARTIAL", "BACKUP_SUFFIX", "MegatronNotFound", "PathLike",
    "pristine_backups",
    "find_megatron_root", "megatron_version", "detect_pin", "resolve_pin", "check_patch", "overall_state",
    "describe_state", "describe_tree", "find_git", "is_checkout", "foreign_error", "foreign_fix", "target_path", "file_state",
    "tree_states",
]

_logger = logging.getLogger(__name__)

PRISTINE = "pristine"
PATCHED = "patched"
MODIFIED = "modified"
MISSING = "missing"
PARTIAL = "partial"  # overall state only: some files pristine, the others patched

BACKUP_SUFFIX = ".gdn_cp.orig"  # the original of a patched file, kept next to it

PathLike = Union[str, "os.PathLike[str]"]


class MegatronNotFound(PatchError):
    """No megatron-core where the caller pointed (or none importable): nothing was looked at."""


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
def target_path(root: Path, t: PatchTarget) -> Path:
    return root.joinpath(*t.target.split("/"))


def file_state(path: Path, t: PatchTarget) -> str:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return MISSING
    h = sha256_hex(data)
    if h == t.sha256_pristine:
        return PRISTINE
    if h == t.sha256_patched:
        return PATCHED
    return MODIFIED


def tree_states(root: Path, manifest: Manifest) -> dict[str, str]:
    """Target -> state, for every target of ``manifest``."""
    return {t.target: file_state(target_path(root, t), t) for t in manifest.files}


def detect_pin(root: Optional[PathLike] = None) -> Optional[Pin]:
    """The pin whose release files ``root`` holds (each target pristine or patched), or None.

    Goes by sha256 only, so a Megatron-LM checkout matches the release it shares files with
    whatever version string its ``package_info.py`` reports.
    """
    r = find_megatron_root(root)
    for pin in PINS.values():
        if set(tree_states(r, load_manifest(pin.version)).values()) <= {PRISTINE, PATCHED}:
            return pin
    return None


def resolve_pin(root: Path, pin: Optional[str]) -> tuple[str, Manifest]:
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
    pin, manifest = resolve_pin(r, pin)
    v = megatron_version(r)
    found = f"megatron-core {v} according to {manifest.version_file}" if v else f"no version readable from {manifest.version_file}"
    return f"{found}; {describe_state(overall_state(tree_states(r, manifest)), pin)}"


def check_patch(root: Optional[PathLike] = None, pin: Optional[str] = None) -> dict[str, str]:
    """State of each target file: ``pristine`` | ``patched`` | ``modified`` | ``missing``.

    ``root``: anything :func:`find_megatron_root` accepts (default: the importable megatron).
    ``pin``: the release to compare with (default: the one the files match, else the table's).
    """
    r = find_megatron_root(root)
    return tree_states(r, resolve_pin(r, pin)[1])


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


# --------------------------------------------------------------------------------------------
# installed package or source checkout, and what to do about a tree that is not the release's
# --------------------------------------------------------------------------------------------
def _is_installed(root: Path) -> bool:
    """``root`` is where pip installed megatron-core (site-packages: its ``*.dist-info`` is there)."""
    return any(root.glob("megatron_core-*.dist-info")) or any(root.glob("megatron_core-*.egg-info"))


def find_git(root: Path) -> Optional[Path]:
    """The ``.git`` (folder, or file of a worktree / submodule) of the work tree holding ``root``."""
    for folder in (root, *root.parents):
        dot_git = folder / ".git"
        if dot_git.exists():
            return dot_git
    return None


def is_checkout(root: Path) -> bool:
    """A Megatron-LM source tree, possibly inside a git work tree: not an installed package, even
    one whose site-packages lies inside a repository (a virtual environment in a checkout: git does
    not track its files, so neither `git checkout` advice nor exclude lines belong to it)."""
    if _is_installed(root):
        return False
    return find_git(root) is not None or (root / "pretrain_gpt.py").is_file()


def _restore_in_checkout(root: Path, edited: str, pin: str) -> str:
    """How to put the release's files back in a Megatron-LM checkout. Its scripts import the checkout's
    own ``megatron/`` (the script's folder comes first on ``sys.path``), so reinstalling the pip package
    would not touch these files: git restores them in a git checkout; in a copy without git (an unpacked
    archive), the release's sources do."""
    if find_git(root) is not None:
        return f"restore them: `git checkout -- {edited}` in {root}"
    return (
        f"restore them from the megatron-core {pin} sources (this checkout has no git, and pip does not manage "
        f"its files): `python -m pip download --no-deps --no-binary megatron-core megatron-core=={pin}`, unpack "
        f"the megatron_core-{pin}.tar.gz it writes, and copy {edited} from its folder into {root}"
    )


def pristine_backups(root: Path, states: Mapping[str, str], manifest: Manifest) -> dict[str, bytes]:
    """For each modified target whose gdn-cp backup (``*.gdn_cp.orig``) is the release's file (sha256):
    that original. A file gdn-cp patched and something changed since: most often another gdn-cp
    version's patch (an upgrade of gdn-cp), which ``revert`` undoes from these backups."""
    found = {}
    for t in manifest.files:
        if states.get(t.target) != MODIFIED:
            continue
        backup = target_path(root, t).with_name(target_path(root, t).name + BACKUP_SUFFIX)
        try:
            data = backup.read_bytes()
        except FileNotFoundError:
            continue
        if sha256_hex(data) == t.sha256_pristine:
            found[t.target] = data
    return found


def foreign_fix(root: Path, states: Mapping[str, str], manifest: Manifest) -> tuple[str, str]:
    """``(why, fix)`` for target files that are neither the release's nor the patched ones, in words for
    the tree they are in: ``apply`` / ``revert``'s refusal (:func:`foreign_error`) and ``patch check``'s
    advice say the same. When gdn-cp's backups of the changed files are the release's: revert from them.
    When the other targets are the release's, these are local edits of the pinned release (a Megatron-LM
    checkout reporting another version string included): restore them (git in a git checkout, the
    release's sources in a copy without git, a reinstall of an installed package). When none is, the
    tree is another release, which this gdn-cp has no patch for."""
    pin = manifest.megatron_core_version
    edited = " ".join(t for t, s in states.items() if s in (MODIFIED, MISSING))
    modified = [t for t, s in states.items() if s == MODIFIED]
    if modified and not any(s == MISSING for s in states.values()) and set(pristine_backups(root, states, manifest)) == set(modified):
        why = (f"gdn-cp patched these files and kept the release's originals beside them ({BACKUP_SUFFIX}), and they "
               f"have changed since: another gdn-cp version's patch (an upgrade of gdn-cp), or edits of the patched files")
        return why, (f"`gdn-cp patch revert --from-backups {root}` restores the originals from those backups (edits "
                     f"made to the patched files are lost), then `gdn-cp patch apply {root}`")
    if any(s in (PRISTINE, PATCHED) for s in states.values()):
        why = (
            f"the other target files are the megatron-core {pin} release's, so these are local edits of "
            f"that release (or another gdn-cp version's patch); the patch applies only to files identical to "
            f"the release's (sha256)"
        )
        if is_checkout(root):
            return why, _restore_in_checkout(root, edited, pin)
        return why, f"reinstall megatron-core=={pin} ({get_pin(pin).install_command(reinstall=True)})"
    why = (
        f"the patch is pinned to megatron-core {pin} and applies only to files identical to that "
        f"release's (sha256); this gdn-cp supports megatron-core {', '.join(PINS)} only"
    )
    fixes = [f"install megatron-core=={pin} ({get_pin(pin).install_command()})"]
    if is_checkout(root):
        refs = get_pin(pin).matching_refs
        seen = f" (e.g. {', '.join(refs)})" if refs else ""
        fixes.append(f"in a Megatron-LM checkout, check out a commit whose files match the {pin} release{seen}")
    return why, ", or ".join(fixes)


def foreign_error(root: Path, states: Mapping[str, str], manifest: Manifest, verb: str) -> PatchError:
    """``apply`` / ``revert`` refused: target files that are neither the release's nor the patched ones,
    with why and the fix of :func:`foreign_fix`."""
    bad = [f"{t} is {s}" for t, s in states.items() if s in (MODIFIED, MISSING)]
    v = megatron_version(root)
    found = (
        f"This tree reports megatron-core {v} ({manifest.version_file})"
        if v
        else f"Could not read megatron-core's version from {manifest.version_file}"
    )
    why, fix = foreign_fix(root, states, manifest)
    return PatchError(
        f"cannot {verb} the patch in {root}: " + "; ".join(bad) + f". {found}; {why}. Fix: {fix}. Nothing was changed."
    )
