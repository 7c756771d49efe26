"""The shape sweep through Megatron's GatedDeltaNet (issue 46): every ``linear_cp_mode`` x CP 2 / 4 x the heads
a rank's kernels see (1, 2, 3, 4, 6 key heads per rank, GVA ratios 1-3) x head dim 64 / 128 x micro-batch 1 / 2
x SBHD / THD (cut per document, and as a whole row), each case against the same layer at CP=1 on the same
weights and inputs, or refused before any collective with the reason.

What a case should do is asked of gdn-cp's own rules, never restated here (:func:`expected_refusal`): the
mode's head rule (:func:`gdn_cp.modes.spec.head_problem`; ``auto`` resolved by
:func:`gdn_cp.megatron.config.resolve_linear_cp_mode`) and the backend's
(:func:`gdn_cp.ops.registry.backend_problem`: devices, head dims, dtypes, and whatever a backend adds there).
A case those rules refuse must be refused when its ``TransformerConfig`` is built, or at the latest by the
layer's first call before any collective; a case they accept must run and equal CP=1 within its tolerance.
:func:`sweep_on_rank` runs many cases in one spawned rank pool (cases of a CP size spread over the pool's
groups of that size); :func:`sweep_table` is the table of docs/megatron.md ("Shapes through the layer"),
made from the same rules.

Heads: per mode and CP size the layer's key heads are :data:`HEADS_PER_RANK` (what every rank's kernels see
in chunkwise and all_gather) and, for headwise (which splits the heads over CP), those times CP as well, so
that headwise runs each per-rank count and is refused on the layer head counts CP does not divide.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Optional

import torch

from gdn_cp_testing.results import JsonlRecorder

__all__ = [
    "CP_SIZES", "Case", "GVA_RATIOS", "HEADS_PER_RANK", "HEAD_DIMS", "LAYOUTS", "MICRO_BATCHES", "MODES",
    "REPORTED", "SEQ", "covering_cases", "expected_refusal", "layer_key_heads", "resolved_mode", "sweep_cases", "sweep_on_rank", "sweep_table",
]

MODES = ("headwise", "chunkwise", "all_gather", "auto")
CP_SIZES = (2, 4)
HEADS_PER_RANK = (1, 2, 3, 4, 6)
GVA_RATIOS = (1, 2, 3)
HEAD_DIMS = (64, 128)
MICRO_BATCHES = (1, 2)
LAYOUTS = ("sbhd", "thd_doc", "thd_row")
"""``sbhd``: ``[S, mbs, H]``, each sample cut zigzag; ``thd_doc``: the ``mbs`` samples packed into one row
(Megatron-LM's ``get_batch``), every document cut in 2*cp parts (``--sft``; lengths multiples of 8);
``thd_row``: the same row cut whole (``--dataloader-inter-document-masking``; documents of any length)."""
SEQ = 32  # tokens per sample: 2*cp parts of 4 (CP=4) or 8 (CP=2) rows
HIDDEN = 32
# each sample's documents (summing to SEQ): per document cut (multiples of 2*max(CP_SIZES)) / whole row
DOCUMENTS = {"thd_doc": ((8, 24), (32,)), "thd_row": ((13, 19), (32,))}


@dataclass(frozen=True, order=True)
class Case:
    mode: str
    cp: int
    key_heads: int  # the layer's (TP=1)
    ratio: int  # value heads per key head
    head_dim: int
    mbs: int
    layout: str

    @property
    def value_heads(self) -> int:
        return self.key_heads * self.ratio

    @property
    def shape(self) -> tuple:
        """What the CP=1 answer depends on: the layer's heads and head dim, the micro-batch and its layout."""
        return (self.key_heads, self.ratio, self.head_dim, self.mbs, self.layout)

    def label(self) -> str:
        return (f"{self.mode} cp{self.cp} heads {self.key_heads}/{self.value_heads} d{self.head_dim} "
                f"mbs{self.mbs} {self.layout}")


REPORTED = (Case("headwise", 2, 2, 3, 128, 2, "sbhd"),)
"""Shapes that crashed in a user's run, kept in the GPU set as they were: issue 46's crash 1, FlashQLA at
headwise CP=2 on 2 key / 6 value heads of 128 (1 / 3 per rank; TileLang found no layout for 3 value heads),
micro-batch 2, SBHD (``pretrain_hybrid.py`` without packing)."""


def layer_key_heads(mode: str, cp: int) -> tuple:
    """The layer key head counts the sweep gives ``mode`` at ``cp`` (module docstring)."""
    heads = set(HEADS_PER_RANK)
    if mode == "headwise":
        heads |= {h * cp for h in HEADS_PER_RANK}
    return tuple(sorted(heads))


def sweep_cases(modes=MODES, cp_sizes=CP_SIZES, head_dims=HEAD_DIMS, micro_batches=MICRO_BATCHES,
                layouts=LAYOUTS) -> list:
    """Every case of the sweep (the full product), in a fixed order."""
    return [Case(mode, cp, k, r, d, b, lay) for mode in modes for cp in cp_sizes for k in layer_key_heads(mode, cp)
            for r in GVA_RATIOS for d in head_dims for b in micro_batches for lay in layouts]


def covering_cases(modes=MODES, cp_sizes=CP_SIZES, every_ratio: bool = True) -> list:
    """The sweep's covering set: every mode x CP size x layer key heads (:func:`layer_key_heads`), with every GVA
    ratio (``every_ratio``) or one of them in turn, each with one head dim, micro-batch and layout, taken in turn
    so that every (mode, CP size) meets every value of each; a given (key heads, ratio, CP size) gets the same ones
    in every mode, so its CP=1 answer is computed once.

    ``every_ratio=True`` (the GPU run: 139 cases): (head dim, micro-batch, layout) cycles through all 12
    combinations along the (key heads, ratio) pairs, and the shapes users reported crashing (:data:`REPORTED`)
    are added where the cycle does not reach them. ``every_ratio=False`` (the CPU run: 46 cases): one ratio per
    key head count, head dim, micro-batch, layout and ratio each cycling on its own."""
    combos = list(itertools.product(HEAD_DIMS, MICRO_BATCHES, LAYOUTS))
    heads = sorted({k for mode in modes for cp in CP_SIZES for k in layer_key_heads(mode, cp)})
    out = []
    for mode in modes:
        for c, cp in enumerate(cp_sizes):
            for k in layer_key_heads(mode, cp):
                i = heads.index(k)
                if every_ratio:
                    out += [Case(mode, cp, k, r, *combos[(3 * i + n + c) % len(combos)])
                            for n, r in enumerate(GVA_RATIOS)]
                else:
                    out.append(Case(mode, cp, k, GVA_RATIOS[(i + 2 * c) % 3], HEAD_DIMS[(i + c) % 2],
                                    MICRO_BATCHES[(i // 2 + c) % 2], LAYOUTS[(i + c) % 3]))
    if every_ratio:
        out += [case for case in REPORTED if case.mode in modes and case.cp in cp_sizes and case not in out]
    return out


def resolved_mode(case: Case) -> str:
    """The concrete mode ``case.mode`` builds with (``auto`` resolved as the config resolves it)."""
    from gdn_cp.megatron.config import resolve_linear_cp_mode

    if case.mode != "auto":
        return case.mode
    return resolve_linear_cp_mode("auto", num_key_heads=case.key_heads, num_value_heads=case.value_heads, tp=1,
                                  cp=case.cp)


def rank_heads(case: Case) -> tuple:
    """``(key, value)`` heads a rank's kernels see: the layer's, over CP for headwise."""
    split = case.cp if resolved_mode(case) == "headwise" else 1
    return case.key_heads // split, case.value_heads // split


def expected_refusal(case: Case, backend: str, device_type: str, dtype: str) -> Optional[str]:
    """Why gdn-cp's rules refuse ``case`` on ``backend`` (``auto`` or a name) on ``device_type`` with activations
    of ``dtype`` (a torch dtype's name); None when they accept it."""
    from gdn_cp.modes.spec import head_problem
    from gdn_cp.ops.registry import backend_spec

    if case.mode != "auto":  # auto resolves to a legal mode wherever one is
        why = head_problem(case.mode, num_key_heads=case.key_heads, num_value_heads=case.value_heads, tp=1,
                           cp=case.cp)
        if why is not None:
            return why
    if backend == "auto":
        return None
    # the backend's own rule for a layer (gdn_cp.ops.registry.backend_problem without its probe of this
    # Python: whether the backend is installed here is the test's skip, not a property of the shape)
    spec = backend_spec(backend)
    if device_type not in spec.devices:
        return f"{spec.title} runs on {' or '.join(spec.devices)} only ({spec.devices_why}), not {device_type}"
    return spec.layer_problem((case.head_dim, case.head_dim), dtype)


# ------------------------------------------------------------------------------------------
# running the cases (inside a RankPool rank)
# ------------------------------------------------------------------------------------------
def _inputs(case: Case, dtype, device):
    """``(x, dout, cu)``: the case's global ``[S, mbs, H]`` (SBHD) or ``[mbs*S, 1, H]`` (THD) inputs, drawn from
    its shape alone (the same for every mode and CP size), and the packed row's boundaries (None for SBHD)."""
    from gdn_cp.layout.packings import cumsum0
    from gdn_cp_testing.inputs import hidden_inputs

    seed = 7000 + 100 * case.key_heads + 10 * case.ratio + case.head_dim + 3 * case.mbs + LAYOUTS.index(case.layout)
    if case.layout == "sbhd":
        x, dout = hidden_inputs(SEQ, case.mbs, dtype, seed, HIDDEN, device)
        return x, dout, None
    docs = [n for sample in DOCUMENTS[case.layout][: case.mbs] for n in sample]
    x, dout = hidden_inputs(SEQ * case.mbs, 1, dtype, seed, HIDDEN, device)
    return x, dout, cumsum0(docs)


def _config_fields(case: Case, backend: str) -> dict:
    fields = dict(hidden_size=HIDDEN, linear_num_key_heads=case.key_heads, linear_num_value_heads=case.value_heads,
                  linear_key_head_dim=case.head_dim, linear_value_head_dim=case.head_dim, linear_conv_kernel_dim=4,
                  linear_cp_backend=backend, deterministic_mode=backend == "reference")
    if case.layout != "sbhd":
        fields["linear_cp_thd_split"] = "per_document" if case.layout == "thd_doc" else "whole_row"
    return fields


def _answer(ctx, case: Case, cp: int, group, backend: str, dtype, mode: str):
    """The layer of ``case`` at CP size ``cp`` (``group``) in ``mode`` on this rank's rows: ``("ran", (y,
    x.grad, {param: grad summed over the group}), rows)`` or ``("refused", where, message, collectives run)``."""
    from contextlib import nullcontext

    from gdn_cp_testing.megatron.layer import build_gdn, gdn_cp_forward, make_config, run_layer, thd_params
    from gdn_cp_testing.packings import zigzag_rows

    device = ctx.device
    x, dout, cu = _inputs(case, dtype, device)
    rank = group.rank()
    if cu is None:
        rows = zigzag_rows([0, SEQ], cp, rank).to(device)
        psp = None
    else:
        rows = zigzag_rows(cu, cp, rank, whole_row=case.layout == "thd_row").to(device)
        psp = thd_params(cu, device=device)
    before = ctx.collective_count()
    try:
        config = make_config(cp, mode, dtype, **_config_fields(case, backend))
    except ValueError as e:
        return ("refused", "config", str(e), ctx.collective_count() - before)
    module = build_gdn(config, group, seed=11, device=device)
    # fp64 SBHD without CP: gdn-cp's path (stock computes its deterministic core in fp32)
    path = gdn_cp_forward() if cp == 1 and cu is None and dtype == torch.float64 else nullcontext()
    before = ctx.collective_count()
    try:
        with path:
            y, gx, grads = run_layer(module, x[rows], dout[rows], psp)
    except ValueError as e:
        return ("refused", "first call", str(e), ctx.collective_count() - before)
    present = [g for g in grads.values() if g is not None]
    if cp > 1 and present:  # summed over CP (Megatron's DP-CP all-reduce), in one collective
        flat = torch.cat([g.reshape(-1) for g in present])
        torch.distributed.all_reduce(flat, group=group)
        for g, part in zip(present, flat.split([g.numel() for g in present])):
            g.copy_(part.view_as(g))
    return ("ran", (y, gx, grads), rows)


def _on(answer, device):
    """A CP=1 answer handed round between ranks, its tensors on ``device``."""
    if answer[0] != "ran":
        return answer
    (y, gx, grads), rows = answer[1], answer[2]
    grads = {n: None if g is None else g.to(device) for n, g in grads.items()}
    return ("ran", (y.to(device), gx.to(device), grads), rows.to(device))


def sweep_on_rank(ctx, cases, backend: str, dtype_name: str, metric_name: str = "max_rel") -> dict:
    """Run ``cases`` on the pool (every rank calls it with the same arguments): first every shape's CP=1 answer,
    the shapes spread over all the pool's ranks (their first compiles side by side) and handed round through the
    host; then the cases of each CP size spread over the pool's groups of that size, each against its answer.
    Returns this rank's ``{case: ("ran", {quantity: error}) | ("refused", where, message, collectives)}`` for the
    cases its group ran; a CP=1 answer that is refused makes ``("refused", "cp1 " + where, ...)``."""
    from gdn_cp.ops import accuracy
    from gdn_cp_testing.megatron.layer import rank_groups
    from gdn_cp_testing.megatron.parity import compare

    dtype = getattr(torch, dtype_name)
    metric = getattr(accuracy, metric_name)
    # each case as it ends (a group's first rank): what a stage killed at its time limit still leaves; the pool's
    # context row once, from rank 0 before the CP=1 answers' all_gather (so before every case's row)
    recorder = JsonlRecorder.from_env("GDN_CP_GPU_RESULTS", context=ctx.rank == 0, test="shape_sweep", backend=backend)
    recorder.write_context()
    record = recorder.record
    t0 = time.perf_counter()
    by_shape = {c.shape: c for c in sorted(cases)}
    shapes = sorted(by_shape)
    alone = rank_groups()["self"]
    mine = {s: _on(_answer(ctx, by_shape[s], 1, alone, backend, dtype, "chunkwise"), "cpu")
            for s in shapes[ctx.rank::ctx.world_size]}
    parts: list = [None] * ctx.world_size
    torch.distributed.all_gather_object(parts, mine)  # pickled through the host: every rank gets every answer
    answers = {s: _on(a, ctx.device) for part in parts for s, a in part.items()}
    if ctx.rank == 0:
        record("shape_sweep_cp1", shapes=len(shapes), ranks=ctx.world_size, seconds=round(time.perf_counter() - t0, 1))
    out: dict = {}
    for cp in sorted({c.cp for c in cases}):
        group, groups = ctx.group(cp), ctx.world_size // cp
        for i, case in enumerate(c for c in cases if c.cp == cp):
            if i % groups != ctx.rank // cp:  # the pool's groups of a size are contiguous
                continue
            t0 = time.perf_counter()  # the case's seconds, its first compiles included
            want = answers[case.shape]
            got = _answer(ctx, case, cp, group, backend, dtype, case.mode)
            if want[0] == "refused":
                out[case] = got if got[0] == "refused" else ("refused", "cp1 " + want[1], want[2], want[3])
            elif got[0] == "refused":
                out[case] = got
            else:
                out[case] = ("ran", compare(got[1], want[1], got[2], metric))
            if group.rank() == 0:
                ran = out[case][0] == "ran"
                record("shape_sweep_case", case=case.label(), outcome=out[case][0],
                       seconds=round(time.perf_counter() - t0, 1), errors=out[case][1] if ran else None,
                       refusal=None if ran else str(out[case][2])[:300])
    return out


# ------------------------------------------------------------------------------------------
# the docs table
# ------------------------------------------------------------------------------------------
def _heads_text(heads) -> str:
    return ", ".join(map(str, heads)) if heads else "none"


def sweep_table(backends=(("reference", "cpu", "float64"), ("fla", "cuda", "bfloat16"),
                          ("flashqla", "cuda", "bfloat16"))) -> str:
    """The markdown table of what runs, from :func:`expected_refusal`: per mode and CP size, the layer key heads
    that run (with every GVA ratio, head dim, micro-batch and layout of the sweep) and those refused, with the
    rule's reason; then per backend and head dim, whether it runs."""
    lines = ["| mode | CP | layer key heads that run (per rank) | refused | why |", "| --- | --- | --- | --- | --- |"]
    for mode in MODES:
        for cp in CP_SIZES:
            runs, refused, why = [], [], []
            for k in layer_key_heads(mode, cp):
                case = Case(mode, cp, k, 1, HEAD_DIMS[0], 1, "sbhd")
                reasons = [expected_refusal(Case(mode, cp, k, r, HEAD_DIMS[0], 1, "sbhd"), "auto", "cpu", "float64")
                           for r in GVA_RATIOS]
                if not any(reasons):
                    runs.append(f"{k} ({rank_heads(case)[0]})")
                else:
                    refused.append(str(k))
                    why += [r for r in reasons if r]
            shown = mode
            if mode == "auto":
                resolved = {resolved_mode(Case(mode, cp, k, 1, 64, 1, "sbhd")) for k in layer_key_heads(mode, cp)}
                shown = f"auto (resolves to {_heads_text(sorted(resolved))})"
            lines.append(f"| {shown} | {cp} | {_heads_text(runs)} | {_heads_text(refused)} | "
                         f"{('e.g. ' + why[0]) if why else '-'} |")
    lines += ["", "| backend | device, dtype | head dim | runs | why not |", "| --- | --- | --- | --- | --- |"]
    for name, device, dtype in backends:
        for d in HEAD_DIMS:
            why = expected_refusal(Case("chunkwise", 2, 1, 1, d, 1, "sbhd"), name, device, dtype)
            lines.append(f"| {name} | {device}, {dtype} | {d} | {'no' if why else 'yes'} | "
                         f"{(why or '-').replace('|', '/')} |")
    return "\n".join(lines)
