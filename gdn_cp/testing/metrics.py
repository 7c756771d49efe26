"""Relative errors: how far a CP (or kernel) result is from its reference.

One family, used by the tests, ``gdn-cp run``, ``gdn-cp selftest`` and the benchmarks:

* :func:`max_rel` = ``max |got - want| / max |want|``: the strict metric of the fp64/fp32 parity
  tests (one bad element shows up at full size);
* :func:`rel_l2` = ``||got - want|| / ||want||`` (a normalized RMS): the metric of bf16 and FLA
  comparisons, where single elements round at 8 bits.

Both compute in fp64 on the CPU (a device->host copy: test code only). They return ``inf`` when a
tensor is missing (``None``, e.g. a gradient that never arrived) or the shapes differ, so a
comparison against a tolerance fails instead of raising. An all-zero reference has no scale: the
error is 0.0 when ``got`` is all zero too, else ``inf``. NaN anywhere gives NaN, which no
``err <= tol`` accepts.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = ["max_rel", "rel_l2", "worst"]


def _pair(got: Optional[torch.Tensor], want: Optional[torch.Tensor]):
    if got is None or want is None or tuple(got.shape) != tuple(want.shape):
        return None
    return got.detach().to("cpu", torch.float64), want.detach().to("cpu", torch.float64)


def _ratio(num: float, den: float) -> float:
    if math.isnan(num) or math.isnan(den):
        return math.nan
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def _relative(got: Optional[torch.Tensor], want: Optional[torch.Tensor], size) -> float:
    """``size(got - want) / size(want)``, with the module docstring's rules for None, shapes, zeros."""
    pair = _pair(got, want)
    if pair is None:
        return math.inf
    a, b = pair
    if b.numel() == 0:
        return 0.0
    return _ratio(size(a - b), size(b))


def max_rel(got: Optional[torch.Tensor], want: Optional[torch.Tensor]) -> float:
    """``max |got - want| / max |want|`` (see the module docstring for None, shapes, zeros)."""
    return _relative(got, want, lambda t: float(t.abs().max()))


def rel_l2(got: Optional[torch.Tensor], want: Optional[torch.Tensor]) -> float:
    """``||got - want||_2 / ||want||_2`` (see the module docstring for None, shapes, zeros)."""
    return _relative(got, want, lambda t: float(t.norm()))


def worst(errors: dict[str, float]) -> tuple[str, float]:
    """``(name, error)`` of the largest error in ``{name: error}`` (NaN counts as the worst)."""
    if not errors:
        return "-", 0.0
    return max(errors.items(), key=lambda kv: math.inf if math.isnan(kv[1]) else kv[1])
