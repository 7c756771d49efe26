"""Apply and revert a pin's patch on a megatron-core tree, all files or none.

``apply_patch`` verifies that every target is pristine before touching anything, computes every
patched file in memory (diff applied with exact context, result hash-checked), stages them as
temporary files next to the targets and only then renames them into place. The originals are kept
as ``<file>.gdn_cp.orig`` (listed in ``info/exclude`` in a git checkout). Applying an applied patch
is a no-op that says so. ``revert_patch`` restores byte-identical pristine files (from the backup,
or by reversing the diff; either way hash-checked) and removes the backups and exclude lines.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Optional

from ..pins import PatchError, PatchTarget, patch_dir
from ..pins.manifest import sha256_hex
from .atomic import atomic_replace_all, remove_quietly
from .git_exclude import add_git_exclude, remove_git_exclude
from .tree import (
    BACKUP_SUFFIX,
    MISSING,
    MODIFIED,
    PARTIAL,
    PATCHED,
    PathLike,
    describe_tree,
    find_megatron_root,
    foreign_error,
    overall_state,
    pristine_backups,
    resolve_pin,
    target_path,
    tree_states,
)
from .unified_diff import DiffError, apply_unified_diff

__all__ = ["PatchResult", "apply_patch", "revert_patch"]

_logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PatchResult:
    """What ``apply_patch`` / ``revert_patch`` did."""

    root: Path
    action: str  # "applied" | "already_patched" | "reverted" | "already_pristine" | "would_apply" | "would_revert"
    files: dict[str, str]  # target -> state afterwards (a dry run: as it is)
    changed: tuple[str, ...]  # targets whose content was rewritten (a dry run: would be)
    message: str
    contents: dict[str, bytes] = dataclasses.field(default_factory=dict, repr=False)  # target -> what was written


def _diff(text: str, t: PatchTarget, pin: str, *, reverse: bool = False) -> str:
    try:
        patch_text = (patch_dir(pin) / t.patch).read_text(encoding="utf-8")
        return apply_unified_diff(text, patch_text, reverse=reverse, name=t.target)
    except DiffError as e:
        raise PatchError(f"{e} The files' sha256 matched, so gdn-cp's own patch files are damaged: reinstall gdn-cp "
                         "(pip install -e <clone>). Nothing was changed.") from None


def apply_patch(root: Optional[PathLike] = None, pin: Optional[str] = None, *, dry_run: bool = False) -> PatchResult:
    """Apply a pin's patch to the megatron-core at ``root`` (default: the importable one).

    ``pin``: default the release whose files the tree matches (by sha256). Every target must be
    pristine before anything is written; all files are replaced or none. Already patched: a
    no-op (``action == "already_patched"``). ``dry_run``: every check and every new file made,
    nothing written (``action == "would_apply"``, the new files in ``contents``).
    """
    r = find_megatron_root(root)
    pin, manifest = resolve_pin(r, pin)
    states = tree_states(r, manifest)
    overall = overall_state(states)
    if overall == PATCHED:
        msg = f"megatron-core at {r} is already patched ({describe_tree(r, pin)}); nothing to do."
        _logger.debug(msg)  # the message is returned (the CLI prints it): not logged twice
        return PatchResult(r, "already_patched", dict(states), (), msg)
    if overall in (MODIFIED, MISSING):
        raise foreign_error(r, states, manifest, "apply")
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
        path = target_path(r, t)
        original = path.read_bytes()
        if sha256_hex(original) != t.sha256_pristine:  # changed since we looked
            raise PatchError(f"{path} changed while patching; nothing was changed, try again.")
        new = _diff(original.decode("utf-8"), t, pin).encode("utf-8")
        if sha256_hex(new) != t.sha256_patched:
            raise PatchError(
                f"the vendored diff for {t.target} does not produce the expected file "
                "(corrupt gdn-cp installation); reinstall gdn-cp. Nothing was changed."
            )
        contents[path] = new
        originals[path] = original
        backups[path.with_name(path.name + BACKUP_SUFFIX)] = original

    changed = tuple(t.target for t in manifest.files)
    if dry_run:
        return PatchResult(r, "would_apply", dict(states), changed, f"would patch megatron-core at {r} "
                           f"({describe_tree(r, pin)}): {len(contents)} files; nothing was written.",
                           {t.target: contents[target_path(r, t)] for t in manifest.files})
    atomic_replace_all(contents, originals, extra_files=backups)
    files = tree_states(r, manifest)
    if overall_state(files) != PATCHED:  # pragma: no cover - would mean a concurrent writer
        raise PatchError(f"after applying, the files are {files}; run `gdn-cp patch check`.")
    exclude = add_git_exclude(r)
    git_note = f"; *{BACKUP_SUFFIX} listed in {exclude}, so git status shows only the patched files" if exclude else ""
    msg = (
        f"patched megatron-core at {r} ({describe_tree(r, pin)}): {len(contents)} files; originals "
        f"kept as *{BACKUP_SUFFIX}{git_note}."
    )
    _logger.debug(msg)  # the message is returned (the CLI prints it): not logged twice
    return PatchResult(r, "applied", files, changed, msg, {t.target: contents[target_path(r, t)] for t in manifest.files})


def revert_patch(root: Optional[PathLike] = None, pin: Optional[str] = None, *, from_backups: bool = False,
                 dry_run: bool = False) -> PatchResult:
    """Restore the byte-identical pristine files at ``root`` (default: the importable megatron).

    Works from a fully or partially patched tree; a pristine tree is a no-op
    (``action == "already_pristine"``). Foreign modifications: :class:`PatchError`, nothing changed;
    with ``from_backups`` a modified file whose gdn-cp backup is the release's original (another gdn-cp
    version's patch, or edits of a patched file: they are lost) is restored from that backup.
    Removes the backups and the ``info/exclude`` lines that ``apply_patch`` added. ``dry_run``: every
    check and every restored file made, nothing written or removed (``action == "would_revert"``, or
    ``already_pristine``; the files in ``contents``).
    """
    r = find_megatron_root(root)
    pin, manifest = resolve_pin(r, pin)
    states = tree_states(r, manifest)
    overall = overall_state(states)
    # a file gdn-cp patched that changed since (another gdn-cp version's patch): back to its backed-up original
    backups = pristine_backups(r, states, manifest) if overall == MODIFIED and from_backups else {}
    if overall in (MODIFIED, MISSING) and set(backups) != {t for t, s in states.items() if s == MODIFIED}:
        raise foreign_error(r, states, manifest, "revert")

    contents: dict[Path, bytes] = {}
    originals: dict[Path, bytes] = {}
    for t in manifest.files:
        if t.target in backups:
            _logger.warning("%s changed since gdn-cp patched it (another gdn-cp version's patch, or edits): "
                            "restoring the release's original from its backup", t.target)
            path = target_path(r, t)
            contents[path], originals[path] = backups[t.target], path.read_bytes()
            continue
        if states[t.target] != PATCHED:
            continue
        path = target_path(r, t)
        current = path.read_bytes()
        backup = path.with_name(path.name + BACKUP_SUFFIX)
        restored: Optional[bytes] = None
        try:
            b = backup.read_bytes()
            if sha256_hex(b) == t.sha256_pristine:
                restored = b
            else:
                _logger.warning("ignoring %s: not the pristine file", backup)
        except FileNotFoundError:
            pass
        if restored is None:
            restored = _diff(current.decode("utf-8"), t, pin, reverse=True).encode("utf-8")
            if sha256_hex(restored) != t.sha256_pristine:
                raise PatchError(
                    f"reversing the diff of {t.target} does not give the pristine file "
                    f"(corrupt gdn-cp installation); reinstall megatron-core {pin}. Nothing was changed."
                )
        contents[path] = restored
        originals[path] = current

    changed = tuple(t.target for t in manifest.files if target_path(r, t) in contents)
    restored_files = {t.target: contents[target_path(r, t)] for t in manifest.files if target_path(r, t) in contents}
    if dry_run:
        if not contents:
            return PatchResult(r, "already_pristine", dict(states), (), f"megatron-core at {r} is not patched; "
                               "nothing to do.")
        return PatchResult(r, "would_revert", dict(states), changed, f"would restore the pristine files at {r} "
                           f"({describe_tree(r, pin)}): {len(contents)} files; nothing was written.", restored_files)
    if contents:
        atomic_replace_all(contents, originals)
    for t in manifest.files:  # backups are no longer needed once every file is pristine
        path = target_path(r, t)
        backup = path.with_name(path.name + BACKUP_SUFFIX)
        if backup.exists():
            remove_quietly(backup)
    remove_git_exclude(r)
    files = tree_states(r, manifest)
    if not contents:
        msg = f"megatron-core at {r} is not patched; nothing to do."
        _logger.debug(msg)  # the message is returned (the CLI prints it): not logged twice
        return PatchResult(r, "already_pristine", files, (), msg)
    msg = f"restored the pristine files at {r} ({describe_tree(r, pin)})."
    _logger.debug(msg)  # the message is returned (the CLI prints it): not logged twice
    return PatchResult(r, "reverted", files, changed, msg, restored_files)


# --------------------------------------------------------------------------------------------
