"""Empty sequences around kernels that take only non-empty ones (FLA's and FlashQLA's).

The contract lets ``cu_seqlens`` hold empty sequences (a rank's slice may cut a document to zero
rows, padding segments are empty); the CUDA kernels want every sequence to hold rows. A backend
passes them ``cu.nonempty()`` and maps the states of the sequences it kept with these two
functions: an empty sequence's final state is its initial state (zeros without one).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["kept_initial_states", "all_final_states"]


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
