"""The table of supported megatron-core releases: one :class:`Pin` row per release."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from . import megatron_core_0_19_2
from .adapter import ReleaseAdapter

__all__ = ["Pin", "PINS", "PINNED_VERSION", "get_pin", "load_adapter"]


@dataclass(frozen=True)
class Pin:
    """One supported megatron-core release.

    ``version``: the release's version string (``megatron/core/package_info.py`` of the PyPI
    release). ``patch_folder``: folder name under ``patches/`` (shipped as ``gdn_cp._patches``).
    ``adapter``: the release's :class:`~gdn_cp.pins.adapter.ReleaseAdapter` (an instance; adapters import
    neither torch nor Megatron at import time). ``matching_refs``: Megatron-LM git
    refs whose target files were checked to equal the release's (their ``package_info.py`` may
    report another version string; the patch tool goes by file hashes). ``python_floor``: the oldest
    Python the release installs on (its Requires-Python), which its install command and ``gdn-cp
    doctor`` name.
    """

    version: str
    patch_folder: str
    adapter: ReleaseAdapter
    matching_refs: tuple[str, ...] = ()
    python_floor: tuple[int, int] = (3, 12)

    @property
    def requirement(self) -> str:
        """The pip requirement that installs this release, e.g. ``megatron-core==0.19.2``."""
        return f"megatron-core=={self.version}"

    def install_command(self, python_version: tuple[int, int] | None = None, *, reinstall: bool = False) -> str:
        """The pip command that installs this release on ``python_version`` (default: this Python).

        megatron-core 0.19.x declares Python >= 3.12 (:attr:`python_floor`), although its sources run
        on 3.11; there the plain ``pip install`` fails, so the command builds the sdist past that declaration
        (and adds triton, which megatron.core imports), as ``tests/install_deps.sh`` does.
        ``reinstall``: replace an installed copy whose files were changed (pip leaves an installed
        release of the same version alone otherwise); its dependencies are left as they are.
        """
        major_minor = tuple(sys.version_info[:2]) if python_version is None else tuple(python_version)[:2]
        again = "--force-reinstall --no-deps " if reinstall else ""
        if major_minor >= self.python_floor:
            return f"python -m pip install {again}{self.requirement}"
        again = "--force-reinstall " if reinstall else ""
        return (
            f"python -m pip install {again}--no-binary megatron-core --ignore-requires-python --no-deps "
            f"{self.requirement} && python -m pip install --no-deps triton"
        )


PINS: dict[str, Pin] = {
    pin.version: pin
    for pin in (
        Pin(
            version="0.19.2",
            patch_folder="megatron-core-0.19.2",
            adapter=megatron_core_0_19_2.RELEASE,
            # checked by sha256 on a Megatron-LM snapshot: both report 0.19.1 in package_info.py
            matching_refs=("core_r0.19.0", "core_v0.19.0"),
        ),
    )
}

PINNED_VERSION = "0.19.2"
"""The default pin: what gdn-cp's ``megatron`` extra installs and the patch tool applies."""


def get_pin(version: str | None = None) -> Pin:
    """The pin of ``version`` (default :data:`PINNED_VERSION`); ValueError naming the supported ones."""
    key = PINNED_VERSION if version is None else version
    pin = PINS.get(key)
    if pin is None:
        supported = ", ".join(sorted(PINS))
        raise ValueError(
            f"megatron-core {key!r} is not supported by this gdn-cp (supported: {supported}); "
            f"install one of those ({get_pin().requirement})"
        )
    return pin


def load_adapter(version: str | None = None) -> ReleaseAdapter:
    """The adapter of the pin of ``version`` (default: the default pin). What the running megatron-core is
    read with is :func:`gdn_cp.pins.lookup.running_release`, not this."""
    return get_pin(version).adapter
