"""Which release a megatron-core is, and so which adapter reads it: the one lookup every hook makes.

A megatron-core is known by its *location*: the folder that holds its ``megatron/`` package (site-packages,
or a Megatron-LM checkout). Its release is the pin whose target files (its manifest) it holds, each pristine
or patched, by sha256: content hashes decide, never version strings (a Megatron-LM checkout may report
another version in ``package_info.py`` while its files are byte-identical to a release's).

* :func:`running_release`: the release of the megatron-core this process imports (``megatron``'s location),
  what the config hook, the Megatron-LM args hook and the batch hooks read, at hook time;
* :func:`release_of_layer_class`: the release of a ``GatedDeltaNet`` class (its source file's location),
  what a layer reads on its first call.

Both go through :func:`pin_at`, cached per location (the cache entry is dropped when one of the files it
read changes: its size, mtime or inode). With one pin in the table that pin is the answer and no file is
read. Torch-free and Megatron-free (``megatron`` is located, never imported).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Optional

from . import manifest
from .adapter import ReleaseAdapter
from .table import PINS, Pin, get_pin

__all__ = ["file_matches_pin", "megatron_root", "pin_at", "pin_of_layer_class", "release_of_layer_class",
           "running_megatron_root", "running_pin", "running_release"]


def file_matches_pin(path, pin: Pin, *, patched: bool) -> bool:
    """Whether the file at ``path`` is one of ``pin``'s targets, pristine or (``patched``) patched."""
    p = Path(path)
    for t in manifest.load_manifest(pin.version).files:
        if p.as_posix().endswith("/" + t.target):
            try:
                digest = manifest.sha256_hex(p.read_bytes())
            except OSError:  # missing or unreadable: not a match
                return False
            return digest == (t.sha256_patched if patched else t.sha256_pristine)
    return False


def megatron_root(path) -> Optional[Path]:
    """The location of the megatron-core that holds the file ``path``: the folder above its nearest
    ``megatron/`` folder (None: ``path`` is not inside one)."""
    for parent in Path(path).resolve().parents:
        if parent.name == "megatron":
            return parent.parent
    return None


def running_megatron_root() -> Optional[Path]:
    """The location of the megatron-core this process imports: where its ``megatron`` package was imported
    from, or where an import would find it (it is not imported here); None when there is none."""
    for name in ("megatron.core", "megatron"):
        source = getattr(sys.modules.get(name), "__file__", None)
        if source:
            return megatron_root(source)
    try:
        spec = importlib.util.find_spec("megatron")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    where = spec.origin or next(iter(spec.submodule_search_locations or ()), None)
    if where is None:
        return None
    path = Path(where)
    return path.parent.parent if path.name == "__init__.py" else path.parent


def _stat(path: Path):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino


def _matches(root: Path, pin: Pin) -> bool:
    """Every target of ``pin`` is under ``root``, pristine or patched."""
    for t in manifest.load_manifest(pin.version).files:
        try:
            digest = manifest.sha256_hex((root / t.target).read_bytes())
        except OSError:
            return False
        if digest not in (t.sha256_pristine, t.sha256_patched):
            return False
    return True


_CACHE: dict[str, tuple[tuple, Pin]] = {}  # location -> (what was read: the pins and their files' stats, its pin)


def pin_at(root) -> Pin:
    """The pin of the megatron-core at ``root`` (:func:`megatron_root`), looked up once per location.

    One pin in the table: that pin. Several: the one whose every target file ``root`` holds (pristine or
    patched, by sha256); ``root`` None (no megatron-core here, so nothing of one is read): the default pin.
    ValueError naming the location, the supported releases and the fix when no pin matches."""
    if len(PINS) == 1:
        return next(iter(PINS.values()))
    if root is None:
        return get_pin()
    root = Path(root)
    pins = tuple(PINS.values())
    targets = [root / t.target for pin in pins for t in manifest.load_manifest(pin.version).files]
    key = (tuple(id(pin) for pin in pins), tuple(_stat(p) for p in targets))
    cached = _CACHE.get(str(root))
    if cached is not None and cached[0] == key:
        return cached[1]
    found = [pin for pin in pins if _matches(root, pin)]
    if not found:
        raise ValueError(
            f"the megatron-core at {root} is none of the releases this gdn-cp supports ({', '.join(PINS)}): its "
            "files match no release's sha256; install one of them, then run `gdn-cp patch check`"
        )
    _CACHE[str(root)] = (key, found[0])
    return found[0]


def running_pin() -> Pin:
    """The pin of the megatron-core this process imports (:func:`running_megatron_root`, :func:`pin_at`)."""
    return pin_at(running_megatron_root())


def running_release() -> ReleaseAdapter:
    """The adapter of the megatron-core this process imports: what every hook reads Megatron with, at
    hook time (:func:`running_pin`)."""
    return running_pin().adapter


def pin_of_layer_class(layer_cls: type) -> Pin:
    """The pin of the megatron-core whose ``gdn.py`` defines ``layer_cls`` (Megatron's ``GatedDeltaNet``):
    :func:`pin_at` the location of the class's source file."""
    if len(PINS) == 1:
        return next(iter(PINS.values()))
    source = getattr(sys.modules.get(layer_cls.__module__), "__file__", None)
    root = None if source is None else megatron_root(source)
    try:
        if root is None:
            raise ValueError("not inside a megatron/ folder")
        return pin_at(root)
    except ValueError:
        raise ValueError(
            f"{layer_cls.__module__}.{layer_cls.__qualname__} (from {source}) is not the patched file of any "
            f"megatron-core release this gdn-cp supports ({', '.join(PINS)}); run `gdn-cp patch check`"
        ) from None


def release_of_layer_class(layer_cls: type) -> ReleaseAdapter:
    """The adapter of ``layer_cls``'s release (:func:`pin_of_layer_class`)."""
    return pin_of_layer_class(layer_cls).adapter
