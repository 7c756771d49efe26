"""One way to get a patched megatron-core for the tests and the benchmarks: find it, check it, patch
it if it is pristine, refuse anything else with the fix."""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path
from typing import Optional

from ..pins import PatchError
from .apply import apply_patch
from .tree import (
    BACKUP_SUFFIX,
    MISSING,
    MODIFIED,
    PARTIAL,
    PATCHED,
    PathLike,
    describe_state,
    find_megatron_root,
    foreign_error,
    megatron_version,
    overall_state,
    resolve_pin,
    tree_states,
)

__all__ = ["PatchedTree", "ensure_patched"]

_logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PatchedTree:
    """What :func:`ensure_patched` found and did.

    ``root``: the patched tree to import ``megatron`` from (``source`` itself, or its copy);
    ``source``: the tree that was found; ``version``: the version string ``source`` reports (None
    when unreadable; the files decide, not this); ``applied``: this call wrote the patch into
    ``root``; ``copied``: ``root`` is a copy under ``copy_to``.
    """

    root: Path
    source: Path
    version: Optional[str]
    applied: bool
    copied: bool


def ensure_patched(path: Optional[PathLike] = None, *, copy_to: Optional[PathLike] = None) -> PatchedTree:
    """A patched megatron-core: the one at ``path`` (anything :func:`find_megatron_root` takes;
    default: the importable one), checked by sha256 against the pinned release.

    Patched: returned as it is. Pristine: patched in place, or, with ``copy_to``, its ``megatron/``
    package copied into ``copy_to`` (backups left out) and the copy patched, the found tree left as
    it was. Partially patched, modified or missing files: :class:`PatchError` naming the files and
    the fix, nothing written. No megatron-core there: :class:`MegatronNotFound` (a PatchError).
    """
    source = find_megatron_root(path)
    pin, manifest = resolve_pin(source, None)
    states = tree_states(source, manifest)
    state = overall_state(states)
    version = megatron_version(source)
    if state == PATCHED:
        return PatchedTree(source, source, version, applied=False, copied=False)
    if state in (MODIFIED, MISSING):
        raise foreign_error(source, states, manifest, "apply")
    if state == PARTIAL:
        raise PatchError(f"megatron-core at {source}: {describe_state(state, pin)}. Nothing was changed.")
    root = source
    if copy_to is not None:
        root = Path(copy_to)
        shutil.copytree(source / "megatron", root / "megatron", symlinks=True,
                        ignore=shutil.ignore_patterns("*" + BACKUP_SUFFIX))
    apply_patch(root, pin)
    _logger.info("patched megatron-core at %s%s", root, f" (a copy of {source})" if copy_to is not None else "")
    return PatchedTree(root.resolve(), source, version, applied=True, copied=copy_to is not None)
