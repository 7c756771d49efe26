"""The per-token glue around the GDN core, each step written once in plain torch, and the ways a GPU runs it.

Between in_proj and the core kernel a GDN layer does small things over big tensors: the gates
(``g = -exp(A_log) * softplus(alpha + dt_bias)``, ``beta = sigmoid(beta)``), the causal conv of
q|k|v with SiLU, the split of the conv's channels into q, k, v heads, and the l2 norm of q and k.
Run op by op, each is a pass over memory. The plain-torch functions here are the math every path
computes, rounded where stock (FLA's conv, FLA's l2norm, stock's gate expression) rounds; on the CPU
they run as they are. On CUDA the setting ``GDN_CP_GLUE`` (``Settings.glue``) picks the path
(:func:`glue_path`):

- ``triton``: gdn-cp's Triton kernels (:mod:`.triton_conv`, :mod:`.triton_gates`): conv + SiLU + split +
  l2 norm in one pass each way, the gates in one pass each way;
- ``triton_one_pass``: the same kernels, the conv's backward in one kernel (no fp32 ``[T, C]`` buffer
  between two; :func:`~gdn_cp.ops.fused.triton_conv.gdn_cp_glue_conv_bwd`);
- ``triton_norm``: ``triton_one_pass``, and the gated RMSNorm after the core by gdn-cp's kernel, which reads the
  gate z where in_proj wrote it and writes its gradient into in_proj's (:mod:`.triton_norm`: no copy of z
  either way; in_proj's gradient is then made before the core's backward, more peak memory);
- ``triton_norm_dz_copy``: the same, z's gradient in a tensor of its own that the split's backward copies in
  (one copy back, in_proj's gradient made after the core's backward as in ``triton_one_pass``);
- ``triton_norm_dz_copy_scan``: ``triton_norm_dz_copy`` with the conv's backward as a scan down each span of 64+
  rows, one row of a few heads a step (:func:`~gdn_cp.ops.fused.triton_conv.gdn_cp_glue_conv_bwd_scan`): a thread
  keeps its channels at every row, so the conv's shifts in time are registers that roll from step to step (no
  scratch tile, no barrier, tap sums of one row's size), and each step loads the rows 4 steps ahead first (the
  forward stays the tile kernel: a scan of it was slower on an H100, 0.390 ms at 16K rows against 0.321, and is
  removed). The same dx bits as ``triton_norm_dz_copy``'s. Compiled for sm_90 (4 heads of 128 a program, 4 warps,
  the l2 norm, no bias, as launched): 128 registers a thread and no barrier, against the one-pass backward's 241
  and 21 (16 rows, 4 warps); autotuning picks 4 steps a loop pass on an H100. **The default** since runs
  2026-12-06l/n (:data:`CUDA_DEFAULT`);
- ``compiled``: these functions through ``torch.compile`` (dynamic in T);
- ``unfused``: the backend's conv kernel, the split as views, the l2 norm left to the scan kernel, the
  gates op by op (what the layer ran before any fusion);
- ``auto``: :data:`CUDA_DEFAULT`, the path measured fastest per rank on the GPU
  (``benchmarks/results/layer_full_glue.json``; tests/ops/test_glue_default.py holds it to that file).

fp64 on CUDA runs the plain functions (the kernels compute in fp32).

Shapes: ``x [T, C]`` pre-conv channels ``[q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)]`` (any row stride:
in the layer it is a view of in_proj's output), ``weight [C, W]``, ``bias [C]``, ``positions [T]``
int32 (each row's offset from its sequence's first row: :meth:`gdn_cp.layout.Boundaries.positions`),
``halo [W-1, C]`` (the rows before row 0 in row 0's sequence, zeros where there are none).
Everything is trusted: the boundary that made the call checked it.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Callable, Optional

import torch
import torch.nn.functional as F

__all__ = ["CUDA_DEFAULT", "GLUE_PATHS", "L2NORM_EPS", "conv_silu_split", "gated_rms_norm", "gates", "glue_path"]

logger = logging.getLogger(__name__)

L2NORM_EPS = 1e-6
"""FLA's (and FlashQLA's) l2norm epsilon: ``x * rsqrt(sum(x^2) + eps)``."""

GLUE_PATHS = ("triton", "triton_one_pass", "triton_norm", "triton_norm_dz_copy", "triton_norm_dz_copy_scan",
              "compiled", "unfused")
"""The ways a GPU runs the glue (module docstring); ``eager`` (the plain functions) is the CPU's."""

