"""Chunked gated delta rule over THD-packed sequences, in plain torch.

Per value head, with state S [Dk, Dv] and per-token decay g <= 0 (log space):

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = scale * S_t^T q_t

Token by token that is T small matmuls in a row. The chunked (WY / UT-transform) form does the
same with batched matmuls: inside a chunk of C tokens, with G the in-chunk cumulative sum of g and
S the state entering the chunk, the per-token corrections d_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t)
solve a unit lower-triangular system

    (I + A) D = beta V - (beta K exp(G)) S,    A[i, j] = beta_i k_i.k_j exp(G_i - G_j)  (j < i)

so D = U - W S with U, W independent of S. Then

    O       = scale * (exp(G) Q S + ((Q K^T) * exp(G_i - G_j))_{j <= i} D)
    S_next  = exp(G_C) S + (K exp(G_C - G))^T D

Everything but the state carry is batched over all chunks of all sequences and all heads; only the
carry ``S -> S_next`` runs as a Python loop over chunks. All exponents are differences G_i - G_j
with j <= i, so they are <= 0 and never overflow for g <= 0 (checked for CPU tensors only: on a
device reading g would synchronize; see :mod:`gdn_cp.ops.gates`).

State summaries (:func:`chunk_state_summary`, for context parallelism): a chunk maps its incoming
state affinely, ``S_next = M_c S + S_c`` with ``M_c = exp(G_C) I - K_out^T W`` and ``S_c = K_out^T U``
(``K_out = K exp(G_C - G)``). A sequence's summary ``S_out = M S_in + S_ext`` is the composition of
its chunks' maps: every (M_c, S_c) at once (batched matmuls), then pairwise composition in a tree,
O(log chunks) deep instead of a serial pass over the chunks.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from ...checks import as_int
from ...layout.boundaries import host_boundaries
from ...layout.device import host_to_device
from ..gates import check_log_decay
from ..shape import value_heads_per_key_head
from .conv import compute_dtype

__all__ = ["chunk_gated_delta_rule", "chunk_state_summary", "l2norm"]

MAX_CHUNK_SIZE = 1024


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x^2, -1) + eps)`` over the last dim, as FLA's l2norm: fp32 math (fp64 for
    fp64 input), result in x.dtype."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    xc = x.to(compute_dtype(x.dtype))
    return (xc * torch.rsqrt((xc * xc).sum(-1, keepdim=True) + eps)).to(x.dtype)


def _finite_number(x) -> bool:
    """An int or float (not a bool) that is a finite float."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(float(x))
    except OverflowError:  # an int beyond float
        return False


def _check(name: str, t: torch.Tensor, rank: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}; cast it with .float()")
    if t.dim() != rank:
        raise ValueError(
            f"{name} must be {layout} (THD-packed, no batch dim), got shape {tuple(t.shape)}; "
            f"flatten batch and time into the first dim"
        )


def _check_scan_args(k, v, g, beta) -> tuple[int, int, int, int, int]:
    """k ``[T, Hk, Dk]``, v ``[T, Hv, Dv]`` (Hv a multiple of Hk), g, beta ``[T, Hv]``: floating-point,
    their shapes agree. Returns ``(T, Hk, Dk, Hv, Dv)``."""
    _check("k", k, 3, "[T, Hk, Dk]")
    _check("v", v, 3, "[T, Hv, Dv]")
    _check("g", g, 2, "[T, Hv]")
    _check("beta", beta, 2, "[T, Hv]")
    T, Hk, Dk = k.shape
    _, Hv, Dv = v.shape
    if v.shape[0] != T:
        raise ValueError(f"v must have T={T} tokens like k, got shape {tuple(v.shape)}")
    value_heads_per_key_head(Hk, Hv)
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (T, Hv):
            raise ValueError(f"{name} must be [T, Hv] = [{T}, {Hv}], got shape {tuple(t.shape)}")
    return T, Hk, Dk, Hv, Dv


def _check_chunk_size(chunk_size) -> None:
    if as_int(chunk_size) is None or not 1 <= chunk_size <= MAX_CHUNK_SIZE:
        raise ValueError(
            f"chunk_size must be an int in [1, {MAX_CHUNK_SIZE}] (the in-chunk matrices are chunk_size^2), got "
            f"{chunk_size!r}; 64 is the usual choice"
        )


