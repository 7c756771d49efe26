"""The megatron-core releases gdn-cp supports (pins), each with its patch folder and layer adapter.

A pin is one megatron-core release whose target files gdn-cp patches. Supporting another
release (0.18.x, the next one) takes three things and nothing else:

* a patch folder ``patches/megatron-core-<version>/`` (unified diffs + ``manifest.json`` with the
  sha256 of the pristine and patched files; read by :mod:`.manifest`, applied by :mod:`gdn_cp.patch`),
* an adapter module ``gdn_cp/pins/megatron_core_<version with _>.py``: a
  :class:`~.adapter.ReleaseAdapter` subclass (with its :class:`~.adapter.LayerAdapter`) that reads that
  release's ``TransformerConfig``, ``GatedDeltaNet``, ``PackedSeqParams`` and Megatron-LM's args and batches;
  the next release's subclasses the previous one's and overrides what changed (see :mod:`.megatron_core_0_19_2`),
* one :class:`Pin` row in :data:`PINS` (:mod:`.table`).

Everything that names a megatron-core version (the patch tool, ``doctor``, install hints, the
CLI's help) reads it from here; :mod:`.lookup` finds the release of the running megatron-core (every
hook, at hook time) and of a loaded layer class, by their files' sha256. Imports ``gdn_cp.checks`` and
nothing else of gdn_cp (the patch tool reads this package alone); torch-free and Megatron-free.
"""

from .adapter import ConfigFields, LayerAdapter, PackedSeqFields, ReleaseAdapter
from .lookup import (file_matches_pin, pin_at, pin_of_layer_class, release_of_layer_class, running_pin,
                     running_release)
from .manifest import Manifest, PatchError, PatchTarget, load_manifest, patch_dir
from .table import PINNED_VERSION, PINS, Pin, get_pin, load_adapter

__all__ = [
    "Pin", "PINS", "PINNED_VERSION", "get_pin", "load_adapter",
    "PatchError", "PatchTarget", "Manifest", "patch_dir", "load_manifest",
    "ConfigFields", "LayerAdapter", "PackedSeqFields", "ReleaseAdapter",
    "file_matches_pin", "pin_at", "pin_of_layer_class", "release_of_layer_class", "running_pin", "running_release",
]