REPEAT_KEY_HEADS_IN_CONV = True
"""Where the core kernel reads q and k at the value heads (FLA 0.4.2, the version the pinned megatron-core names, has
no grouped value heads: its backend repeats them, then autograd sums the copies' gradients), whether the conv writes them
repeated (:func:`conv_silu_split`'s ``kv_repeat``) and its backward sums the copies' gradients as it reads them: no
copy kernel, no bf16 sum kernel. On since runs 2026-12-06l/o (one H100, FLA 0.4.2, local modules, each CP=2 rank's
slice of 32K tokens): 0.964-0.966x the layer's time with the default glue then, 0.964-0.968x with the scan's, at
the same peak memory; with the TE spec at 32K and 128K 0.963-0.973x (run 2026-12-07a). ``benchmarks/layer_full.py``'s
lever ``key_heads_by_backend`` times it off."""

CUDA_DEFAULT = "triton_norm_dz_copy_scan"
"""What ``auto`` means on CUDA: the path measured fastest per rank (module docstring). Runs 2026-12-06l/n on one H100,
each CP=2 rank's slice of mixed-length tokens, Qwen3.5-9B's GDN shape, bf16: ``triton_norm_dz_copy_scan``
0.968-0.978x ``triton_norm_dz_copy``'s time at 32K and 0.954-0.977x at 128K on FlashQLA (local modules), 0.972-0.973x
at 32K on FLA 0.4.2, at the same peak memory, in all 6 rank rows, and 0.971-0.975x on FLA 0.4.2 with the TE spec at
32K and 128K in all 4 (run 2026-12-07a) (``benchmarks/glue_kernels.py``: its conv backward
0.74 ms at 16K rows and 1.79 at 64K, the two-pass backward's 1.40 and 4.96, the x-once one-pass form's 1.20 and 3.22,
since removed). Before it: ``triton_norm_dz_copy`` (runs 2026-12-06b/d/e) 0.983-0.999x ``triton_one_pass``'s time in
all 8 rank rows (FlashQLA with the local modules, FLA 0.4.2 with the TE spec), at the same peak memory (within 6
KiB); ``triton_one_pass`` 0.985-1.003x ``triton`` at 32K and 0.962-0.977x at 128K (run 2026-12-05g); ``triton``
0.92-0.97x ``unfused`` (runs 2026-12-04c/d, H200); ``compiled`` slower than ``unfused`` (run 2026-12-04a).
``triton_norm`` (run 2026-12-06a) is 0.969-0.984x ``triton_one_pass``'s time but keeps 0.25-1.0 GiB more at peak: a
trade, not the default. ``triton_taps_per_program`` (runs 2026-12-06d/e): its backward kernel alone 0.90x, the layer
0.982-1.006x ``triton_one_pass``: not faster in every row. ``triton_norm_dz_copy_x_once`` (runs 2026-12-06j/k, H200):
0.991-1.003x ``triton_norm_dz_copy``'s time, slower in 1 of 6 rows. Both were removed once the scan beat them (with
``triton_norm_dz_copy_narrow`` and ``triton_norm_dz_copy_norm_pass``: CHANGELOG.md). ``triton_norm_dz_copy_scan_few``
(the same scans, 7-8 launches around them instead of ~50 with a halo; run 2026-12-07j, H100, FLA 0.4.2, TE spec):
0.993-0.999x the default at 32K and 128K and 1.002x on rank 1 at 128K, not faster in every row: removed. It changes only with a committed
GPU run that shows another path faster and no bigger at the sizes users train (tests/ops/test_glue_default.py reads
them)."""


