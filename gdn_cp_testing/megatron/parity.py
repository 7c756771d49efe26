"""The Megatron parity case: the patched GatedDeltaNet under CP (and TP, sequence parallelism:
:func:`tp_parity_case`) against the same module at CP=1 (TP=1) on the same full weights.

Run inside every rank of a CP group (a :class:`gdn_cp_testing.ranks.RankPool` case). Shared by the
CPU tests (fp64/fp32, reference backend), the GPU tests (bf16, FLA) and benchmarks that must time
correct code.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial

import torch

from gdn_cp.modes.spec import MODE_NAMES
from gdn_cp_testing.inputs import hidden_inputs
from gdn_cp.ops.accuracy import max_rel
from gdn_cp_testing.packings import document_packings, thd_case, zigzag_rows
from gdn_cp_testing.megatron.layer import DIMS, build_gdn, gdn_cp_forward, make_config, rank_groups, run_layer, thd_params

__all__ = [
    "GPU_CFG", "HIDDEN", "MODES", "SBHD_BATCH", "case_inputs", "compare", "cp1_answer", "parity_case", "sbhd_len",
    "thd_split_cfg", "tp_grid_case", "tp_parity_case",
]

MODES = MODE_NAMES
SBHD_BATCH = 2
# The GPU parity tests' layer (FLA backend): FLA's Triton kernels want head dims of at least 16, and
# compile per head shape, so every GPU test uses this one shape (the rest small and fast).
GPU_CFG = dict(deterministic_mode=False, hidden_size=128, linear_num_key_heads=4, linear_num_value_heads=8,
               linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4)
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


def case_inputs(layout, cp, cp_rank, dtype, data_seed, hidden, device, sbhd_batch: int = SBHD_BATCH):
    """``(x, dout, rows, psp)``: global ``[S, B, H]`` / ``[T, 1, H]`` inputs of the case, this CP
    rank's global rows (zigzag) and ``psp(**dynamic_cp_fields)`` -> its PackedSeqParams (SBHD: None
    unless fields are given).

    ``layout``: ``"sbhd"``; ``"thd"`` (cut per document: :func:`thd_case`; the parity cases tell the
    layer with ``linear_cp_thd_split='per_document'``, see :func:`thd_split_cfg`); ``"thd_whole_row"``
    (documents of odd lengths, the row cut whole: Megatron's inter-document masking; the layer must
    be told, by ``linear_cp_thd_split='whole_row'`` or a record of Megatron's splitter).
    ``sbhd_batch``: B of the SBHD case (1: the rows of every rank are one zigzag-cut stream)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    if layout == "sbhd":
        s = sbhd_len(cp)
        x, dout = hidden_inputs(s, sbhd_batch, dtype, 100 + cp + 1000 * data_seed, hidden, device)
        rows = zigzag_rows([0, s], cp, cp_rank).to(device)
        psp = lambda **kw: PackedSeqParams(qkv_format="sbhd", **kw) if kw else None  # noqa: E731
    elif layout in ("thd", "thd_whole_row"):
        whole_row = layout == "thd_whole_row"
        cu_pad, cu_act = (document_packings(cp)["odd_documents"],) * 2 if whole_row else thd_case(cp)
        x, dout = hidden_inputs(cu_pad[-1], 1, dtype, 200 + cp + 1000 * data_seed, hidden, device)
        rows = zigzag_rows(cu_pad, cp, cp_rank, whole_row=whole_row).to(device)
        psp = lambda **kw: thd_params(cu_pad, cu_act, device=device, **kw)  # noqa: E731
    else:
        raise ValueError(f"layout must be 'sbhd', 'thd' or 'thd_whole_row', got {layout!r}")
    return x, dout, rows, psp


def thd_split_cfg(layout: str, cfg=None) -> dict:
    """``cfg`` with ``linear_cp_thd_split='per_document'`` added for the ``"thd"`` layout, whose rows
    this toolkit cuts per document itself (no record of Megatron's splitter: the layer must be told,
    it never guesses); other layouts, and a ``cfg`` that sets the field, are left as they are."""
    cfg = dict(cfg or {})
    if layout == "thd":
        cfg.setdefault("linear_cp_thd_split", "per_document")
    return cfg


def cp1_answer(base, layout, dtype, x, dout, psp):
    """The TP=1 CP=1 answer on the whole input. fp64 SBHD runs gdn-cp's path at CP=1 (stock
    computes its deterministic core in fp32); everything else runs the module as a user gets it."""
    with gdn_cp_forward() if layout == "sbhd" and dtype == torch.float64 else nullcontext():
        return run_layer(base, x, dout, psp())


def parity_case(rank, world, layout, dtype, modes, *, cfg=None, cp_group=None, dynamic=False, seed=1,
                data_seed=0, bias=True, conv_bias=True, device="cpu", metric=max_rel, sbhd_batch: int = SBHD_BATCH,
                spec: str = "local"):
    """One layout (``"sbhd"`` or ``"thd"``) and dtype on this rank: the CP=1 answer, then each mode
    under CP. Returns ``{mode: {quantity: error}}`` (a missing gradient is inf).

    ``cp_group`` (default: WORLD) is the group this micro-batch is split over; every rank of it
    calls with the same arguments. ``dynamic=False``: the modules are built with it as their static
    CP group (config context_parallel_size = its size). ``dynamic=True``: the modules keep the
    static WORLD group (context_parallel_size = world) and the micro-batch's PackedSeqParams carries
    ``cp_group`` and ``local_cp_size`` (dynamic CP). ``cfg`` overrides TransformerConfig fields.
    ``device`` / ``metric``: the GPU tests pass "cuda" and :func:`gdn_cp.ops.accuracy.rel_l2`.
    ``sbhd_batch``: B of the SBHD case (default 2; 1 makes every rank's rows one zigzag-cut stream).
    ``spec``: the layer's submodules (:data:`gdn_cp_testing.megatron.layer.SPECS`; ``te``: Megatron's
    own TransformerEngine spec).
    """
    import torch.distributed as dist

    groups = rank_groups()
    cp_group = groups["world"] if cp_group is None else cp_group
    cp, cp_rank = cp_group.size(), cp_group.rank()
    static_group = groups["world"] if dynamic else cp_group
    cfg = thd_split_cfg(layout, cfg)
    if spec == "te":  # TransformerEngine's modules are built on the GPU, as in training
        cfg = dict(cfg, use_cpu_initialization=False)
    build = partial(build_gdn, seed=seed, bias=bias, conv_bias=conv_bias, device=device, spec=spec)
    hidden = cfg.get("hidden_size", DIMS["hidden_size"])
    extra = dict(cp_group=cp_group, local_cp_size=cp) if dynamic else {}

    x, dout, rows, psp = case_inputs(layout, cp, cp_rank, dtype, data_seed, hidden, device, sbhd_batch)
    base = build(make_config(1, "headwise", dtype, **cfg), groups["self"])
    want = cp1_answer(base, layout, dtype, x, dout, psp)

    out = {}
    for mode in modes:
        module = build(make_config(static_group.size(), mode, dtype, **cfg), static_group)
        y, gx, grads = run_layer(module, x[rows], dout[rows], psp(**extra))
        for g in grads.values():
            if g is not None:
                dist.all_reduce(g, group=cp_group)
        out[mode] = compare((y, gx, grads), want, rows, metric)
    return out


def tp_parity_case(layout, dtype, modes, *, tp_group, cp_group, static_cp_group=None, sequence_parallel=False,
                   data_seed=0, cfg=None, seed=1, bias=True, conv_bias=True, device="cpu", metric=max_rel):
    """One layout and dtype at TP x CP on this rank against TP=1 CP=1 on the same full weights.
    Returns ``{mode: {quantity: error}}`` like :func:`parity_case`.

    ``tp_group`` / ``cp_group``: this rank's groups (:func:`gdn_cp_testing.megatron.tp.tp_cp_groups`);
    ``cp_group`` is the group the micro-batch is split over. ``static_cp_group`` (default
    ``cp_group``): the modules' static CP group; when it differs, the micro-batch brings
    ``cp_group`` in its PackedSeqParams (dynamic CP). ``sequence_parallel``: hidden_states and the
    output are split along their rows over TP. Every rank of a TP group must pass the same
    ``data_seed``.

    Compared, per rank: the output and the hidden_states gradient on this rank's rows, and every
    parameter gradient after what Megatron does before the optimizer: the TP step of
    finalize_model_grads (:func:`gdn_cp_testing.megatron.tp.finalize_tp_step`), the sum over CP
    (Megatron's DP-CP all-reduce) and, for TP-sharded parameters, the gather of the TP parts to
    full shape. Replicated parameters are compared on every TP rank as they are.
    """
    import torch.distributed as dist

    from gdn_cp_testing.megatron.tp import finalize_tp_step, gather_tp_grads, sp_slice

    groups = rank_groups()
    static_cp_group = cp_group if static_cp_group is None else static_cp_group
    tp, cp, cp_rank = tp_group.size(), cp_group.size(), cp_group.rank()
    cfg = thd_split_cfg(layout, cfg)
    hidden = cfg.get("hidden_size", DIMS["hidden_size"])
    build = partial(build_gdn, seed=seed, bias=bias, conv_bias=conv_bias, device=device)

    x, dout, rows, psp = case_inputs(layout, cp, cp_rank, dtype, data_seed, hidden, device)
    if sequence_parallel:
        rows = rows[sp_slice(rows.numel(), tp, tp_group.rank())]
    base = build(make_config(1, "headwise", dtype, **cfg), groups["self"])
    want = cp1_answer(base, layout, dtype, x, dout, psp)

    extra = dict(cp_group=cp_group, local_cp_size=cp) if static_cp_group is not cp_group else {}
    tp_cfg = dict(cfg, tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel)
    out = {}
    for mode in modes:
        config = make_config(static_cp_group.size(), mode, dtype, **tp_cfg)
        module = build(config, static_cp_group, tp_group=tp_group)
        # fp64 SBHD without CP: gdn-cp's path, as the baseline (stock's core computes in fp32)
        path = gdn_cp_forward() if layout == "sbhd" and dtype == torch.float64 and cp == 1 else nullcontext()
        with path:
            y, gx, grads = run_layer(module, x[rows], dout[rows], psp(**extra),
                                     after_backward=lambda m: finalize_tp_step(m, tp_group))
        for g in grads.values():
            if g is not None:
                dist.all_reduce(g, group=cp_group)
        out[mode] = compare((y, gx, gather_tp_grads(module, grads, tp_group)), want, rows, metric)
    return out


def tp_grid_case(grid, dtypes, modes=MODES, layouts=("sbhd", "thd"), **kw) -> dict:
    """:func:`tp_parity_case` for every ``(tp, cp, sequence_parallel)`` of ``grid``, layout and dtype,
    on Megatron's rank grid (:func:`gdn_cp_testing.megatron.tp.tp_cp_groups`; data-parallel
    replicas get different data). Returns ``{(tp, cp, sp, layout, str(dtype)): {mode: errors}}``;
    ``kw`` goes to :func:`tp_parity_case` (cfg, device, metric, bias, ...)."""
    from gdn_cp_testing.megatron.tp import tp_cp_groups

    out = {}
    for tp, cp, sp in grid:
        tp_group, cp_group, dp_rank = tp_cp_groups(tp, cp)
        for layout in layouts:
            for dtype in dtypes:
                out[(tp, cp, sp, layout, str(dtype))] = tp_parity_case(
                    layout, dtype, modes, tp_group=tp_group, cp_group=cp_group, sequence_parallel=sp,
                    data_seed=dp_rank, **kw)
    return out
