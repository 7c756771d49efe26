"""Index math only: boundaries, layouts as span lists, routes, plans and their cache.

No torch.distributed and no device work here (device copies of index tensors are made
once per micro-batch, host->device, never read back).

Words (used the same way in ``layout/``, ``modes/`` and ``ops/``):

- *boundaries* (``cu``, ``cu_seqlens``): ``0 = cu[0] <= ... <= cu[-1] = T``; *sequence* i is
  rows ``[cu[i], cu[i+1])`` (empty: a padding slot). Global boundaries cover the whole
  packed stream; local boundaries cover the rows a per-rank op is given, whose sequences
  may be the truncated ends of global ones. :class:`Boundaries` is the checked value.
- *part*: one of the 2*cp equal cuts of a sequence in the zigzag layout; rank r holds
  parts r and 2*cp-1-r.
- *split*: how the zigzag parts were cut from a packed row: ``per_document`` (every sequence
  on its own) or ``whole_row`` (the whole row as one sequence, the sequence boundaries kept
  for the recurrence); :func:`zigzag_cut` gives the boundaries the parts were cut from.
- *span*: consecutive global rows ``[start, start + length)`` (:class:`Spans`); routes,
  layouts and index tensors are lists of spans.
- *slice*: rank r's rows ``[r*T/cp, (r+1)*T/cp)`` in the contiguous layout.
- *transfer*: a span that a route sends to, or receives from, one peer.
- *pad row*: a row added at the end of a document so that its length divides by 2*cp
  (:func:`pad_documents`); the padded boundaries then cover the real and the pad rows.
"""

from .boundaries import (
    PER_DOCUMENT,
    THD_SPLITS,
    WHOLE_ROW,
    Boundaries,
    check_cp,
    check_thd_split,
    host_boundaries,
    sbhd_cu_seqlens,
    validate_cu_seqlens,
    zigzag_cut,
)
from .chunkwise import ChunkwisePlan, build_chunkwise_plan
from .padding import PAD_SOURCE, pad_documents, padded_rank_sources, padded_row_multiple
from .plan import CPPlan, RouteCache, plan_for_sbhd
from .route import NaturalOrder, Route, build_natural_order, build_sbhd_route, build_thd_route
from .spans import CONTIGUOUS, LAYOUTS, ZIGZAG, Spans, expand_spans

__all__ = [
    "CONTIGUOUS",
    "ZIGZAG",
    "PER_DOCUMENT",
    "WHOLE_ROW",
    "THD_SPLITS",
    "check_thd_split",
    "zigzag_cut",
    "LAYOUTS",
    "Boundaries",
    "Spans",
    "expand_spans",
    "check_cp",
    "host_boundaries",
    "validate_cu_seqlens",
    "sbhd_cu_seqlens",
    "Route",
    "build_thd_route",
    "build_sbhd_route",
    "NaturalOrder",
    "build_natural_order",
    "ChunkwisePlan",
    "build_chunkwise_plan",
    "CPPlan",
    "RouteCache",
    "plan_for_sbhd",
    "PAD_SOURCE",
    "pad_documents",
    "padded_rank_sources",
    "padded_row_multiple",
]
