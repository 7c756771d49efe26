"""Which modes a ``gdn-cp run`` can run at its CP sizes: the one rule that the command (before torch is
imported) and the job (before anything is spawned) both check. Torch-free."""

from __future__ import annotations

import math
from typing import Optional

from ..modes.spec import get_mode, head_problem

__all__ = ["named_modes_problem"]


def named_modes_problem(modes: Optional[tuple[str, ...]], cp_sizes: tuple[int, ...], k: int, v: int) -> Optional[str]:
    """The error of a mode named in ``--modes`` that cannot split ``k`` key / ``v`` value heads at one of the
    ``--cp`` sizes (TP=1), naming the fixes; None when every named mode runs at every size (or none is
    named: each is then skipped and listed where it cannot run). Torch-free."""
    if modes is None:
        return None
    bad = [(mode, cp) for mode in modes for cp in cp_sizes
           if head_problem(mode, num_key_heads=k, num_value_heads=v, tp=1, cp=cp) is not None]
    if not bad:
        return None
    mode, _ = bad[0]
    sizes = [cp for m, cp in bad if m == mode]
    need = math.lcm(*cp_sizes)
    return (f"--modes {mode} cannot run at --cp {','.join(map(str, sizes))} with --heads {k},{v}: {mode} needs both "
            f"head counts divisible by {get_mode(mode).divisor_text(1, sizes[0])}; pass --heads {need},{2 * need} "
            f"(divisible by every --cp size), leave {mode} out of --modes (without --modes it is listed as skipped "
            "where it cannot run), or use other --cp sizes")
