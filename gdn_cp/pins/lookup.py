"""Which pin a loaded ``GatedDeltaNet`` class belongs to, and so which adapter reads it.

Content hashes decide, never version strings: a Megatron-LM checkout may report another version in
``package_info.py`` while its files are byte-identical to a release's. Torch-free and Megatron-free.
"""

from __future__ import annotations

import sys
from functools import lru_cache
from pathlib import Path

from . import manifest
from .table import PINS, Pin

__all__ = ["adapter_class", "file_matches_pin", "pin_of_layer_class"]


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


@lru_cache(maxsize=None)
def adapter_class(layer_cls: type) -> type:
    """``LayerAdapter`` of ``layer_cls``'s release (looked up once per class)."""
    return pin_of_layer_class(layer_cls).adapter.LayerAdapter
