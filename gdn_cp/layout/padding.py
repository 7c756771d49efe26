"""Documents padded to the per-document zigzag cut, and which rows of the padded row a rank holds.

The per-document cut (every document in 2*cp equal parts, rank r holding parts r and 2*cp-1-r:
what TransformerEngine's THD attention under CP expects) needs every document length divisible by
2*cp. Packed pretraining rows (Megatron-LM ``--dataloader-inter-document-masking``) hold documents
of any length, so each document gets pad rows *at its end*, only as many as the cut needs (fewer
than 2*cp), and the last document of the row more when the row length must be a multiple of
``row_multiple`` (e.g. sequence parallelism splits each rank's rows over TP). A pad row follows
every real row of its document, so under causal attention, a causal conv and a recurrence that
restarts at each (padded) document start, no real row ever sees a pad: the real rows compute
exactly what they compute unpadded.

Index math only, on the host (int64 numpy, one entry per document; the one per-row step writes the
rank's index tensor once per micro-batch).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from ..checks import as_int
from .boundaries import Boundaries, check_cp
from .spans import expand_spans, zigzag_rank_spans

if TYPE_CHECKING:
    import torch

__all__ = ["PAD_SOURCE", "pad_documents", "padded_row_multiple", "padded_rank_sources"]

PAD_SOURCE = -1
"""The source row :func:`padded_rank_sources` gives a pad row (it has none in the unpadded row)."""


def padded_row_multiple(cp: int, local_multiple: int = 1) -> int:
    """The smallest row length multiple that the per-document cut over ``cp`` ranks accepts (2*cp)
    and that leaves every rank a multiple of ``local_multiple`` rows (e.g. the TP size under
    sequence parallelism): ``lcm(2*cp, cp*local_multiple)``."""
    check_cp(cp)
    if as_int(local_multiple) is None or local_multiple < 1:
        raise ValueError(f"local_multiple must be a positive int, got {local_multiple!r}")
    return math.lcm(2 * cp, cp * local_multiple)


def pad_documents(cu, cp: int, row_multiple: int | None = None, *, name: str = "cu_seqlens") -> Boundaries:
    """The padded boundaries of the documents of ``cu`` (Boundaries or host ints): every document
    length rounded up to a multiple of 2*cp (an empty one stays empty), then the last document
    longer so that the row is a multiple of ``row_multiple`` rows (default 2*cp; a multiple of
    2*cp). Document i starts at ``padded[i]``, its real rows are the first ``cu[i+1]-cu[i]``."""
    check_cp(cp)
    cu = Boundaries(cu, name=name)
    step = 2 * cp
    row_multiple = step if row_multiple is None else row_multiple
    if as_int(row_multiple) is None or row_multiple < 1 or row_multiple % step:
        raise ValueError(f"row_multiple must be a positive multiple of 2*cp={step}, got {row_multiple!r}")
    lengths = np.diff(cu.numpy())
    padded = -(-lengths // step) * step
    if len(padded):
        padded[-1] += -int(padded.sum()) % row_multiple  # a multiple of step: both sums are
    return Boundaries(np.concatenate([[0], np.cumsum(padded)]).astype(np.int64), name=f"{name} (padded)")


def padded_rank_sources(cu, padded, cp: int, rank: int) -> "torch.Tensor":
    """Rank ``rank``'s rows of the padded row cut per document (parts r and 2*cp-1-r of every
    padded document, document after document), as int64 ``[padded.total // cp]`` (CPU): for each
    row, the row of the unpadded packed row it holds, or :data:`PAD_SOURCE` for a pad row.

    ``cu``: the documents' boundaries; ``padded``: :func:`pad_documents` of them (or any padding
    at the documents' ends with lengths divisible by 2*cp)."""
    check_cp(cp, rank)
    cu, padded = Boundaries(cu), Boundaries(padded, name="padded")
    if len(cu) != len(padded):
        raise ValueError(f"cu has {len(cu) - 1} documents and padded {len(padded) - 1}; pass the same documents")
    real, room = np.diff(cu.numpy()), np.diff(padded.numpy())
    if (room < real).any() or (room % (2 * cp)).any():
        i = int(np.argmax((room < real) | (room % (2 * cp) != 0)))
        raise ValueError(f"padded document {i} has {int(room[i])} rows for {int(real[i])} real ones; every padded "
                         f"length must hold its document and divide by 2*cp={2 * cp} (use pad_documents)")
    rows = expand_spans(*_span_arrays(zigzag_rank_spans(padded.numpy(), cp, rank))).numpy()
    doc = np.searchsorted(padded.numpy(), rows, side="right") - 1
    offset = rows - padded.numpy()[doc]
    source = np.where(offset < real[doc], cu.numpy()[doc] + offset, PAD_SOURCE)
    import torch

    return torch.from_numpy(source.astype(np.int64, copy=False))


def _span_arrays(spans):
    return spans.start, spans.length
