"""The Megatron parity case: the patched GatedDeltaNet under CP against the same module at CP=1.

Run inside every rank of a CP group (a :class:`gdn_cp.testing.ranks.RankPool` case). Shared by the
CPU tests (fp64/fp32, reference backend), the GPU tests (bf16, FLA) and benchmarks that must time
correct code.
"""

from __future__ import annotations

from functools import partial

import torch

from ..modes.spec import MODE_NAMES
from .inputs import hidden_inputs
from .megatron_layer import DIMS, build_gdn, make_config, rank_groups, run_layer, thd_params
from .metrics import max_rel
from .packings import thd_case, zigzag_rows

__all__ = ["HIDDEN", "MODES", "SBHD_BATCH", "compare", "parity_case", "sbhd_len"]

MODES = MODE_NAMES
SBHD_BATCH = 2
HIDDEN = DIMS["hidden_size"]


def sbhd_len(cp: int) -> int:
    """Sequence length of the SBHD parity case: 2*cp zigzag parts of 12 rows each."""
    return 24 * cp


def compare(got, want, rows, metric=max_rel) -> dict:
    """Errors of one CP rank's ``(out, x.grad, {param: grad summed over CP})`` against CP=1's, whose
    per-row tensors are indexed by the rank's global ``rows``: ``{"out", "grad:hidden_states",
    "grad:<param>"}``."""
    y, gx, grads = got
    ry, rgx, rgrads = want
    if set(grads) != set(rgrads):
        raise ValueError(f"parameters differ: CP has {sorted(grads)}, CP=1 has {sorted(rgrads)}")
    errs = {"out": metric(y, ry[rows]), "grad:hidden_states": metric(gx, rgx[rows])}
    for name in rgrads:
        errs[f"grad:{name}"] = metric(grads[name], rgrads[name])
    return errs


def parity_case(rank, world, layout, dtype, modes, *, cfg=None, cp_group=None, dynamic=False, seed=1,
                data_seed=0, bias=True, conv_bias=True, device="cpu", metric=max_rel):
    """One layout (``"sbhd"`` or ``"thd"``) and dtype on this rank: the CP=1 answer, then each mode
    under CP. Returns ``{mode: {quantity: error}}`` (a missing gradient is inf).

    ``cp_group`` (default: WORLD) is the group this micro-batch is split over; every rank of it
    calls with the same arguments. ``dynamic=False``: the modules are built with it as their static
    CP group (config context_parallel_size = its size). ``dynamic=True``: the modules keep the
    static WORLD group (context_parallel_size = world) and the micro-batch's PackedSeqParams carries
    ``cp_group`` and ``local_cp_size`` (dynamic CP). ``cfg`` overrides TransformerConfig fields.
    ``device`` / ``metric``: the GPU tests pass "cuda" and :func:`gdn_cp.testing.metrics.rel_l2`.
    """
    import torch.distributed as dist
    from megatron.core.packed_seq_params import PackedSeqParams

    from gdn_cp.megatron.gdn import gated_delta_net_forward

    groups = rank_groups()
    cp_group = groups["world"] if cp_group is None else cp_group
    cp, cp_rank = cp_group.size(), cp_group.rank()
    static_group = groups["world"] if dynamic else cp_group
    cfg = cfg or {}
    build = partial(build_gdn, seed=seed, bias=bias, conv_bias=conv_bias, device=device)
    hidden = cfg.get("hidden_size", DIMS["hidden_size"])
    extra = dict(cp_group=cp_group, local_cp_size=cp) if dynamic else {}

    if layout == "sbhd":
        s = sbhd_len(cp)
        x, dout = hidden_inputs(s, SBHD_BATCH, dtype, 100 + cp + 1000 * data_seed, hidden, device)
        rows = zigzag_rows([0, s], cp, cp_rank).to(device)
        psp = lambda **kw: PackedSeqParams(qkv_format="sbhd", **kw) if kw else None  # noqa: E731
    else:
        cu_pad, cu_act = thd_case(cp)
        x, dout = hidden_inputs(cu_pad[-1], 1, dtype, 200 + cp + 1000 * data_seed, hidden, device)
        rows = zigzag_rows(cu_pad, cp, cp_rank).to(device)
        psp = lambda **kw: thd_params(cu_pad, cu_act, device=device, **kw)  # noqa: E731

    base = build(make_config(1, "headwise", dtype, **cfg), groups["self"])
    forward = None
    if layout == "sbhd" and dtype == torch.float64:  # stock computes its core in fp32
        forward = partial(gated_delta_net_forward, base)
    want = run_layer(base, x, dout, psp(), forward=forward)

    out = {}
    for mode in modes:
        module = build(make_config(static_group.size(), mode, dtype, **cfg), static_group)
        y, gx, grads = run_layer(module, x[rows], dout[rows], psp(**extra))
        for g in grads.values():
            if g is not None:
                dist.all_reduce(g, group=cp_group)
        out[mode] = compare((y, gx, grads), want, rows, metric)
    return out
