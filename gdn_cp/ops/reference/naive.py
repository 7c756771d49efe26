"""Naive oracles of the reference ops, token by token: obviously right, slow, fp64 inside.

Same signatures and output dtypes as the functions they check (:mod:`gdn_cp.ops.reference`'s
``causal_conv1d`` and ``chunk_gated_delta_rule``), so any test can swap one for the other; they
stand beside them as flash-linear-attention keeps ``naive.py`` beside its kernels. Not part of
the backend (``gdn_cp.ops.reference`` does not import them). No input validation: they trust
their caller.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F


def naive_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    cu_seqlens: Sequence[int],
    halo: Optional[torch.Tensor] = None,
    activation: Optional[str] = "silu",
) -> torch.Tensor:
    """Per sequence: left-pad with W-1 zeros (or the halo, for the sequence starting at row 0), then
    y[t] = bias + sum_j weight[:, j] * padded[t + j]. x [T, C], weight [C, W] -> y [T, C] in x.dtype."""
    C, W = weight.shape
    w = weight.double()
    out = []
    for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        if a == b:
            continue
        if a == 0 and halo is not None:
            pad = halo.double()
        else:
            pad = torch.zeros(W - 1, C, dtype=torch.float64, device=x.device)
        xs = torch.cat([pad, x[a:b].double()])
        rows = []
        for t in range(b - a):
            y = torch.zeros(C, dtype=torch.float64, device=x.device)
            if bias is not None:
                y = y + bias.double()
            for j in range(W):
                y = y + w[:, j] * xs[t + j]
            rows.append(y)
        out.append(torch.stack(rows))
    y = torch.cat(out) if out else x.new_zeros(0, C, dtype=torch.float64)
    if activation == "silu":
        y = F.silu(y)
    return y.to(x.dtype)


def naive_gated_delta_rule(
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
    """Token by token, per sequence, per value head, in fp64:
    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,  o_t = scale * S_t^T q_t.
    q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; initial_state [N, Hv, Dk, Dv].
    Returns o [T, Hv, Dv] in v.dtype and final_state [N, Hv, Dk, Dv] (fp64 if v is fp64, else fp32)
    or None. chunk_size is ignored."""
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1:]
    N = len(cu_seqlens) - 1
    scale = Dk**-0.5 if scale is None else scale
    out_dtype = v.dtype
    state_dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    eye = torch.eye(Dk, dtype=torch.float64, device=q.device)
    outs = [[None] * Hv for _ in range(N)]
    finals = []
    for n in range(N):
        a, b = cu_seqlens[n], cu_seqlens[n + 1]
        seg_final = []
        for h in range(Hv):
            hk = h // (Hv // Hk)
            if initial_state is None:
                S = torch.zeros(Dk, Dv, dtype=torch.float64, device=q.device)
            else:
                S = initial_state[n, h].double()
            rows = []
            for t in range(a, b):
                kt = k[t, hk][:, None]  # [Dk, 1]
                S = torch.exp(g[t, h]) * (eye - beta[t, h] * kt @ kt.T) @ S + beta[t, h] * kt @ v[t, h][None, :]
                rows.append(scale * S.T @ q[t, hk])
            outs[n][h] = torch.stack(rows) if rows else torch.zeros(0, Dv, dtype=torch.float64, device=q.device)
            seg_final.append(S)
        finals.append(torch.stack(seg_final))
    o = torch.cat([torch.stack(outs[n], dim=1) for n in range(N)])  # [T, Hv, Dv]
    final_state = torch.stack(finals).to(state_dtype) if output_final_state else None
    return o.to(out_dtype), final_state
