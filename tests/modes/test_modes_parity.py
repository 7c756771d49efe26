"""Every mode at cp=2 and 4 equals CP=1: outputs, input gradients, conv gradients.

SBHD and packed THD (sequences straddling contiguous rank boundaries, empty padding
slots) cut per document, and packed THD cut as one whole row (documents of any length:
Megatron's --dataloader-inter-document-masking), fp64 and fp32, on real gloo ranks with the
reference backend.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

import gdn_cp.modes.chunkwise as chunkwise_module
from gdn_cp.layout import PER_DOCUMENT, WHOLE_ROW, RouteCache, plan_for_sbhd
from gdn_cp.modes import GDNShape, gdn_core, sbhd_to_thd
from gdn_cp.ops import get_backend
from gdn_cp.modes.inputs import core_inputs
from gdn_cp_testing.inputs import cp1_core_answer
from gdn_cp.ops.accuracy import max_rel
from gdn_cp_testing.packings import document_packings, zigzag_rows
from gdn_cp.ops.accuracy import CP_VS_CP1_MAX_REL
from gdn_cp.modes.spec import MODE_NAMES

MODES = MODE_NAMES
SHAPE = GDNShape(num_k_heads=4, num_v_heads=8, head_k_dim=8, head_v_dim=12)
WIDTH = 4
TOL = CP_VS_CP1_MAX_REL


def thd_boundaries(cp):
    u = 2 * cp
    lengths = [5 * u, 0, 23 * u, 2 * u, 0, 11 * u]  # straddling + empty slots + short ones
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def scan_only_backend():
    """The reference kernels without ``chunk_state_summary``: chunkwise then takes its state
    summaries from scans (tail first, mid while the gather travels), as with FLA on gloo."""
    return replace(get_backend("reference"), chunk_state_summary=None)


def _run_modes(ctx, layout, dtype, modes=MODES, mutate=None, shape=SHAPE, scan_only=False):
    rank, world = ctx.rank, ctx.world_size
    group = dist.group.WORLD
    backend = scan_only_backend() if scan_only else get_backend("reference")
    out = {}
    if layout in ("thd", "thd_whole_row"):
        whole_row = layout == "thd_whole_row"
        cu = document_packings(world)["odd_documents"] if whole_row else thd_boundaries(world)
        inputs = core_inputs(cu[-1], shape, WIDTH, dtype, seed=7)
        ref_o, ref_g = cp1_core_answer(inputs, shape, cu)
        rows = zigzag_rows(cu, world, rank, whole_row=whole_row)
        split = WHOLE_ROW if whole_row else PER_DOCUMENT
        plan = RouteCache().plan(torch.tensor(cu, dtype=torch.int32), world, rank, split)
        to_local = lambda t: t[rows]  # noqa: E731
    else:
        seq, batch = 24 * world, 3
        cu = [b * seq for b in range(batch + 1)]
        inputs = core_inputs(cu[-1], shape, WIDTH, dtype, seed=11)
        ref_o, ref_g = cp1_core_answer(inputs, shape, cu)  # b-major packed = CP=1 SBHD
        plan = plan_for_sbhd(seq, batch, world, rank)
        s_rows = zigzag_rows([0, seq], world, rank)
        to_sbhd = lambda t: t.reshape(batch, seq, *t.shape[1:]).transpose(0, 1)  # noqa: E731
        to_local = lambda t: sbhd_to_thd(to_sbhd(t)[s_rows])  # noqa: E731
    for mode in modes:
        leaves = {k: to_local(inputs[k]).detach().clone().requires_grad_(True) for k in ("qkv", "g", "beta")}
        weights = {k: inputs[k].detach().clone().requires_grad_(True) for k in ("conv_weight", "conv_bias")}
        if mutate is not None:
            mutate()
        o = gdn_core(
            leaves["qkv"], leaves["g"], leaves["beta"], weights["conv_weight"], weights["conv_bias"],
            shape=shape, mode=mode, plan=plan, group=group, backend=backend,
        )
        o.backward(to_local(inputs["dout"]))
        errs = {"out": max_rel(o.detach(), to_local(ref_o))}
        for k in ("qkv", "g", "beta"):
            errs[k] = max_rel(leaves[k].grad, to_local(ref_g[k]))
        # Parameters are replicated over CP: their gradients sum over ranks (Megatron's DP-CP all-reduce).
        for k in ("conv_weight", "conv_bias"):
            grad = weights[k].grad.clone()
            dist.all_reduce(grad, group=group)
            errs[k] = max_rel(grad, ref_g[k])
        out[mode] = errs
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("layout", ["thd", "thd_whole_row", "sbhd"])
@pytest.mark.parametrize("world", [2, 4])
def test_modes_equal_cp1(rank_pool, world, layout, dtype):
    results = rank_pool(world).run(_run_modes, layout, dtype)
    tol = TOL[dtype]
    for rank, per_mode in enumerate(results):
        for mode, errs in per_mode.items():
            bad = {k: v for k, v in errs.items() if not v <= tol}
            assert not bad, f"rank {rank} {mode} {layout} {dtype}: relative errors over {tol}: {bad}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("layout", ["thd", "thd_whole_row", "sbhd"])
@pytest.mark.parametrize("world", [2, 4])
def test_chunkwise_with_summaries_from_scans_equals_cp1(rank_pool, world, layout, dtype):
    """The other summary flow (a backend without chunk_state_summary, like FLA)."""
    results = rank_pool(world).run(_run_modes, layout, dtype, ("chunkwise",), None, SHAPE, True)
    for rank, per_mode in enumerate(results):
        bad = {k: v for k, v in per_mode["chunkwise"].items() if not v <= TOL[dtype]}
        assert not bad, f"rank {rank} chunkwise (scan summaries) {layout} {dtype}: errors over {TOL[dtype]}: {bad}"


def _drop_state():
    original = chunkwise_module.initial_state_from_summaries
    chunkwise_module.initial_state_from_summaries = lambda s, cw, dk: original(s, cw, dk) * 0


def _drop_halo():
    original = chunkwise_module.gather_halo

    def zero_halo(x, cw, index, group):
        x, halo = original(x, cw, index, group)
        return x, torch.zeros_like(halo)

    chunkwise_module.gather_halo = zero_halo


def _mutated(ctx, which, scan_only):
    saved = (chunkwise_module.initial_state_from_summaries, chunkwise_module.gather_halo)
    try:
        return _run_modes(ctx, "thd", torch.float64, modes=("chunkwise",), mutate=which, scan_only=scan_only)
    finally:
        chunkwise_module.initial_state_from_summaries, chunkwise_module.gather_halo = saved


@pytest.mark.parametrize("scan_only", [False, True], ids=["tree_summaries", "scan_summaries"])
@pytest.mark.parametrize("which", [_drop_state, _drop_halo], ids=["drop_incoming_state", "drop_halo"])
def test_parity_check_can_fail(rank_pool, which, scan_only):
    """The comparison above is not vacuous: losing the state or the halo breaks it."""
    results = rank_pool(2).run(_mutated, which, scan_only)
    worst = max(errs["out"] for r in results for errs in r.values())
    assert worst > 1e-3, f"dropping {which.__name__} went unnoticed (max error {worst})"


ODD = GDNShape(num_k_heads=3, num_v_heads=6, head_k_dim=8, head_v_dim=8)


def _odd_heads(ctx):
    results = _run_modes(ctx, "thd", torch.float64, modes=("chunkwise", "all_gather"), shape=ODD)
    try:
        _run_modes(ctx, "thd", torch.float64, modes=("headwise",), shape=ODD)
    except ValueError as err:
        results["headwise_error"] = str(err)
    return results


def test_heads_not_divisible_by_cp(rank_pool):
    for res in rank_pool(2).run(_odd_heads):
        err = res["headwise_error"]  # the registry's one heads error (gdn_cp.modes.spec.heads_error)
        assert "shape.num_k_heads=" in err and "is not divisible by" in err and "Fix: set linear_cp_mode to 'chunkwise'" in err
        for mode in ("chunkwise", "all_gather"):
            assert max(res[mode].values()) <= 1e-10, res[mode]


def _tiny_slices(ctx, scan_only=False):
    """T_local = 2 < W-1 = 3: a rank's halo comes from two earlier ranks."""
    global thd_boundaries
    saved = thd_boundaries
    thd_boundaries = lambda cp: [0, 2 * cp, 2 * cp]  # noqa: E731  one sequence over all ranks + empty slot
    try:
        return _run_modes(ctx, "thd", torch.float64, modes=("chunkwise", "all_gather"), scan_only=scan_only)
    finally:
        thd_boundaries = saved