def _chunk_plan(cu: list[int], chunk_size: int, T: int):
    """Host-side layout of the padded chunks. Returns
    gather: [n_chunks*C] token index per padded slot (T = padding, reads a zero row);
    scatter: [T] padded slot of each token;
    first: per sequence, index of its first chunk; count: per sequence, number of chunks."""
    C = chunk_size
    chunk_starts, chunk_ends, first, count = [], [], [], []
    for a, b in zip(cu[:-1], cu[1:]):
        first.append(len(chunk_starts))
        count.append(-(-(b - a) // C))
        chunk_starts.extend(range(a, b, C))
        chunk_ends.extend([b] * count[-1])
    starts = torch.tensor(chunk_starts, dtype=torch.long)
    ends = torch.tensor(chunk_ends, dtype=torch.long)
    slot = starts[:, None] + torch.arange(C, dtype=torch.long)[None, :]  # [n_chunks, C]
    real = slot < ends[:, None]
    gather = torch.where(real, slot, torch.full_like(slot, T)).reshape(-1)
    scatter = torch.arange(gather.numel(), dtype=torch.long)[real.reshape(-1)]
    return gather, scatter, first, count


class _Chunks:
    """Every chunk of every sequence, side by side, and its WY form (see the module docstring).

    Sequences are padded to whole chunks (padding: k = v = beta = g = 0, which leaves the state
    alone); ``gather``: :func:`_chunk_plan`'s slot index on the device. Tensors are
    ``[n_chunks, H, C, ...]``: ``G`` (in-chunk cumulative log decay), ``decay`` (``exp(G_i - G_j)``,
    j <= i), ``U, W`` (``D = U - W S``), ``k_out`` (writes the outgoing state), ``g_last``
    (``exp(G_C)``, ``[n, H, 1, 1]``).
    """

    def __init__(self, k, v, g, beta, gather: torch.Tensor, chunk_size: int):
        C, dtype, device = chunk_size, k.dtype, k.device
        self.gather, self.C, self.n = gather, C, gather.numel() // C
        kc, vc, gc, bc = (self.chunked(t) for t in (k, v, g, beta))
        G = gc.cumsum(-1)  # [n, H, C]
        tril = torch.ones(C, C, dtype=torch.bool, device=device).tril()
        decay = (G[..., :, None] - G[..., None, :]).masked_fill(~tril, float("-inf")).exp()  # [n, H, C, C]
        kb = kc * bc[..., None]
        A = ((kb @ kc.transpose(-1, -2)) * decay).tril(-1)  # strictly lower
        eye = torch.eye(C, dtype=dtype, device=device)
        rhs = torch.cat([vc * bc[..., None], kb * G.exp()[..., None]], dim=-1)
        UW = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        dv = v.shape[-1]
        self.kc, self.G, self.decay = kc, G, decay
        self.U, self.W = UW[..., :dv], UW[..., dv:]
        self.k_out = kc * (G[..., -1:] - G).exp()[..., None]
        self.g_last = G[..., -1].exp()[..., None, None]

    def chunked(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, H, ...]`` rows -> ``[n_chunks, H, C, ...]`` (padding slots read a zero row)."""
        x = torch.cat([x, x.new_zeros(1, *x.shape[1:])])[self.gather]
        x = x.view(self.n, self.C, *x.shape[1:])
        return x.movedim(1, 2)


def _compose_in_tree(maps: torch.Tensor, dk: int) -> torch.Tensor:
    """``[n, H, Dk, Dk+Dv]`` chunk maps ``[M_c | S_c]`` in sequence order -> their composition
    (the last applied last): pairs of neighbours composed at once, ceil(log2 n) rounds."""
    while maps.shape[0] > 1:
        n = maps.shape[0]
        even = n - n % 2
        earlier, later = maps[0:even:2], maps[1:even:2]
        composed = later[..., :dk] @ earlier  # [M_b M_a | M_b S_a]
        composed = composed + torch.cat([torch.zeros_like(later[..., :dk]), later[..., dk:]], dim=-1)
        maps = torch.cat([composed, maps[even:]]) if n % 2 else composed
    return maps[0]


def chunk_state_summary(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    cu_seqlens: Sequence[int],
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> torch.Tensor:
    """Each sequence's affine state summary ``[M | S_ext]``: ``S_out = M S_in + S_ext``.

    k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv], ``cu_seqlens`` host boundaries (N sequences,
    empty ones allowed: ``[I | 0]``); as :func:`chunk_gated_delta_rule` (q is not needed).
    Returns ``[N, Hv, Dk, Dk+Dv]`` in fp32 (fp64 for fp64 v), differentiable. Equals the final
    state of a scan from ``[I | 0]`` with values ``[0 | v]``, but every chunk's map is formed at
    once and the maps are composed in a tree (depth O(log chunks)) instead of one after another.
    """
    T, Hk, Dk, Hv, Dv = _check_scan_args(k, v, g, beta)
    _check_chunk_size(chunk_size)
    cu = host_boundaries(cu_seqlens, T)
    dtype, device = compute_dtype(v.dtype), k.device
    k, v, g, beta = (t.to(dtype) for t in (k, v, g, beta))
    if use_qk_l2norm:
        k = l2norm(k)
    if Hv != Hk:
        k = k.repeat_interleave(Hv // Hk, dim=1)
    gather, _, first, count = _chunk_plan(cu, chunk_size, T)
    eye = torch.eye(Dk, dtype=dtype, device=device)
    identity = torch.cat([eye.expand(Hv, Dk, Dk), eye.new_zeros(Hv, Dk, Dv)], dim=-1)
    if gather.numel() == 0:
        return identity.expand(len(cu) - 1, Hv, Dk, Dk + Dv).clone()
    ch = _Chunks(k, v, g, beta, host_to_device(gather, device), chunk_size)
    k_out_t = ch.k_out.transpose(-1, -2)  # [n, H, Dk, C]
    maps = torch.cat([ch.g_last * eye - k_out_t @ ch.W, k_out_t @ ch.U], dim=-1)  # [n, H, Dk, Dk+Dv]
    out = [identity if c == 0 else _compose_in_tree(maps[f:f + c], Dk) for f, c in zip(first, count)]
    return torch.stack(out)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    cu_seqlens: Sequence[int],
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Gated delta rule over packed sequences, chunked; differentiable in every tensor input.

    Args:
        q, k: [T, Hk, Dk]. v: [T, Hv, Dv], Hv a multiple of Hk (value head h uses key head
            h // (Hv // Hk), as Megatron's repeat_interleave). g: [T, Hv] log decay, finite and <= 0
            (ValueError otherwise when g is on the CPU; on a GPU g > 0 gives non-finite output).
            beta: [T, Hv].
        cu_seqlens: host ints (Boundaries or a list) 0 = cu[0] <= ... <= cu[-1] = T; empty sequences
            allowed; N sequences.
        scale: defaults to Dk ** -0.5.
        initial_state: [N, Hv, Dk, Dv] or None (zeros). Any values (CP passes [I | 0] to get a
            slice's transition matrix).
        output_final_state: also return the state after each sequence.
        use_qk_l2norm: l2-normalize q and k over Dk first (FLA's l2norm, eps=1e-6).
        chunk_size: tokens per chunk (an int in [1, 1024]; results do not depend on it up to rounding).

    Returns:
        o: [T, Hv, Dv] in v.dtype; final_state: [N, Hv, Dk, Dv] or None. Math (and final_state) in
        fp64 if v is fp64, else fp32.
    """
    _check("q", q, 3, "[T, Hk, Dk]")
    _check("k", k, 3, "[T, Hk, Dk]")
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)} [T, Hk, Dk], got {tuple(k.shape)}")
    T, Hk, Dk, Hv, Dv = _check_scan_args(k, v, g, beta)
    cu = host_boundaries(cu_seqlens, T)
    N = len(cu) - 1
    if initial_state is not None:
        _check("initial_state", initial_state, 4, "[N, Hv, Dk, Dv]")
        if initial_state.shape != (N, Hv, Dk, Dv):
            raise ValueError(
                f"initial_state must be [N, Hv, Dk, Dv] = [{N}, {Hv}, {Dk}, {Dv}] (one state per sequence "
                f"of cu_seqlens), got shape {tuple(initial_state.shape)}"
            )
    if scale is not None and not _finite_number(scale):
        raise TypeError(f"scale must be a finite float or None (Dk ** -0.5), got {scale!r}")
    for name, flag in (("output_final_state", output_final_state), ("use_qk_l2norm", use_qk_l2norm)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    _check_chunk_size(chunk_size)
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; move it with .to(q.device)")
    if q.is_meta:
        raise ValueError("q is on the meta device, which holds no values; run the kernels on the CPU or a GPU")
    if g.device.type == "cpu":  # host values: checking costs no device sync (see gdn_cp.ops.gates)
        check_log_decay(g)
    scale = Dk**-0.5 if scale is None else float(scale)

    out_dtype, dtype, device = v.dtype, compute_dtype(v.dtype), q.device
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if Hv != Hk:
        q = q.repeat_interleave(Hv // Hk, dim=1)
        k = k.repeat_interleave(Hv // Hk, dim=1)
    q = q * scale

    C = chunk_size
    gather, scatter, first, count = _chunk_plan(cu, C, T)
    n_chunks = gather.numel() // C
    ch = _Chunks(k, v, g, beta, host_to_device(gather, device), C)
    qc = ch.chunked(q)
    U, W, k_out, g_last = ch.U, ch.W, ch.k_out, ch.g_last
    qk = (qc @ ch.kc.transpose(-1, -2)) * ch.decay  # [n, H, C, C], lower incl. diagonal
    q_in = qc * ch.G.exp()[..., None]  # reads the incoming state

    # The only serial part: carry the state through the chunks of each sequence.
    starts_of_chunks: list[torch.Tensor] = []
    corrections: list[torch.Tensor] = []
    finals: list[torch.Tensor] = []
    for n in range(N):
        if initial_state is not None:
            S = initial_state[n].to(dtype)
        else:
            S = torch.zeros(Hv, Dk, Dv, dtype=dtype, device=device)
        for c in range(first[n], first[n] + count[n]):
            D = U[c] - W[c] @ S
            starts_of_chunks.append(S)
            corrections.append(D)
            S = g_last[c] * S + k_out[c].transpose(-1, -2) @ D
        finals.append(S)

    if n_chunks:
        S_in = torch.stack(starts_of_chunks)  # [n, H, Dk, Dv]
        D = torch.stack(corrections)  # [n, H, C, Dv]
        o = q_in @ S_in + qk @ D  # [n, H, C, Dv]
        o = o.movedim(2, 1).reshape(n_chunks * C, Hv, Dv)[host_to_device(scatter, device)]
    else:
        o = v.new_zeros(0, Hv, Dv)
    final_state = torch.stack(finals) if output_final_state else None
    return o.to(out_dtype), final_state