def glue_path(setting: str, x: torch.Tensor) -> str:
    """The path for a call whose activations are ``x``: ``eager`` off CUDA and for fp64 (and for
    ``compiled`` where dynamo is disabled: ``torch.compile`` would return the function as it is), the
    setting on CUDA, :data:`CUDA_DEFAULT` for ``auto``."""
    if x.device.type != "cuda":
        return "eager"
    path = CUDA_DEFAULT if setting == "auto" else setting
    if path != "unfused" and x.dtype == torch.float64:
        return "eager"
    if path == "compiled" and torch._dynamo.config.disable:
        return "eager"
    return path


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64; fp32, bf16 and fp16 are computed in fp32 (as FLA's conv and l2norm)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _gates(alpha: torch.Tensor, beta: torch.Tensor, decay: torch.Tensor, dt_bias: torch.Tensor):
    """``alpha, beta [T, Hv]`` (views of in_proj's output), ``decay = -exp(A_log)``, ``dt_bias [Hv]`` ->
    ``(g [T, Hv] fp32 log decay, beta [T, Hv] in beta's dtype)``, stock's expression."""
    g = decay * F.softplus(alpha.float() + dt_bias)
    return g, beta.sigmoid()


def _l2norm(x: torch.Tensor, dtype: torch.dtype, eps: float) -> torch.Tensor:
    """FLA's l2norm: ``x`` (in the activations' dtype) normalized in fp32 (fp64 for fp64), rounded once."""
    xc = x.to(_compute_dtype(dtype))
    return (xc * torch.rsqrt((xc * xc).sum(-1, keepdim=True) + eps)).to(dtype)


def _conv_silu_split(x, weight, bias, positions, halo, k_heads: int, v_heads: int, head_k_dim: int,
                     head_v_dim: int, qk_l2norm: bool, eps: float, kv_repeat: int = 1):
    """``y = silu(bias + sum_j weight[:, j] * x[t - (W-1) + j])`` per sequence (taps before a
    sequence's first row read zeros, except into ``halo`` for the sequence that starts at row 0),
    then ``q, k [T, heads, Dk]`` (l2-normalized when ``qk_l2norm``; each head repeated ``kv_repeat`` times:
    ``repeat_interleave``) and ``v [T, heads, Dv]``, each contiguous and in x's dtype."""
    t, c = x.shape
    w = weight.shape[1]
    dtype = _compute_dtype(x.dtype)
    xc = x.to(dtype)
    front = xc.new_zeros(w - 1, c) if halo is None else halo.to(dtype)
    padded = torch.cat([front, xc], dim=0)  # row r is token r - (W-1)
    pos = positions
    if halo is not None:  # the sequence that starts at row 0 continues into the halo: never masked
        rows = torch.arange(t, device=positions.device, dtype=positions.dtype)
        pos = torch.where(positions == rows, torch.full_like(positions, w), positions)
    pos = pos.unsqueeze(-1)
    taps = weight.to(dtype)
    y = None if bias is None else bias.to(dtype)
    for j in range(w):
        shift = w - 1 - j  # tap j reads x[t - shift]
        term = padded[j:j + t]
        if shift:
            term = torch.where(pos >= shift, term, 0.0)
        term = taps[:, j] * term
        y = term if y is None else y + term
    y = F.silu(y).to(x.dtype)  # the conv's output in the activations' dtype, as FLA's conv (and stock) round it
    key_dim = k_heads * head_k_dim
    q, k, v = torch.split(y, [key_dim, key_dim, v_heads * head_v_dim], dim=-1)
    q, k, v = q.reshape(t, k_heads, head_k_dim), k.reshape(t, k_heads, head_k_dim), v.reshape(t, v_heads, head_v_dim)
    if qk_l2norm:
        q, k = _l2norm(q, x.dtype, eps), _l2norm(k, x.dtype, eps)
    if kv_repeat > 1:
        q, k = q.repeat_interleave(kv_repeat, dim=1), k.repeat_interleave(kv_repeat, dim=1)
    return q.contiguous(), k.contiguous(), v.contiguous()


class _Compiled:
    """``fn`` compiled (once per process, dynamic in the row count); eager for empty inputs."""

    def __init__(self, fn: Callable, row_args: tuple[int, ...]):
        self.fn, self.row_args, self._compiled = fn, row_args, None

    def __call__(self, *args):
        if args[0].shape[0] == 0:
            return self.fn(*args)
        if self._compiled is None:
            logger.info("compiling gdn-cp's fused %s with torch.compile (once per process and shape)",
                        self.fn.__name__.lstrip("_"))
            self._compiled = torch.compile(self.fn, fullgraph=True)
        for i in self.row_args:  # every micro-batch has its own row count: no recompiles
            torch._dynamo.maybe_mark_dynamic(args[i], 0)
        return self._compiled(*args)


_gates_compiled = _Compiled(_gates, row_args=(0, 1))
_conv_compiled = _Compiled(_conv_silu_split, row_args=(0, 3))  # x [T, C], positions [T]


def _triton_conv(backward: dict):
    from .triton_conv import MAX_WIDTH, conv_silu_split_triton  # Triton is imported only where a GPU takes this path

    def conv(x, weight, *rest):  # a conv wider than the kernels take runs the plain math (same values)
        if weight.shape[1] > MAX_WIDTH:
            return _conv_silu_split(x, weight, *rest)
        return conv_silu_split_triton(x, weight, *rest, **backward)

    return conv


def _triton_gates():
    from .triton_gates import gates_triton

    return gates_triton


_CONV_BACKWARD = {"triton": {}, "triton_one_pass": {"one_pass": True}, "triton_norm": {"one_pass": True},
                  "triton_norm_dz_copy": {"one_pass": True}, "triton_norm_dz_copy_scan": {"scan": True}}
"""gdn-cp's Triton paths, and how each runs the conv (the fields of :class:`.triton_conv.ConvForm`: the backward in
two kernels, one, or a scan down the rows)."""
_NORM_DZ_IN_PLACE = {"triton_norm": True, "triton_norm_dz_copy": False, "triton_norm_dz_copy_scan": False}
"""The paths whose gated norm is gdn-cp's kernel, and whether it writes dz into in_proj's gradient."""
_GATES = {"eager": lambda: _gates, "compiled": lambda: _gates_compiled, "unfused": lambda: _gates,
          **{path: _triton_gates for path in _CONV_BACKWARD}}
_CONV = {"eager": lambda: _conv_silu_split, "compiled": lambda: _conv_compiled,
         **{path: partial(_triton_conv, backward) for path, backward in _CONV_BACKWARD.items()}}


def gates(alpha: torch.Tensor, beta: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, path: str = "eager"):
    """``(g [T, Hv] fp32, sigmoid(beta) [T, Hv])`` from in_proj's ``alpha, beta [T, Hv]`` and the
    layer's ``A_log, dt_bias [Hv]``: ``g = -exp(A_log) * softplus(alpha + dt_bias)``, stock's expression
    and rounding (``-exp(A_log)`` in A_log's dtype, one tiny op; the rest by ``path``: :func:`glue_path`)."""
    return _GATES[path]()(alpha, beta, -a_log.exp(), dt_bias)


def conv_silu_split(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    positions: torch.Tensor,
    halo: Optional[torch.Tensor],
    *,
    k_heads: int,
    v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    qk_l2norm: bool,
    eps: float = L2NORM_EPS,
    path: str = "eager",
    kv_repeat: int = 1,
):
    """Causal conv + SiLU of ``x [T, C]`` (C = 2*k_heads*Dk + v_heads*Dv), split into contiguous
    ``q, k [T, k_heads, Dk]`` (l2-normalized over Dk when ``qk_l2norm``) and ``v [T, v_heads, Dv]`` in
    x's dtype, computed in fp32 (fp64 for fp64) and rounded where FLA's conv and l2norm round: the same
    values as the ops one by one. ``positions [T]`` int32 row offsets within each
    sequence; ``halo [W-1, C]`` or None (module docstring); ``path``: ``eager`` or one of :data:`GLUE_PATHS` but
    ``unfused`` (:func:`glue_path`). ``kv_repeat``: q and k with each head repeated that many times, ``[T, k_heads *
    kv_repeat, Dk]`` (``repeat_interleave``: what a core kernel without grouped value heads reads; the Triton paths
    write the copies and sum their gradients in the conv's kernels: :data:`REPEAT_KEY_HEADS_IN_CONV`)."""
    return _CONV[path]()(x, weight, bias, positions, halo, k_heads, v_heads, head_k_dim, head_v_dim, qk_l2norm, eps,
                         kv_repeat)


def gated_rms_norm(path: str):
    """gdn-cp's gated RMSNorm for glue ``path`` where it has one (``triton_norm``, ``triton_norm_dz_copy``:
    :func:`~gdn_cp.ops.fused.triton_norm.gated_rms_norm_triton`, ``o, z [T, Hv, Dv], weight [Dv], eps ->
    [T*Hv, Dv]``), else None: the backend's kernel or the layer's own norm runs."""
    if path not in _NORM_DZ_IN_PLACE:
        return None
    from .triton_norm import gated_rms_norm_triton

    return partial(gated_rms_norm_triton, dz_in_place=_NORM_DZ_IN_PLACE[path])
