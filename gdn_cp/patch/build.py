"""Making a pin's patch folder (maintainers): edit a copy of the release, run
:func:`build_patch_files`, commit the folder; the tests check the folder reproduces the edit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional

from ..pins import PatchError, Pin, get_pin
from ..pins.manifest import sha256_hex, source_patches
from .tree import PathLike
from .unified_diff import make_unified_diff

__all__ = ["build_patch_files"]


def _patch_header(pin: Pin) -> str:
    return (
        f"gdn-cp patch for megatron-core {pin.version} (the PyPI release; gdn_cp/pins lists "
        "Megatron-LM refs with the same files).\n"
        "Apply with `gdn-cp patch apply` (hash-checked, atomic, revertible); manifest.json beside this "
        "file holds the sha256 of the pristine and patched file.\n"
        "Made by gdn_cp.patch.build_patch_files from a pristine and a patched tree.\n\n"
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
    out = Path(out_dir) if out_dir is not None else source_patches() / p.patch_folder
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
        files.append({"target": target, "patch": name, "sha256_pristine": sha256_hex(old), "sha256_patched": sha256_hex(new)})
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
