"""Empty sequences around kernels that take only non-empty ones (FLA's and FlashQLA's), written once.

The contract lets ``cu_seqlens`` hold empty sequences (a rank's slice may cut a document to zero
rows, padding segments are empty); the CUDA kernels want every sequence to hold rows. A backend
wraps its kernel call in :func:`varlen_gated_delta_rule`, which passes it ``cu.nonempty()`` and maps
the states of the sequences it kept: an empty sequence's final state is its initial state (zeros
without one).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..layout.boundaries import Boundaries

__all__ = ["all_final_states", "kept_initial_states", "varlen_gated_delta_rule"]


def kept_initial_states(initial_state: Optional[torch.Tensor], keep: Sequence[int], n_all: int):
    """``initial_state [n_all, Hv, Dk, Dv]`` -> the rows of the kept sequences ``[len(keep), ...]``
    in fp32, contiguous (None stays None)."""
    if initial_state is None:
        return None
    h0 = initial_state.float()
    if len(keep) != n_all:
        h0 = torch.stack([h0[i] for i in keep], dim=0)
    return h0.contiguous()


def all_final_states(final: torch.Tensor, keep: Sequence[int], n_all: int,
                     initial_state: Optional[torch.Tensor]) -> torch.Tensor:
    """The kernel's final states of the kept sequences ``[len(keep), Hv, Dk, Dv]`` -> one per
    sequence of the boundaries ``[n_all, ...]``: an empty sequence passes its initial state
    through unchanged (zeros without one)."""
    if len(keep) == n_all:
        return final
    pos = {seq: j for j, seq in enumerate(keep)}
    rows = []
    for i in range(n_all):
        if i in pos:
            rows.append(final[pos[i]])
        elif initial_state is not None:
            rows.append(initial_state[i].float())
        else:
            rows.append(final.new_zeros(final.shape[1:]))
    return torch.stack(rows, dim=0)


def varlen_gated_delta_rule(run: Callable, cu: Boundaries, v: torch.Tensor, head_k_dim: int,
                            initial_state: Optional[torch.Tensor], output_final_state: bool):
    """A kernel that takes only non-empty sequences, over boundaries that may hold empty ones.

    ``run(cu_nonempty, h0_kept) -> (o [T, Hv, Dv], final_state of the kept sequences | None)`` calls the
    kernel; ``v [T, Hv, Dv]`` gives the output's shape and dtype. No rows at all: no kernel call, an
    empty output and, asked for, the initial states (zeros without them). Returns ``(o, final_state
    [N, Hv, Dk, Dv] fp32 | None)``, one state per sequence of ``cu``."""
    n_all, hv, dv = cu.num_sequences, v.shape[1], v.shape[2]
    if cu.total == 0:  # no rows at all (every sequence empty)
        o = v.new_empty(0, hv, dv)
        if not output_final_state:
            return o, None
        return o, (initial_state.float() if initial_state is not None
                   else v.new_zeros(n_all, hv, head_k_dim, dv, dtype=torch.float32))
    cu_ne, keep = cu.nonempty()
    o, fs = run(cu_ne, kept_initial_states(initial_state, keep, n_all))
    if not output_final_state:
        return o, None
    return o, all_final_states(fs.float(), keep, n_all, initial_state)  # empty sequences pass their state through
