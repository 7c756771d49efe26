"""A pin's patch folder (``patches/megatron-core-<version>/``): where it is and what its manifest says.

The folder holds one unified diff per target file and ``manifest.json`` with, per target (a path
relative to the folder that contains the ``megatron/`` package), the sha256 of the pristine and of
the patched file. It is data of the pin, read here, below both the forward (which matches a
layer's source file against it: :mod:`.lookup`) and the patch tool (:mod:`gdn_cp.patch`, which
applies it). Torch-free and Megatron-free.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources
import json
from pathlib import Path
from typing import Optional

from .table import get_pin

__all__ = ["PatchError", "PatchTarget", "Manifest", "patch_dir", "load_manifest", "sha256_hex", "source_patches"]


class PatchError(RuntimeError):
    """The patch cannot be applied / reverted / checked (its folder is broken, or the tree is not
    the release's); nothing was changed. Raised here and by :mod:`gdn_cp.patch`."""


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


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def source_patches() -> Path:
    """The repository's top-level ``patches/`` folder (a source checkout)."""
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
    cand = source_patches() / name
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
