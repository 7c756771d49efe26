"""What every fuzz test shares: hypothesis settings, hostile values, and the one rule they check.

The rule (issue #14): a call either succeeds with a result that an independent check accepts, or
raises ValueError / TypeError whose message names the bad argument; never another exception,
never a hang, never a plausible wrong answer.

Settings: derandomized (the same examples on every run, so CI is reproducible) with a small
``max_examples`` to keep the whole fuzz suite under a minute of CI. ``GDN_CP_FUZZ_EXAMPLES=N``
runs N examples per test with fresh random inputs instead (a longer local hunt; hypothesis
prints the failing example and how to reproduce it).
"""

from __future__ import annotations

import math
import re

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from gdn_cp_testing import env

_FUZZ_EXAMPLES = env.read("GDN_CP_FUZZ_EXAMPLES") or 0  # a bad value: a ValueError naming the variable


def fuzz_settings(ci_examples: int):
    """``ci_examples`` derandomized examples in CI; ``GDN_CP_FUZZ_EXAMPLES`` random ones when set."""
    return settings(
        max_examples=_FUZZ_EXAMPLES or ci_examples,
        derandomize=not _FUZZ_EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


# ------------------------------------------------------------------------------------------
# the rule
# ------------------------------------------------------------------------------------------
class Refused(Exception):
    """Not raised: returned by :func:`outcome` for a call that raised ValueError / TypeError."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


def outcome(call):
    """``call()``'s result, or :class:`Refused` for a ValueError / TypeError. Any other exception
    propagates and fails the test: that is a bug the fuzzing found."""
    try:
        return call()
    except (ValueError, TypeError) as err:
        return Refused(err)


def assert_refused_naming(result, *names: str) -> None:
    """``result`` is a refusal whose message names one of ``names``."""
    assert isinstance(result, Refused), f"accepted an input it must refuse (naming {names}): got {result!r:.300}"
    message = str(result.error)
    assert any(n in message for n in names), f"the message does not name {names}: {message!r}"


def assert_accepted(result):
    assert not isinstance(result, Refused), f"refused a valid input: {type(result.error).__name__}: {result.error}"
    return result


# ------------------------------------------------------------------------------------------
# hostile values
# ------------------------------------------------------------------------------------------
HUGE_INTS = [2**31, 2**62, 2**62 + 1, 2**63 - 1, 2**63, 2**64, 10**30, -(2**63), -(10**30)]


def hostile_scalars() -> st.SearchStrategy:
    """Things passed where an int, a bool, a str or a tensor belongs: each of the wrong kind,
    sign or size somewhere."""
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-5, 70),
        st.sampled_from(HUGE_INTS),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from([2.0, 2.5, -1.0, math.nan, math.inf]),
        st.text(max_size=6),
        st.sampled_from(["2", "cuda", "auto", "headwise", "", "zigzag"]),
        st.sampled_from([np.int64(2), np.int32(4), np.float64(2.0), np.bool_(True)]),
        st.lists(st.integers(-3, 9), max_size=3),
        st.builds(lambda: object()),
    )


# ------------------------------------------------------------------------------------------
# independent rules (written from the documentation, not from the code)
# ------------------------------------------------------------------------------------------
MAX_ROWS = 2**62
MAX_CP = 2**16
MAX_TP = 2**16  # README: a CP or TP size above 65536 is refused


def is_int(value) -> bool:
    """What sizes, ranks and counts must be: an int or a NumPy integer (what Python itself takes as
    an index), not a bool (docs/errors.md)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_index_int(value) -> bool:
    """An int or numpy integer, not a bool (what a boundaries entry may be)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def boundaries_values(values):
    """The ints of ``values`` when it is a list, tuple, range or integer numpy array of them, else None."""
    if isinstance(values, np.ndarray):
        return [int(v) for v in values] if values.ndim == 1 and values.dtype.kind in "iu" else None
    if isinstance(values, (list, tuple, range)) and all(is_index_int(v) for v in values):
        return [int(v) for v in values]
    return None


def boundaries_rule(cu) -> bool:
    """The documented boundaries rule: ``0 = cu[0] <= ... <= cu[-1] <= 2**62``, at least 2 entries."""
    return len(cu) >= 2 and cu[0] == 0 and all(a <= b for a, b in zip(cu, cu[1:])) and cu[-1] <= MAX_ROWS


def zigzag_rule(cu, cp) -> bool:
    """Boundaries a zigzag split over cp ranks takes: any at cp=1 (nothing is cut)."""
    cp = int(cp)  # a NumPy cp: this rule's own math on Python ints (np.int32 % 2**31 overflows)
    return boundaries_rule(cu) and (cp == 1 or all((b - a) % (2 * cp) == 0 for a, b in zip(cu, cu[1:])))


def cp_rule(cp) -> bool:
    return is_int(cp) and 1 <= cp <= MAX_CP


def rank_rule(cp, rank) -> bool:
    return is_int(rank) and 0 <= rank < cp


INT_TEXT = re.compile(r"-?[0-9]+")


def cli_int(text: str):
    """The CLI's documented integer syntax: surrounding spaces, a minus sign, ASCII digits."""
    item = text.strip()
    return int(item) if INT_TEXT.fullmatch(item) else None


def cli_int_list(text: str):
    """The CLI's documented list syntax: comma-separated integers, no empty item; None if not."""
    items = [cli_int(v) for v in text.split(",")]
    return None if any(v is None for v in items) else items
