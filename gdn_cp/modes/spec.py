"""The CP mode registry: every rule about a ``linear_cp_mode`` lives here, in one entry per mode.

Torch-free and Megatron-free, so the patched ``TransformerConfig``, the CLI, ``doctor``, the
modes, tests and benchmarks all read the same table. A new mode is one :class:`ModeSpec` entry
below plus one file under ``gdn_cp/modes/``: a :class:`~gdn_cp.modes.context.Mode` subclass that
names its entry (``spec``), listed in :data:`gdn_cp.modes.entry.MODE_CLASSES`.

Head rule: a mode needs ``linear_num_key_heads`` and ``linear_num_value_heads`` divisible by
``head_divisor(tp, cp)`` (``TP*CP`` for headwise, ``TP`` for the others).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

__all__ = [
    "AUTO",
    "MODE_NAMES",
    "MODE_CHOICES",
    "ModeSpec",
    "MODES",
    "get_mode",
    "head_problem",
    "unknown_mode_error",
]

AUTO = "auto"


@dataclass(frozen=True)
class ModeSpec:
    """One CP mode.

    ``divides_by_cp``: heads must divide TP*CP (True) or TP only (False). ``cost``: one line for
    ``doctor`` and logs. ``auto_rank``: order in which ``auto`` prefers legal modes (lower first;
    the reasons are in :mod:`gdn_cp.megatron.config`).
    """

    name: str
    divides_by_cp: bool
    cost: str
    auto_rank: int

    def head_divisor(self, tp: int, cp: int) -> int:
        return tp * cp if self.divides_by_cp else tp

    def divisor_text(self, tp: int, cp: int) -> str:
        """``TP*CP=2*4=8`` or ``TP=2``: how messages name the divisor."""
        return f"TP*CP={tp}*{cp}={tp * cp}" if self.divides_by_cp else f"TP={tp}"


MODES: dict[str, ModeSpec] = {
    spec.name: spec
    for spec in (
        ModeSpec(
            name="headwise",
            divides_by_cp=True,
            cost="two all-to-alls of every activation; full sequence on 1/cp of the heads",
            auto_rank=1,
        ),
        ModeSpec(
            name="chunkwise",
            divides_by_cp=False,
            cost="CP=1 work on T/cp tokens plus a route all-to-all and a small halo/state exchange",
            auto_rank=0,
        ),
        ModeSpec(
            name="all_gather",
            divides_by_cp=False,
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


def unknown_mode_error(mode: Any) -> ValueError:
    """The error for a ``linear_cp_mode`` that is neither a mode nor ``auto``."""
    return ValueError(
        f"linear_cp_mode={mode!r} is not a known mode; set it to one of {', '.join(map(repr, MODE_CHOICES))} "
        f"(Megatron-LM: --linear-cp-mode {{{','.join(MODE_CHOICES)}}})."
    )


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
