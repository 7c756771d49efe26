"""The CP mode registry: every rule about a ``linear_cp_mode`` lives here, in one entry per mode.

Torch-free and Megatron-free, so the patched ``TransformerConfig``, the CLI, ``doctor``, the
dispatch in :mod:`gdn_cp.modes`, tests and benchmarks all read the same table. A new mode is one
file under ``gdn_cp/modes/`` holding its core plus one :class:`ModeSpec` entry below.

Head rule: a mode needs ``linear_num_key_heads`` and ``linear_num_value_heads`` divisible by
``head_divisor(tp, cp)`` (``TP*CP`` for headwise, ``TP`` for the others).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Callable, Optional

__all__ = [
    "AUTO",
    "MODE_NAMES",
    "MODE_CHOICES",
    "ModeSpec",
    "MODES",
    "get_mode",
    "head_problem",
]

AUTO = "auto"


@dataclass(frozen=True)
class ModeSpec:
    """One CP mode.

    ``divides_by_cp``: heads must divide TP*CP (True) or TP only (False).
    ``cores``: ``(layout, "module:function")`` pairs, the core that takes rows in that layout
    (``zigzag`` always, first; ``contiguous`` when the caller may swap layouts outside the
    core), imported on first use so that reading the registry never imports torch. Every core
    is called as ``core(qkv, g, beta, conv_weight, conv_bias, *, shape, plan, group, backend)``
    by :func:`gdn_cp.modes.gdn_core`. ``cost``: one line for ``doctor`` and logs.
    ``auto_rank``: order in which ``auto`` prefers legal modes (lower first; the reasons are in
    :mod:`gdn_cp.megatron.config`).
    """

    name: str
    divides_by_cp: bool
    cores: tuple[tuple[str, str], ...]
    cost: str
    auto_rank: int

    @property
    def layouts(self) -> tuple[str, ...]:
        """Row layouts the mode takes (``zigzag`` first)."""
        return tuple(layout for layout, _ in self.cores)

    def head_divisor(self, tp: int, cp: int) -> int:
        return tp * cp if self.divides_by_cp else tp

    def divisor_text(self, tp: int, cp: int) -> str:
        """``TP*CP=2*4=8`` or ``TP=2``: how messages name the divisor."""
        return f"TP*CP={tp}*{cp}={tp * cp}" if self.divides_by_cp else f"TP={tp}"

    def core_fn(self, layout: str = "zigzag") -> Callable:
        """The core for rows in ``layout`` (ValueError naming the layouts this mode takes)."""
        for name, target in self.cores:
            if name == layout:
                return _load(target)
        raise ValueError(f"linear_cp_mode={self.name!r} takes rows in {self.layouts}, not {layout!r}")


@functools.lru_cache(maxsize=None)
def _load(target: str) -> Callable:
    """``"module:function"`` -> the function (imported once; later layer calls import nothing)."""
    module, _, fn = target.partition(":")
    return getattr(importlib.import_module(module), fn)


MODES: dict[str, ModeSpec] = {
    spec.name: spec
    for spec in (
        ModeSpec(
            name="headwise",
            divides_by_cp=True,
            cores=(("zigzag", "gdn_cp.modes.headwise:headwise_core"),),
            cost="two all-to-alls of every activation; full sequence on 1/cp of the heads",
            auto_rank=1,
        ),
        ModeSpec(
            name="chunkwise",
            divides_by_cp=False,
            cores=(
                ("zigzag", "gdn_cp.modes.chunkwise:chunkwise_core"),
                ("contiguous", "gdn_cp.modes.chunkwise:contiguous_core"),
            ),
            cost="CP=1 work on T/cp tokens plus a route all-to-all and a small halo/state exchange",
            auto_rank=0,
        ),
        ModeSpec(
            name="all_gather",
            divides_by_cp=False,
            cores=(("zigzag", "gdn_cp.modes.all_gather:all_gather_core"),),
            cost="cp x the compute and O(T) activation memory (the fallback of last resort)",
            auto_rank=2,
        ),
    )
}

MODE_NAMES: tuple[str, ...] = tuple(MODES)
MODE_CHOICES: tuple[str, ...] = MODE_NAMES + (AUTO,)


def get_mode(name) -> ModeSpec:
    """The spec of a concrete mode; ValueError naming the legal values otherwise."""
    spec = MODES.get(name) if isinstance(name, str) else None
    if spec is None:
        legal = ", ".join(repr(m) for m in MODE_NAMES)
        extra = f" ('{AUTO}' must be resolved first)" if name == AUTO else ""
        raise ValueError(f"linear_cp_mode={name!r} is not a concrete mode{extra}; use one of {legal}")
    return spec


def head_problem(name: str, *, num_key_heads: int, num_value_heads: int, tp: int, cp: int) -> Optional[str]:
    """Why mode ``name`` cannot run these heads at this TP / CP, or None when it can.

    Arguments are trusted positive ints (validate them at the boundary that received them).
    """
    spec = get_mode(name)
    div = spec.head_divisor(tp, cp)
    bad = [
        f"{field}={value} is not divisible by {spec.divisor_text(tp, cp)}"
        for field, value in (("linear_num_key_heads", num_key_heads), ("linear_num_value_heads", num_value_heads))
        if value % div
    ]
    return "; ".join(bad) if bad else None