@pytest.mark.parametrize("scan_only", [False, True], ids=["tree_summaries", "scan_summaries"])
def test_halo_from_several_ranks_when_slices_are_shorter_than_the_conv(rank_pool, scan_only):
    """Also: every middle rank's slice is one sequence continuing on both sides ([M | S_ext])."""
    for res in rank_pool(4).run(_tiny_slices, scan_only):
        for mode, errs in res.items():
            assert max(errs.values()) <= 1e-10, (mode, errs)


class _ToySegment:
    """A layer's per-token work in miniature (Segment): fixed linear maps from hidden rows to q|k|v,
    the gates and z, and from the gated core output back to hidden. fp64, on any rows."""

    def __init__(self, shape, hidden, seed):
        gen = torch.Generator().manual_seed(seed)
        w = lambda *size: torch.randn(*size, generator=gen, dtype=torch.float64) / size[0] ** 0.5  # noqa: E731
        self.shape = shape
        self.w_in = w(hidden, shape.conv_dim + 2 * shape.num_v_heads + shape.value_dim).requires_grad_(True)
        self.w_out = w(shape.value_dim, hidden).requires_grad_(True)
        self.conv_weight = (w(shape.conv_dim, WIDTH) * 0.5).requires_grad_(True)
        self.conv_bias = None

    def project(self, hidden):
        from gdn_cp.modes import Projected

        s = self.shape
        rows = sbhd_to_thd(hidden) @ self.w_in
        qkv, a, b, z = torch.split(rows, [s.conv_dim, s.num_v_heads, s.num_v_heads, s.value_dim], dim=-1)
        return Projected(qkv, -0.3 * torch.nn.functional.softplus(a), b.sigmoid(),
                         z.reshape(-1, s.num_v_heads, s.head_v_dim))

    def finish(self, o, gate, batch):
        from gdn_cp.modes import thd_to_sbhd

        y = (o * torch.nn.functional.silu(gate)).reshape(o.shape[0], -1) @ self.w_out
        return thd_to_sbhd(y, batch), None


