"""chunkwise: each rank computes every head on a contiguous time slice.

zigzag -> contiguous (route all-to-all), then the conv takes its W-1 halo rows from
earlier ranks and the scan takes its initial state from the affine summaries
``S_out = M S_in + S_ext`` of earlier ranks, then contiguous -> zigzag. Per-rank compute
is the CP=1 compute on T/cp tokens (in the generic path here, plus one wider scan on a
rank whose whole slice continues a sequence on both sides, for its transition matrix M).
A backend with a native context-parallel core for the group (``backend.native_cp_core``:
FLA's cp context on NCCL) replaces the generic halo/summary path.
"""

from __future__ import annotations

from functools import partial

import torch

from ..comm import all_gather_rows, route_all_to_all
from ..layout import CONTIGUOUS, ZIGZAG
from ..layout.chunkwise import ChunkwisePlan
from ..layout.plan import CPPlan
from ..ops.shape import GDNShape
from .common import split_qkv, stack_gates, unstack_gates

__all__ = ["chunkwise_core", "contiguous_core", "gather_halo", "initial_state_from_summaries"]


def gather_halo(x: torch.Tensor, cw: ChunkwisePlan, index: torch.Tensor, group) -> torch.Tensor:
    """The W-1 pre-conv rows before this rank's first row, from the ranks that hold them.

    ``x [T_local, C]`` contiguous rows. All ranks all-gather their tails ``[W-1, C]``
    (rows before a rank's own first row are zeros); each picks its halo rows from them.
    ``index [W-1]``: :func:`halo_gather_index` on x's device.
    """
    w1 = cw.conv_width - 1
    tail = x[-w1:] if x.shape[0] >= w1 else torch.cat([x.new_zeros(w1 - x.shape[0], x.shape[1]), x])
    tails = all_gather_rows(tail, group)  # [cp*(W-1), C]
    tails = torch.cat([tails, tails.new_zeros(1, tails.shape[1])])  # last row: zeros
    return tails.index_select(0, index)


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


def _transition_summary(q, k, v, g, beta, cu, backend, state_dtype, qk_l2norm: bool) -> torch.Tensor:
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


def chunkwise_core(qkv, g, beta, conv_weight, conv_bias, *, shape: GDNShape, plan: CPPlan, group, backend):
    """zigzag rows in and out; the routes wrap :func:`contiguous_core`."""
    to_c, to_z = plan.route(ZIGZAG, CONTIGUOUS), plan.route(CONTIGUOUS, ZIGZAG)
    qkv_c = route_all_to_all(qkv, to_c, to_z, group)
    gates_c = route_all_to_all(stack_gates(g, beta), to_c, to_z, group)
    g_c, beta_c = unstack_gates(gates_c, g.dtype, beta.dtype)
    o_c = contiguous_core(
        qkv_c, g_c, beta_c, conv_weight, conv_bias,
        shape=shape, plan=plan, group=group, backend=backend,
    )
    return route_all_to_all(o_c, to_z, to_c, group)


def contiguous_core(qkv_c, g_c, beta_c, conv_weight, conv_bias, *, shape: GDNShape, plan: CPPlan, group, backend):
    """The chunkwise core on rows already in the contiguous layout; returns contiguous rows.

    Used directly when the layout swap happens outside the core (on hidden_states). A
    backend with a native context-parallel kernel for this group (FLA's cp_context on NCCL)
    runs it; otherwise halos and state summaries go through gdn_cp.comm and the backend's
    kernels run per rank (same results; the reference backend, or FLA on gloo groups).
    """
    native = backend.native_cp_core(group)
    if native is not None:
        return native(
            qkv_c, g_c, beta_c, conv_weight, conv_bias,
            shape=shape, cu_seqlens_global=plan.cu, group=group, cache=plan.backend_cache,
        )

    cw = plan.chunkwise(conv_weight.shape[1])
    straddles = cw.any_straddle  # same on every rank: all skip the exchanges together
    halo = None
    if straddles and cw.conv_width > 1:
        index = plan.cached_on(("halo_index", cw.conv_width), qkv_c.device, lambda: halo_gather_index(cw))
        halo = gather_halo(qkv_c, cw, index, group)
    x = backend.causal_conv1d(qkv_c, conv_weight, conv_bias, cu_seqlens=cw.local_cu, halo=halo, activation="silu")
    q, k, v = split_qkv(x, shape, shape.num_k_heads, shape.num_v_heads)

    if not straddles:
        o_c, _ = backend.chunk_gated_delta_rule(
            q, k, v, g_c, beta_c, cu_seqlens=cw.local_cu, use_qk_l2norm=shape.qk_l2norm
        )
        return o_c
    return _scan_with_carried_state(q, k, v, g_c, beta_c, cw, backend, group, shape)


def _scan_with_carried_state(q, k, v, g, beta, cw: ChunkwisePlan, backend, group, shape: GDNShape):
    """The scan of a slice whose first local sequence may continue an earlier rank's.

    The local sequences that start on this rank need no incoming state: they are scanned
    first, and the last one's final state is this rank's summary ``[0 | S_ext]``. After the
    summaries are exchanged, the first local sequence (rows ``[0, cw.split)``) is scanned from
    its composed initial state. So every row is scanned once, except when one sequence covers
    the whole slice and continues on both sides: its ``[M | S_ext]`` takes one more (wider) scan.
    """
    dk = shape.head_k_dim
    state_dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
    scan = partial(backend.chunk_gated_delta_rule, use_qk_l2norm=shape.qk_l2norm)
    split = cw.split

    o_rest = None
    if cw.rest_cu is not None:
        rest = slice(split, None)
        o_rest, finals = scan(
            q[rest], k[rest], v[rest], g[rest], beta[rest], cu_seqlens=cw.rest_cu, output_final_state=cw.last_continues,
        )
    hv, dv = v.shape[1], v.shape[2]
    if cw.last_is_first:
        summary = _transition_summary(q, k, v, g, beta, cw.local_cu, backend, state_dtype, shape.qk_l2norm)
    elif cw.last_continues:
        summary = torch.cat([torch.zeros(hv, dk, dk, dtype=state_dtype, device=v.device), finals[-1].to(state_dtype)], -1)
    else:
        summary = _keep_in_graph(torch.zeros(hv, dk, dk + dv, dtype=state_dtype, device=v.device), v)
    summaries = all_gather_rows(summary.unsqueeze(0), group)  # [cp, Hv, Dk, Dk+Dv]
    s_in = initial_state_from_summaries(summaries, cw, dk)  # [Hv, Dk, Dv]

    if not cw.first_continues:
        return _keep_in_graph(o_rest, s_in)  # s_in is zeros here, but must stay in the graph
    head = slice(0, split)
    o_first, _ = scan(
        q[head], k[head], v[head], g[head], beta[head], cu_seqlens=cw.head_cu, initial_state=s_in.unsqueeze(0)
    )
    return o_first if o_rest is None else torch.cat([o_first, o_rest])
