"""The CP mode registry: every rule about a ``linear_cp_mode`` lives here, in one entry per mode.

Torch-free and Megatron-free, so the patched ``TransformerConfig``, the CLI, ``doctor``, the
dispatch in :mod:`gdn_cp.modes`, tests and benchmarks all read the same table. A new mode is one
file under ``gdn_cp/modes/`` (its cores and a ``prepare(backend, group, plan) -> ModeCall``) plus
one :class:`ModeSpec` entry below, whose ``module`` imports that file on first use.

Head rule: a mode needs ``linear_num_key_heads`` and ``linear_num_value_heads`` divisible by
``head_divisor(tp, cp)`` (``TP*CP`` for headwise, ``TP`` for the others).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from .call import ModeCall

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

    ``divides_by_cp``: heads must divide TP*CP (True) or TP only (False). ``layouts``: the row
    layouts its cores take, ``zigzag`` (Megatron's) first; ``contiguous`` where a caller may move
    the rows itself (names of :mod:`gdn_cp.layout`, spelled out here so that reading the
    registry never imports torch). ``module``: imports the mode's file on first use (a plain
    import statement, which readers and tools follow); the file holds the cores and
    ``prepare(backend, group, plan) -> ModeCall``. ``cost``: one line for ``doctor`` and logs.
    ``auto_rank``: order in which ``auto`` prefers legal modes (lower first; the reasons are in
    :mod:`gdn_cp.megatron.config`).
    """

    name: str
    divides_by_cp: bool
    layouts: tuple[str, ...]
    module: Callable[[], ModuleType]
    cost: str
    auto_rank: int

    def head_divisor(self, tp: int, cp: int) -> int:
        return tp * cp if self.divides_by_cp else tp

    def divisor_text(self, tp: int, cp: int) -> str:
        """``TP*CP=2*4=8`` or ``TP=2``: how messages name the divisor."""
        return f"TP*CP={tp}*{cp}={tp * cp}" if self.divides_by_cp else f"TP={tp}"

    def prepare(self, backend, group, plan) -> ModeCall:
        """This call's way through the mode (:class:`~gdn_cp.modes.call.ModeCall`: its cores, whether
        it moves rows to another layout, which exchange path it takes), decided once on the host
        before any collective; ValueError where a setting cannot be honoured for ``group``."""
        return self.module().prepare(backend, group, plan)


def _headwise() -> ModuleType:
    from . import headwise

    return headwise


def _chunkwise() -> ModuleType:
    from . import chunkwise

    return chunkwise


def _all_gather() -> ModuleType:
    from . import all_gather

    return all_gather


MODES: dict[str, ModeSpec] = {
    spec.name: spec
    for spec in (
        ModeSpec(
            name="headwise",
            divides_by_cp=True,
            layouts=("zigzag",),
            module=_headwise,
            cost="two all-to-alls of every activation; full sequence on 1/cp of the heads",
            auto_rank=1,
        ),
        ModeSpec(
            name="chunkwise",
            divides_by_cp=False,
            layouts=("zigzag", "contiguous"),
            module=_chunkwise,
            cost="CP=1 work on T/cp tokens plus a route all-to-all and a small halo/state exchange",
            auto_rank=0,
        ),
        ModeSpec(
            name="all_gather",
            divides_by_cp=False,
            layouts=("zigzag",),
            module=_all_gather,
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
