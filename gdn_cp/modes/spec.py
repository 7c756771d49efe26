"""The CP mode registry: every rule about a ``linear_cp_mode`` lives here, in one entry per mode.

Torch-free and Megatron-free, so the patched ``TransformerConfig``, the CLI, ``doctor``, the
modes, tests and benchmarks all read the same table. A new mode is one :class:`ModeSpec` entry
below plus one file under ``gdn_cp/modes/``: a :class:`~gdn_cp.modes.context.Mode` subclass that
names its entry (``spec``), listed in :data:`gdn_cp.modes.entry.MODE_CLASSES`.

Head rule: a mode needs ``linear_num_key_heads`` and ``linear_num_value_heads`` divisible by
``head_divisor(tp, cp)`` (``TP*CP`` for headwise, ``TP`` for the others). The rule (:func:`head_problem`),
``auto``'s choice (:func:`auto_choice`) and their two errors (:func:`heads_error`, :func:`no_legal_mode_error`)
exist here once; the config hook, a layer's checks and the core's entry call them.
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
    "HEAD_FIELDS",
    "auto_choice",
    "head_problem",
    "heads_error",
    "legal_modes",
    "no_legal_mode_error",
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


HEAD_FIELDS = ("linear_num_key_heads", "linear_num_value_heads")
"""What messages call the key and value head counts: the ``TransformerConfig`` fields (the core's entry,
which gets one TP rank's heads in a ``GDNShape``, names its fields instead)."""


def head_problem(name: str, *, num_key_heads: int, num_value_heads: int, tp: int, cp: int,
                 fields: tuple[str, str] = HEAD_FIELDS) -> Optional[str]:
    """Why mode ``name`` cannot run these heads at this TP / CP, or None when it can: the one head rule.

    Arguments are trusted positive ints (validate them at the boundary that received them); ``fields`` names
    the two head counts in the text.
    """
    spec = get_mode(name)
    div = spec.head_divisor(tp, cp)
    bad = [
        f"{field}={value} is not divisible by {spec.divisor_text(tp, cp)}"
        for field, value in zip(fields, (num_key_heads, num_value_heads))
        if value % div
    ]
    return "; ".join(bad) if bad else None


def legal_modes(k: int, v: int, tp: int, cp: int) -> list[str]:
    """The modes that can run ``k`` key and ``v`` value heads at this TP / CP, in the registry's order."""
    return [m for m in MODE_NAMES if head_problem(m, num_key_heads=k, num_value_heads=v, tp=tp, cp=cp) is None]


def _fix_hint(mode: str, k: int, v: int, tp: int, cp: int) -> str:
    """What to change so that ``mode`` (illegal for these heads) or another mode works."""
    others = [m for m in legal_modes(k, v, tp, cp) if m != mode]
    own = (
        "choose tensor_model_parallel_size * context_parallel_size dividing both head counts"
        if get_mode(mode).divides_by_cp
        else "choose a tensor_model_parallel_size that divides both head counts"
    )
    if not others:
        return own
    return f"set linear_cp_mode to {' or '.join(repr(m) for m in others)}, which these heads allow, or {own}"


def heads_error(mode: str, *, num_key_heads: int, num_value_heads: int, tp: int, cp: int,
                fields: tuple[str, str] = HEAD_FIELDS, sizes: Optional[str] = None) -> Optional[ValueError]:
    """The error for a concrete ``mode`` that cannot split these heads (:func:`head_problem`), with the sizes
    and the fix (the legal modes, or the sizes to choose); None when it can. ``sizes`` says where TP and CP
    come from (default: ``tensor_model_parallel_size=.., context_parallel_size=..``)."""
    problem = head_problem(mode, num_key_heads=num_key_heads, num_value_heads=num_value_heads, tp=tp, cp=cp,
                           fields=fields)
    if problem is None:
        return None
    where = sizes or f"tensor_model_parallel_size={tp}, context_parallel_size={cp}"
    return ValueError(f"linear_cp_mode={mode!r} with {where}: {problem}. "
                      f"Fix: {_fix_hint(mode, num_key_heads, num_value_heads, tp, cp)}.")


def no_legal_mode_error(k: int, v: int, tp: int, cp: int, *, context: str = "") -> ValueError:
    """The error for ``linear_cp_mode='auto'`` where no mode can split these heads: every mode's problem, in
    the order ``auto`` tries them, and the fix. ``context`` (e.g. which config asked) ends the message."""
    problems = [f"{s.name} is illegal ({head_problem(s.name, num_key_heads=k, num_value_heads=v, tp=tp, cp=cp)})"
                for s in sorted(MODES.values(), key=lambda s: s.auto_rank)]
    return ValueError(f"linear_cp_mode='auto': no mode is legal: {'; '.join(problems)}. Fix: choose a "
                      f"tensor_model_parallel_size that divides both head counts{f' ({context})' if context else ''}.")


def auto_choice(k: int, v: int, tp: int, cp: int, *, context: str = "") -> tuple[str, str]:
    """``auto``: the first legal mode in the registry's ``auto_rank`` order, from the sizes alone (a few
    integer checks). Returns ``(mode, reason)``; :func:`no_legal_mode_error` when there is none."""
    skipped: list[str] = []
    ordered = sorted(MODES.values(), key=lambda s: s.auto_rank)
    order = ", ".join(s.name for s in ordered)
    for spec in ordered:
        problem = head_problem(spec.name, num_key_heads=k, num_value_heads=v, tp=tp, cp=cp)
        if problem is not None:
            skipped.append(f"{spec.name} is illegal ({problem})")
            continue
        chosen = f"the first legal mode of {order}: heads divisible by {spec.divisor_text(tp, cp)}; {spec.cost}"
        return spec.name, "; ".join(skipped + [chosen])
    raise no_legal_mode_error(k, v, tp, cp, context=context)
