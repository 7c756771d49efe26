"""Which version of a distribution is installed, from package metadata alone (nothing imported): the
one lookup the backends' detectors, ``gdn-cp doctor`` and the version lines of results share."""

from __future__ import annotations

import importlib.metadata
from typing import Optional

__all__ = ["dist_version"]


def dist_version(*names: str) -> Optional[str]:
    """The installed version of the first of ``names`` (distribution names) that is installed, or None."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None
