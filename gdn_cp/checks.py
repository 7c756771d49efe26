"""The one rule for integer arguments, shared by every layer (imports nothing of gdn_cp).

An integer argument (a size, a rank, a head count, a width) takes what Python itself takes as an
integer index (``operator.index``: ``int``, NumPy integers, 0-d integer arrays), never a bool
(``True`` is not a size) and never a torch tensor (reading a CUDA tensor's value would
synchronize the device; pass ``int(t)`` where that is meant). Callers keep their own messages,
which name their own argument: :func:`as_int` only says whether, and as which int.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

__all__ = ["as_int"]


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
