"""chunkwise: each rank computes every head on a contiguous time slice.

zigzag -> contiguous (route all-to-all), then the conv takes its W-1 halo rows from
earlier ranks and the scan takes its initial state from the affine summaries
``S_out = M S_in + S_ext`` of earlier ranks, then contiguous -> zigzag. Per-rank compute
is the CP=1 compute on T/cp tokens (in the generic path here, plus one wider scan on a
rank whose whole slice continues a sequence on both sides, for its transition matrix M).

:meth:`Chunkwise.prepare` decides once per call, host-side and before any collective, from the
settings (``Settings.chunkwise_path``: ``GDN_CP_CHUNKWISE_PATH``), the backend, the group and the
plan, and logs each outcome once:

- the halo/state exchange: the backend's native context-parallel core for the group
  (``backend.native_cp_core``: FLA's cp context on NCCL groups) where the setting is ``auto``
  (default) or ``native`` (a ValueError where there is none), else gdn-cp's own exchange around the
  backend's CP=1 kernels (``generic``; also forced by the setting ``generic``);
- whether rows move at all: where the rows are already one zigzag-cut stream
  (:func:`is_one_zigzag_stream`: the whole packed row cut into 2*cp parts, rank r holding parts r and
  2*cp-1-r: Megatron's SBHD at batch 1, a plan whose split is whole-row, or a single sequence) and
  the backend also has a native zigzag core (``backend.native_zigzag_cp_core``: FLA >= 0.6's zigzag
  cp context), the native path runs on the rows as they are, with no layout all-to-all at all;
- in a Megatron layer, where the rows move (:mod:`gdn_cp.modes.swap`, ``Settings.chunkwise_swap``):
  ``hidden`` moves hidden_states before in_proj and out_proj's output back (:meth:`Chunkwise.run`),
  ``core`` moves q|k|v and the gates around the core.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import partial
from typing import ClassVar, Optional

import torch

from ..comm import (
    all_gather_rows,
    route_all_to_all,
    route_all_to_all_many,
    start_all_gather_rows,
    wait_all_gather_rows,
)
from ..env import CHUNKWISE_PATH_ENV
from ..layout import CONTIGUOUS, WHOLE_ROW, ZIGZAG
from ..layout.chunkwise import ChunkwisePlan
from ..layout.plan import CPPlan
from ..nvtx import phase
from ..ops.contract import NativeCPCore
from ..ops.shape import GDNShape
from .local import conv_split, log_once
from .context import CallContext, Mode
from .spec import MODES
from .packing import sbhd_to_thd, thd_to_sbhd
from .swap import choose_swap_point

__all__ = ["Chunkwise", "gather_halo", "initial_state_from_summaries", "is_one_zigzag_stream", "transition_summary"]

logger = logging.getLogger(__name__)

def is_one_zigzag_stream(plan: CPPlan) -> bool:
    """Whether this rank's zigzag rows are parts r and 2*cp-1-r of the whole packed stream cut as
    one sequence: a plan whose split is whole-row, or one whose only non-empty sequence covers
    every row (SBHD at batch 1, THD with one document), where the per-document cut is the same."""
    if plan.split == WHOLE_ROW:
        return True
    return len(plan.cu.nonempty()[1]) == 1  # cached on the boundaries: one pass per micro-batch


def _native_core(ctx: CallContext) -> Optional[NativeCPCore]:
    """The backend's native core for the call's group as the path setting allows; ValueError for
    ``native`` where there is none."""
    setting, backend = ctx.settings.chunkwise_path, ctx.backend
    native = None if setting == "generic" else backend.native_cp_core(ctx.group)
    if setting == "native" and native is None:
        raise ValueError(
            f"chunkwise path 'native' ({CHUNKWISE_PATH_ENV} or gdn_core's chunkwise_path) but the "
            f"{backend.spec.title} backend has no native CP core for this "
            "group (FLA's cp context needs a CUDA device, FLA >= 0.4.2 and an NCCL group); set 'auto' or 'generic'"
        )
    why = ("the backend's cp context" if native is not None else
           "gdn-cp's own exchange" + (" (setting)" if setting == "generic" else ": no native core for this group"))
    log_once(logger, ("path", setting, native is not None), "chunkwise halo/state exchange: %s path (setting %s; %s)",
              "native" if native is not None else "generic", setting, why)
    return native


def _zigzag_core(ctx: CallContext) -> Optional[NativeCPCore]:
    """The backend's native core on the zigzag rows as they are, where they are one zigzag-cut
    stream and the backend has one (FLA >= 0.6), else None (logged once per outcome)."""
    if not is_one_zigzag_stream(ctx.plan):
        return None
    zigzag = ctx.backend.native_zigzag_cp_core(ctx.group)
    log_once(logger, ("zigzag", ctx.settings.chunkwise_path, zigzag is not None),
              "chunkwise halo/state exchange: %s path (setting %s; %s)",
              "native-zigzag" if zigzag is not None else "native-contiguous", ctx.settings.chunkwise_path,
              "rows are one zigzag-cut stream: no layout all-to-all" if zigzag is not None else
              "rows are one zigzag-cut stream, but the backend's cp context takes no zigzag layout (FLA < 0.6): "
              "routed to the contiguous layout")
    return zigzag


def _swap_point(ctx: CallContext) -> str:
    """Where a layer's rows move (``hidden`` or ``core``): :mod:`gdn_cp.modes.swap`'s rule, logged
    once per layer and outcome."""
    layer = ctx.layer
    choice = choose_swap_point(shape=ctx.shape, hidden_size=layer.hidden_size, tp=layer.tp,
                               sequence_parallel=layer.sequence_parallel, act_bytes=layer.act_bytes,
                               requested=ctx.settings.chunkwise_swap)
    log_once(logger, ("swap", layer.label, choice.point, choice.reason),
              "%s layout swap at %s (%s; core %d B/token, hidden %s B/token, stock headwise %d B/token)",
              layer.label, choice.point, choice.reason, choice.core_bytes, choice.hidden_bytes,
              choice.stock_headwise_bytes)
    return choice.point


@dataclass(frozen=True)
class Chunkwise(Mode):
    """One call's way through chunkwise (made by :meth:`prepare`).

    ``path``: ``native`` (the backend's cp context), ``native-zigzag`` (its zigzag context on the
    rows as they are) or ``generic`` (gdn-cp's own exchange). ``native`` / ``zigzag``: the
    backend's cores for those paths, else None. ``swap``: where :meth:`run` moves a layer's rows,
    ``hidden`` or ``core``; None where nothing moves (the zigzag core) or there is no layer.
    """

    spec: ClassVar = MODES["chunkwise"]
    path: str
    native: Optional[NativeCPCore]
    zigzag: Optional[NativeCPCore]
    swap: Optional[str]

    @classmethod
    def prepare(cls, ctx: CallContext) -> Chunkwise:
        native = _native_core(ctx)
        zigzag = None if native is None else _zigzag_core(ctx)
        if zigzag is not None:
            return cls("native-zigzag", native, zigzag, None)
        return cls("generic" if native is None else "native", native, None,
                   None if ctx.layer is None else _swap_point(ctx))

    def core(self, ctx: CallContext, qkv, g, beta, conv_weight, conv_bias) -> torch.Tensor:
        """zigzag rows in and out: the zigzag core on the rows as they are, else the routes around
        the contiguous core."""
        plan, group = ctx.plan, ctx.group
        if self.zigzag is not None:
            return self.zigzag(qkv, g, beta, conv_weight, conv_bias, shape=ctx.shape, cu_seqlens_global=plan.cu,
                               group=group, cache=plan.backend_cache)
        to_c, to_z = plan.route(ZIGZAG, CONTIGUOUS), plan.route(CONTIGUOUS, ZIGZAG)
        # q|k|v and both gates in one all-to-all per direction (bytes packed side by side, exact)
        qkv_c, g_c, beta_c = route_all_to_all_many((qkv, g, beta), to_c, to_z, group)
        o_c = self.contiguous_core(ctx, qkv_c, g_c, beta_c, conv_weight, conv_bias)
        return route_all_to_all(o_c, to_z, to_c, group)

    def run(self, ctx: CallContext, hidden: torch.Tensor, segment):
        """The layer on contiguous rows where the swap is at ``hidden``: hidden_states
        ``[S_local, B, H]`` move zigzag -> contiguous as packed rows ``[T_local, 1, H]``, the layer's
        per-token work and the contiguous core run there, out_proj's output moves back. Otherwise
        the default: :meth:`core` moves what it moves."""
        if self.swap != "hidden":
            return super().run(ctx, hidden, segment)
        plan, group = ctx.plan, ctx.group
        to_c, to_z = plan.route(ZIGZAG, CONTIGUOUS), plan.route(CONTIGUOUS, ZIGZAG)
        moved = route_all_to_all(sbhd_to_thd(hidden), to_c, to_z, group).unsqueeze(1)
        x = segment.project(moved)
        o = self.contiguous_core(ctx, x.qkv, x.g, x.beta, segment.conv_weight, segment.conv_bias)
        out, out_bias = segment.finish(o, x.gate, 1)
        out = route_all_to_all(out.reshape(-1, out.shape[-1]), to_z, to_c, group)
        return thd_to_sbhd(out, hidden.shape[1]), out_bias

    def contiguous_core(self, ctx: CallContext, qkv_c, g_c, beta_c, conv_weight, conv_bias) -> torch.Tensor:
        """The chunkwise core on rows in the contiguous layout; returns contiguous rows. The native
        core where the call has one, else gdn-cp's halo and state summary exchange around the
        backend's CP=1 kernels (same results)."""
        plan, group, shape, backend = ctx.plan, ctx.group, ctx.shape, ctx.backend
        if self.native is not None:
            with phase("native core"):  # the backend's cp context: conv with halo, scan with state exchange
                return self.native(qkv_c, g_c, beta_c, conv_weight, conv_bias, shape=shape,
                                   cu_seqlens_global=plan.cu, group=group, cache=plan.backend_cache)
        cw = plan.chunkwise(conv_weight.shape[1])
        straddles = cw.any_straddle  # same on every rank: all skip the exchanges together
        halo = None
        if straddles and cw.conv_width > 1:
            index = plan.cached_on(("halo_index", cw.conv_width), qkv_c.device, lambda: halo_gather_index(cw))
            with phase("halo"):
                qkv_c, halo = gather_halo(qkv_c, cw, index, group)
        x = conv_split(qkv_c, conv_weight, conv_bias, shape=shape, cu_seqlens=cw.local_cu, backend=backend,
                       glue=ctx.settings.glue, halo=halo)
        if not straddles:
            with phase("core"):
                o_c, _ = backend.chunk_gated_delta_rule(x.q, x.k, x.v, g_c, beta_c, cu_seqlens=cw.local_cu,
                                                        use_qk_l2norm=x.kernel_l2norm)
            return o_c
        # where conv_split normalized q and k, the scans take them as they are
        with phase("core + state exchange"):
            return _scan_with_carried_state(x.q, x.k, x.v, g_c, beta_c, cw, backend, group,
                                            replace(shape, qk_l2norm=x.kernel_l2norm))


def gather_halo(x: torch.Tensor, cw: ChunkwisePlan, index: torch.Tensor, group):
    """``(x, halo)``: ``x`` for the conv to read, and the W-1 pre-conv rows before this rank's first row,
    from the ranks that hold them.

    ``x [T_local, C]`` rows (any row stride). All ranks all-gather their tails ``[W-1, C]`` (rows before a
    rank's own first row are zeros); each picks its halo rows ``[W-1, C]`` from them. ``index [W-1]``:
    :func:`halo_gather_index` on x's device. The conv must read the returned ``x``: its gradient and the
    tail's meet in one node (:class:`_TailOf`), so the tail's gradient is added into W-1 rows of the
    conv's instead of through a zero-filled ``[T_local, C]`` gradient of the slice and a full-size sum.
    """
    w1 = cw.conv_width - 1
    if x.shape[0] >= w1:
        x, tail = _TailOf.apply(x, w1)
    else:
        tail = torch.cat([x.new_zeros(w1 - x.shape[0], x.shape[1]), x])
    tails = all_gather_rows(tail, group)  # [cp*(W-1), C]
    tails = torch.cat([tails, tails.new_zeros(1, tails.shape[1])])  # last row: zeros
    return x, tails.index_select(0, index)


class _TailOf(torch.autograd.Function):
    """``x [T, C]`` -> ``(x, x[-n:] [n, C] contiguous)``; backward adds the tail's gradient into the last n
    rows of x's: in place where x's gradient is rows of its own (the conv's fresh input gradient, or a
    slice of one), on a copy where it is an expanded (stride 0) tensor."""

    @staticmethod
    def forward(ctx, x, n: int):
        ctx.n, ctx.shape = n, x.shape
        return x.view_as(x), x[-n:].contiguous()

    @staticmethod
    def backward(ctx, grad_x, grad_tail):
        if grad_tail is None:
            return grad_x, None
        if grad_x is None:
            grad_x = grad_tail.new_zeros(ctx.shape)
        elif 0 in grad_x.stride():
            grad_x = grad_x.contiguous()
        grad_x[-ctx.n:].add_(grad_tail)
        return grad_x, None


def halo_gather_index(cw: ChunkwisePlan) -> torch.Tensor:
    """Rows of the gathered tails (plus one zero row at the end) that form the halo."""
    zero_row = cw.cp_size * (cw.conv_width - 1)
    return torch.tensor([i if i >= 0 else zero_row for i in cw.halo_index], dtype=torch.long)


def _keep_in_graph(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``x``, with ``like`` attached to its autograd graph (adds ``0 * like.sum()``).

    Collectives inside autograd must run in the same order on every rank. A rank whose
    summary is all zeros, or that composes no earlier state, must still send its
    gathered tensors through the graph, or its backward would skip the reduce-scatter
    that the other ranks wait in.
    """
    return x + (like.sum() * 0).to(x.dtype)


def transition_summary(q, k, v, g, beta, cu, backend, state_dtype, qk_l2norm: bool) -> torch.Tensor:
    """``[Hv, Dk, Dk+Dv]``: ``[M | S_ext]`` of rows (one sequence, boundaries ``cu``) that
    continue a sequence on both sides.

    The scan is linear in (S_in, v) column by column, so one scan with
    ``v' = [0 | v]`` and initial state ``[I | 0]`` returns ``[M | S_ext]``.
    """
    n, hv, dk, dv = v.shape[0], v.shape[1], q.shape[2], v.shape[2]
    v_aug = torch.cat([v.new_zeros(n, hv, dk), v], dim=-1)
    eye = torch.eye(dk, dtype=state_dtype, device=v.device).expand(1, hv, dk, dk)
    init = torch.cat([eye, eye.new_zeros(1, hv, dk, dv)], dim=-1)
    _, final = backend.chunk_gated_delta_rule(
        q, k, v_aug, g, beta, cu_seqlens=cu, initial_state=init, output_final_state=True, use_qk_l2norm=qk_l2norm,
    )
    return final[0].to(state_dtype)


def _scan_after_parallel_summary(rows, cw: ChunkwisePlan, scan, summarize, group, shape: GDNShape, state_dtype, v):
    """:func:`_scan_with_carried_state` with a backend that summarizes a piece without scanning
    it: summary, gather started, rows ``[split, T_local)`` scanned in one call, gather waited
    for, head scanned from its composed initial state."""
    dk, hv, dv = shape.head_k_dim, v.shape[1], v.shape[2]
    if cw.last_is_first:
        _, k, vv, g, beta = rows(0, None)
        summary = summarize(k, vv, g, beta, cu_seqlens=cw.local_cu, use_qk_l2norm=shape.qk_l2norm)[-1]
    elif cw.tail_cu is not None:
        _, k, vv, g, beta = rows(cw.tail_split, None)
        ext = summarize(k, vv, g, beta, cu_seqlens=cw.tail_cu, use_qk_l2norm=shape.qk_l2norm)[-1, ..., dk:]
        summary = torch.cat([torch.zeros(hv, dk, dk, dtype=state_dtype, device=v.device), ext.to(state_dtype)], -1)
    else:
        summary = _keep_in_graph(torch.zeros(hv, dk, dk + dv, dtype=state_dtype, device=v.device), v)
    flight = start_all_gather_rows(summary.to(state_dtype).unsqueeze(0), group)
    o_rest = None
    if cw.rest_cu is not None:
        o_rest, _ = scan(*rows(cw.split, None), cu_seqlens=cw.rest_cu)
    s_in = initial_state_from_summaries(wait_all_gather_rows(flight), cw, dk)
    if not cw.first_continues:
        return _keep_in_graph(o_rest, s_in)
    o_head, _ = scan(*rows(0, cw.split), cu_seqlens=cw.head_cu, initial_state=s_in.unsqueeze(0))
    return o_head if o_rest is None else torch.cat([o_head, o_rest])


def initial_state_from_summaries(summaries: torch.Tensor, cw: ChunkwisePlan, dk: int) -> torch.Tensor:
    """Compose earlier ranks' ``[M | S_ext]`` (``summaries [cp, Hv, Dk, Dk+Dv]``) in rank order.

    Returns ``[Hv, Dk, Dv]``: zeros (still in the graph, see :func:`_keep_in_graph`) when
    the first local sequence starts on this rank.
    """
    state = summaries[0, ..., dk:] * 0
    for q in cw.compose_ranks:
        m, ext = summaries[q, ..., :dk], summaries[q, ..., dk:]
        state = torch.matmul(m, state) + ext
    return state


def _scan_with_carried_state(q, k, v, g, beta, cw: ChunkwisePlan, backend, group, shape: GDNShape):
    """The scan of a slice whose first local sequence may continue an earlier rank's.

    Ordered so that what later ranks wait for comes first. The slice is cut into head (rows
    ``[0, cw.split)``: the first local sequence when it continues an earlier rank's), mid and
    tail (rows ``[cw.tail_split, T_local)``: the last local sequence when it starts here and
    continues onto the next rank). In order:

    1. this rank's summary: the tail's final state ``[0 | S_ext]`` (one scan of the tail), or
       ``[M | S_ext]`` by one wider scan when one sequence covers the whole slice and continues
       on both sides, or zeros when nothing continues onto the next rank;
    2. the all-gather of the summaries starts (asynchronous where that costs no host sync);
    3. the mid is scanned while the summaries travel;
    4. the gather is waited for, the head's initial state composed and the head scanned.

    Every row is scanned once (the wider scan aside). Backward mirrors the overlap: the head's
    gradient reaches the earlier ranks' tails through a reduce-scatter that travels while the
    mid's backward runs (:class:`gdn_cp.comm.GatherInFlight`).

    A backend with ``chunk_state_summary`` (the reference backend: chunk maps composed in a
    tree, O(log chunks) deep) gives the summary without scanning the tail first: then the
    gather starts at once and mid and tail are scanned in one call while it travels.
    """
    dk = shape.head_k_dim
    state_dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
    scan = partial(backend.chunk_gated_delta_rule, use_qk_l2norm=shape.qk_l2norm)
    hv, dv = v.shape[1], v.shape[2]

    def rows(a, b):
        part = slice(a, b)
        return q[part], k[part], v[part], g[part], beta[part]

    if backend.chunk_state_summary is not None:
        return _scan_after_parallel_summary(rows, cw, scan, backend.chunk_state_summary, group, shape, state_dtype, v)

    o_tail = None
    if cw.last_is_first:
        summary = transition_summary(q, k, v, g, beta, cw.local_cu, backend, state_dtype, shape.qk_l2norm)
    elif cw.tail_cu is not None:
        o_tail, finals = scan(*rows(cw.tail_split, None), cu_seqlens=cw.tail_cu, output_final_state=True)
        summary = torch.cat([torch.zeros(hv, dk, dk, dtype=state_dtype, device=v.device), finals[-1].to(state_dtype)], -1)
    else:
        summary = _keep_in_graph(torch.zeros(hv, dk, dk + dv, dtype=state_dtype, device=v.device), v)
    flight = start_all_gather_rows(summary.unsqueeze(0), group)

    o_mid = None
    if cw.mid_cu is not None:
        o_mid, _ = scan(*rows(cw.split, cw.tail_split), cu_seqlens=cw.mid_cu)

    summaries = wait_all_gather_rows(flight)  # [cp, Hv, Dk, Dk+Dv]
    s_in = initial_state_from_summaries(summaries, cw, dk)  # [Hv, Dk, Dv]
    o_head = None
    if cw.first_continues:
        o_head, _ = scan(*rows(0, cw.split), cu_seqlens=cw.head_cu, initial_state=s_in.unsqueeze(0))
    parts = [o for o in (o_head, o_mid, o_tail) if o is not None]
    o = parts[0] if len(parts) == 1 else torch.cat(parts)
    # s_in is zeros when the head does not continue, but must stay in the graph (every rank's
    # backward runs the reduce-scatter)
    return o if cw.first_continues else _keep_in_graph(o, s_in)
