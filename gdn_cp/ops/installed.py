"""What is installed: which version of a distribution, from package metadata alone (nothing imported;
the one lookup the backends' detectors, ``gdn-cp doctor`` and the version lines of results share), and
the one log line a backend's kernel stack gets per process."""

from __future__ import annotations

import importlib.metadata
import logging
from typing import Callable, Optional

__all__ = ["dist_version", "log_stack_once"]

logger = logging.getLogger(__name__)
_LOGGED_STACKS: set = set()


def dist_version(*names: str) -> Optional[str]:
    """The installed version of the first of ``names`` (distribution names) that is installed, or None."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def log_stack_once(title: str, stack_report: Callable[[], dict]) -> None:
    """Log a backend's ``stack_report()`` (``{"stack": "fla 0.6.0 + triton 3.7.1", "choices": {name: text}}``:
    which stack this is and what gdn-cp uses of it) at INFO once per process and ``title`` (when the
    backend first runs a kernel)."""
    if title in _LOGGED_STACKS:
        return
    _LOGGED_STACKS.add(title)
    report = stack_report()
    logger.info("%s stack: %s; %s", title, report["stack"],
                "; ".join(f"{name}: {text}" for name, text in report["choices"].items()))