def _mode_runs_the_segment(ctx):
    """Mode.run: the whole segment (project, core, finish) under each mode, and chunkwise with its
    layout swap at hidden_states and at the core, against the CP=1 run of the same segment."""
    from gdn_cp.modes import CallContext, LayerFacts, Settings, prepare_mode

    rank, world = ctx.rank, ctx.world_size
    hidden, batch, seq = 24, 2, 8 * world
    plan_1, plan = plan_for_sbhd(seq, batch, 1, 0), plan_for_sbhd(seq, batch, world, rank)
    x = torch.randn(seq, batch, hidden, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    dout = torch.randn(seq, batch, hidden, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    rows = zigzag_rows(list(range(0, batch * seq + 1, seq)), world, rank).reshape(batch, -1)[0]  # one sequence's rows

    def run(mode, swap, group, plan, x, dout):
        segment = _ToySegment(SHAPE, hidden, seed=9)
        settings = Settings(mode=mode, chunkwise_swap=swap)
        layer = LayerFacts(label="toy", hidden_size=hidden, tp=1, sequence_parallel=False, act_bytes=8)
        call = CallContext(settings=settings, shape=SHAPE, plan=plan, group=group, backend=get_backend("reference"),
                           layer=layer)
        x = x.detach().clone().requires_grad_(True)
        way = prepare_mode(call)
        out, _ = way.run(call, x, segment)
        out.backward(dout)
        grads = [t.grad for t in (x, segment.w_in, segment.w_out, segment.conv_weight)]
        return way, out.detach(), grads

    _, want, want_grads = run("chunkwise", "auto", None, plan_1, x, dout)
    out = {}
    for mode, swap in (("headwise", "auto"), ("all_gather", "auto"), ("chunkwise", "hidden"), ("chunkwise", "core")):
        way, got, grads = run(mode, swap, dist.group.WORLD, plan, x[rows], dout[rows])
        errs = {"out": max_rel(got, want[rows]), "grad:hidden": max_rel(grads[0], want_grads[0][rows])}
        for name, g, w in zip(("w_in", "w_out", "conv_weight"), grads[1:], want_grads[1:]):
            dist.all_reduce(g)  # parameters: gradients sum over the CP ranks
            errs[f"grad:{name}"] = max_rel(g, w)
        out[(mode, swap, getattr(way, "swap", None))] = errs
    return out


def test_every_mode_runs_the_layer_segment(rank_pool):
    """chunkwise moves hidden_states (hidden) or q|k|v and the gates (core) itself; either way, and
    every other mode, the segment equals CP=1."""
    for res in rank_pool(2).run(_mode_runs_the_segment):
        assert {(mode, swap, point) for mode, swap, point in res} == {
            ("headwise", "auto", None), ("all_gather", "auto", None), ("chunkwise", "hidden", "hidden"),
            ("chunkwise", "core", "core")}
        for key, errs in res.items():
            assert max(errs.values()) <= 1e-10, (key, errs)


def test_sbhd_packing_round_trip():
    x = torch.arange(4 * 3 * 2).reshape(4, 3, 2)  # [S_local, B, F]
    packed = sbhd_to_thd(x)
    assert packed.shape == (12, 2) and torch.equal(packed[4], x[0, 1])  # b-major: row b*S_local + s
    from gdn_cp.modes import thd_to_sbhd

    assert torch.equal(thd_to_sbhd(packed, 3), x)


NO_L2 = GDNShape(num_k_heads=4, num_v_heads=8, head_k_dim=8, head_v_dim=12, qk_l2norm=False)


def _no_l2norm(ctx):
    return _run_modes(ctx, "thd", torch.float64, shape=NO_L2)


def test_modes_without_qk_l2norm(rank_pool):
    """use_qk_l2norm=False reaches every path (the summaries included), not only CP=1."""
    for res in rank_pool(2).run(_no_l2norm):
        for mode, errs in res.items():
            assert max(errs.values()) <= 1e-8, (mode, errs)


def _whole_row_rows_with_a_per_document_plan(ctx):
    """Rows cut as a whole row but planned as cut per document (documents whose lengths happen to
    divide by 2*cp, so no check can refuse it): every mode must then differ from CP=1, which is
    what a wrong split looks like and why the split is never guessed."""
    rank, world = ctx.rank, ctx.world_size
    u = 2 * world
    cu = [0, 4 * u, 10 * u]
    inputs = core_inputs(cu[-1], SHAPE, WIDTH, torch.float64, seed=5)
    ref_o, _ = cp1_core_answer(inputs, SHAPE, cu)
    rows = zigzag_rows(cu, world, rank, whole_row=True)
    out = {}
    for split in (PER_DOCUMENT, WHOLE_ROW):
        plan = RouteCache().plan(torch.tensor(cu), world, rank, split)
        for mode in MODES:
            o = gdn_core(*(inputs[k][rows] for k in ("qkv", "g", "beta")), inputs["conv_weight"], inputs["conv_bias"],
                         shape=SHAPE, mode=mode, plan=plan, group=dist.group.WORLD, backend=get_backend("reference"))
            out[(split, mode)] = max_rel(o, ref_o[rows])
    return out


def test_wrong_split_is_visible(rank_pool):
    for res in rank_pool(2).run(_whole_row_rows_with_a_per_document_plan):
        for mode in MODES:
            assert res[(WHOLE_ROW, mode)] <= 1e-10 and res[(PER_DOCUMENT, mode)] > 1e-2, (mode, res)
