"""The patch tool: install, check and revert a pinned Megatron-Core patch (``patches/megatron-core-<version>/``).

Off to the side of the library: the ``gdn-cp patch`` and ``doctor`` commands, the tests and the
benchmarks use it; nothing on the forward path imports it. Each supported release (a pin, see
:mod:`gdn_cp.pins`, which also reads the patch folder's manifest) has a patch folder
holding one unified diff per target file and a ``manifest.json`` with the sha256 of the pristine
and of the patched file. Content hashes are the source of truth, never version strings: a
Megatron-LM checkout reports its own version in ``megatron/core/package_info.py`` (e.g. ``0.19.1``)
while its target files can be byte-identical to a release's.

* :mod:`.tree`: where megatron-core is, the version it reports, each target's state (``pristine`` /
  ``patched`` / ``modified`` / ``missing``) and the tree's (or ``partial``), in words;
* :mod:`.apply`: ``apply_patch`` / ``revert_patch``, all files or none (:mod:`.atomic`), originals
  kept as ``<file>.gdn_cp.orig`` and listed in a checkout's ``info/exclude`` (:mod:`.git_exclude`);
  ``pip uninstall megatron-core`` does not know the backups: revert before uninstalling;
* :mod:`.ensure`: ``ensure_patched``, what the tests and benchmarks call: patch a pristine tree
  (in place or in a copy), refuse any other with the fix;
* :mod:`.build`: ``build_patch_files`` (maintainers); :mod:`.unified_diff`: exact diffs.

No function here prints; they return results and log. Errors are :class:`PatchError` with a
message that says what is wrong and what to do; nothing has been changed when one is raised.
Torch-free and Megatron-free.
"""

from ..pins import PINNED_VERSION, Manifest, PatchError, PatchTarget, get_pin, load_manifest, patch_dir
from .apply import PatchResult, apply_patch, revert_patch
from .build import build_patch_files
from .ensure import PatchedTree, ensure_patched
from .git_exclude import git_exclude_file
from .tree import (
    BACKUP_SUFFIX,
    MISSING,
    MODIFIED,
    PARTIAL,
    PATCHED,
    PRISTINE,
    MegatronNotFound,
    check_patch,
    describe_state,
    describe_tree,
    detect_pin,
    find_megatron_root,
    megatron_version,
    overall_state,
    pristine_backups,
)

PATCH_NAME = get_pin().patch_folder  # the default pin's folder, e.g. "megatron-core-0.19.2"

__all__ = [
    "PINNED_VERSION", "PATCH_NAME", "PRISTINE", "PATCHED", "MODIFIED", "MISSING", "PARTIAL", "BACKUP_SUFFIX",
    "PatchError", "MegatronNotFound", "PatchTarget", "Manifest", "PatchResult", "PatchedTree",
    "patch_dir", "load_manifest", "find_megatron_root", "megatron_version", "detect_pin", "describe_state",
    "describe_tree", "check_patch", "overall_state", "apply_patch", "revert_patch", "ensure_patched",
    "git_exclude_file", "build_patch_files", "pristine_backups",
]
