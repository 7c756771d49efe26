"""The one rule for integer arguments and the one place for size limits, shared by every layer
(imports nothing of gdn_cp).

An integer argument (a size, a rank, a head count, a width) takes what Python itself takes as an
integer index (``operator.index``: ``int``, NumPy integers, 0-d integer arrays), never a bool
(``True`` is not a size) and never a torch tensor (reading a CUDA tensor's value would
synchronize the device; pass ``int(t)`` where that is meant). Callers keep their own messages,
which name their own argument: :func:`as_int` only says whether, and as which int.

The limits of process-group sizes live here, once: every function and command that takes a CP or
TP size (the layout functions, ``resolve_linear_cp_mode`` and the config hook, ``gdn-cp doctor`` /
``route``) refuses a larger one, naming the argument and the limit.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

__all__ = ["MAX_CP_SIZE", "MAX_TP_SIZE", "as_int", "size_limit_problem"]

MAX_CP_SIZE = 1 << 16
"""Largest CP size accepted anywhere: plans hold per-peer lists of ``cp`` entries (a larger group is
a mistake, not a cluster), and ranks are radix-sorted as int16 below this size."""

MAX_TP_SIZE = 1 << 16
"""Largest TP size accepted anywhere (TP and CP ranks together are processes of one job)."""


def as_int(value: Any) -> Optional[int]:
    """``value`` as a Python int when it is an integer by the rule above, else None."""
    if isinstance(value, bool) or type(value).__name__ in ("bool", "bool_"):  # numpy.bool / numpy.bool_
        return None
    if type(value).__module__.split(".")[0] == "torch":
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def size_limit_problem(value: int, limit: int, what: str) -> Optional[str]:
    """Why ``value`` (an int already checked >= 1) is over ``limit``, or None: the one wording of
    every size limit (``what``: e.g. ``"CP group"``)."""
    if value > limit:
        return f"larger than any {what} gdn-cp plans for (at most {limit})"
    return None
