"""Megatron-LM's own training scripts at CP > 1 against CP=1, on text the model is still learning: per-iteration
loss and grad norm, each CP > 1 run judged against the noise pairs of its own model (:mod:`benchmarks.mlm_verdict`).
docs/performance.md ("Training against CP=1: the judgement") gives the schedule, the pairs and the rule, and its "Not
run yet" list the groups, their estimates and the device calls.

Runs ``pretrain_hybrid.py`` and ``pretrain_gpt.py`` from a patched Megatron-LM checkout through
:mod:`gdn_cp_testing.megatron.lm` at the sizes of :class:`~gdn_cp_testing.megatron.lm.RunSpec` (group ``sweep``: tiny
ones), CP=1 over NCCL, CP > 1 as gloo ranks sharing one GPU (or one rank per GPU over NCCL where there are enough
GPUs), on this machine's Python standard library as byte-level tokens (:mod:`gdn_cp_testing.megatron.byte_text`,
built into ``--work`` first; its provenance is the results' ``data``). ``--groups`` picks the rows (:data:`GROUPS`;
a run's CP=1 reference and pairs come along); runs start in matrix order under ``--max-ranks`` while their estimate
(:func:`estimate_s`) fits ``--budget-s`` (else ``not run (budget)``). The JSON (``--out``) is rewritten after every
run; ``--resume FILE.json`` keeps FILE's finished rows (same data and stack); ``--dry-run`` prints the plan over
device calls; ``--plot FILE.json`` prints the table and draws ``FILE.png``.

    python3 -m benchmarks.train_megatron_lm --checkout /tmp/mlm --out $OUT/train_megatron_lm.json --groups main
    python3 -m benchmarks.train_megatron_lm --dry-run --groups main,sweep --budget-s 450
    python3 -m benchmarks.train_megatron_lm --plot benchmarks/results/train_megatron_lm.json
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import heapq
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from gdn_cp_testing.megatron import byte_text
from gdn_cp_testing.megatron.lm import (GIB_PER_RANK, RunSpec, build_dataset_helpers, gib_per_rank, gpu_memory_mib, launch,
                                        write_sft_set)

from .common import csv_choices, machine_info, now_iso, setup_logging, versions, write_json
from .mlm_verdict import (GOOD, REFUSED, RULE, RULES, STOCK, SWEEP, base_name, bands, judge,  # noqa: F401
                          model_key, not_as_required, numerics, plot, plot_panels, rel_diffs, still_learning, table)

logger = logging.getLogger("benchmarks.train_megatron_lm")

PAIRS = {
    "swiglu": ("the MLP's SwiGLU by eager ops instead of Megatron's fused kernel: the same formula, rounded elsewhere",
               dict(extra_args=("--no-bias-swiglu-fusion",))),
    "mbs1": ("micro-batch 1: each step accumulates 4 micro-batches instead of 2, the same samples and the same average "
             "loss; every kernel sees another batch size, the gradients another summation order", dict(micro_batch=1)),
    "autotune": ("FLA's Triton kernels at their first working config (GDN_CP_TEST_FAST_AUTOTUNE=1) instead of the "
                 "autotuned one: other tiles, so other reduction orders inside the GDN kernels",
                 dict(env=(("GDN_CP_TEST_FAST_AUTOTUNE", "1"),))),
    "gdncp": ("every GDN layer through gdn-cp's path at CP=1 (GDN_CP_MLM_GDN_CP_AT_CP1=1) instead of stock's ops: its "
              "glue kernels and the core's layout, the same math rounded elsewhere (run 2026-12-07o: at iteration 1 "
              "as far from CP=1 as the swiglu pair, 3.6e-3 of the gradient), what a CP > 1 row runs on SBHD rows",
              dict(env=(("GDN_CP_MLM_GDN_CP_AT_CP1", "1"),))),
    "ce": ("the loss by Megatron's fused cross-entropy kernel (--cross-entropy-loss-fusion): the same softmax "
           "cross-entropy in one kernel", dict(extra_args=("--cross-entropy-loss-fusion",))),
    "attn": ("attention by TransformerEngine's unfused path (--attention-backend unfused: softmax of the materialised "
             "scores; Megatron refuses NVTE_* switches beside its default auto, run 2026-12-07k) instead of a fused "
             "kernel: the same attention, rounded elsewhere", dict(extra_args=("--attention-backend", "unfused"))),
}
"""Harmless perturbations of a CP=1 run: ``kind -> (what, changes)``. None changes the model, the data, the
samples or their order; each changes only how the same arithmetic is rounded."""
PAIRS_OF = {"default": ("swiglu", "mbs1", "autotune"), "main": ("swiglu", "mbs1", "autotune", "ce", "gdncp"),
            # FP8: no micro-batch pair (delayed scaling's amax history moves once per micro-batch)
            # (no pair of fp32 gradient accumulation: Megatron-LM's validate_args sets it for every bf16 run)
            "fp8": ("swiglu", "ce", "autotune"), "no_gdn": ("swiglu", "ce", "attn")}

PADDED_CUT = ("--linear-cp-thd-split", "per_document")
"""A GDN-only model's --dataloader-inter-document-masking rows padded and cut per document (as a model with
attention layers gets them) instead of cut whole."""
GROUPS = ("main", "sweep", "more", "parallel", "fp8", "flashqla", "fp32")
MODES = ("chunkwise", "headwise", "all_gather")
_H, _P, _G = dict(model="hybrid"), dict(model="gpt"), dict(model="hybrid", pattern="G-G-")
IDM = dict(data="inter_document_masking")


def noise_pairs(ref: RunSpec, kinds) -> list[tuple[RunSpec, str]]:
    """``ref`` again with each perturbation of :data:`PAIRS` named in ``kinds``, judged against ``ref``."""
    out = []
    for kind in kinds:
        change = dict(PAIRS[kind][1])
        change["extra_args"] = ref.extra_args + change.get("extra_args", ())
        change["env"] = ref.env + change.get("env", ())
        out.append((dataclasses.replace(ref, name=f"{ref.name}_{kind}_noise", **change), ref.name))
    return out


def _with_pairs(ref: RunSpec, kinds="default") -> list[tuple[RunSpec, str]]:
    return [(ref, "")] + noise_pairs(ref, PAIRS_OF[kinds])


NO_GDN_MAIN = dict(model="hybrid", pattern="*-*-*-")
"""Group ``main``'s control: the hybrid's sizes, attention for GDN: Megatron's own CP only (docs/performance.md, run g)."""


def _main() -> list[tuple[RunSpec, str]]:
    rows = []
    for name, kind in (("hybrid", _H), ("gpt", _P)):
        rows += _with_pairs(RunSpec(f"{name}_cp1", **kind), "main")
    rows += _with_pairs(RunSpec("nogdn_cp1", **NO_GDN_MAIN), "no_gdn") + [(RunSpec("nogdn_cp2", **NO_GDN_MAIN, cp=2), "nogdn_cp1")]
    for name, kind in (("hybrid", _H), ("gpt", _P)):
        rows += [(RunSpec(f"{name}_cp{cp}_{m}", **kind, cp=cp, mode=m), f"{name}_cp1") for cp in (4, 2) for m in MODES]
    return rows + [(RunSpec(f"{name}_cp2_stock", **kind, cp=2, stock=True), STOCK + f"{name}_cp1")
                   for name, kind in (("hybrid", _H), ("gpt", _P))]


def _fp32() -> list[tuple[RunSpec, str]]:
    F = dict(_G, precision="fp32")
    return (_with_pairs(RunSpec("gdnonly_fp32_cp1", **F))
            + [(RunSpec(f"gdnonly_fp32_cp{cp}_{m}", **F, cp=cp, mode=m), "gdnonly_fp32_cp1") for cp in (4, 2) for m in MODES])


def _more() -> list[tuple[RunSpec, str]]:
    # issue 39's order: GPT inter-document masking, --sft, both recomputes; then the GDN-only model (its own pairs),
    # whole-row and padded cut; hybrid inter-document masking (shown on mock data before) last
    auto = dict(mode="auto")
    rows = [(RunSpec("gpt_idm_cp1", **_P, **IDM), "")]
    rows += [(RunSpec(f"gpt_idm_cp{cp}", **_P, **IDM, cp=cp, **auto), "gpt_idm_cp1") for cp in (4, 2)]
    rows += [(RunSpec("hybrid_sft_cp1", **_H, data="sft"), ""),
             (RunSpec("hybrid_sft_cp2", **_H, data="sft", cp=2, **auto), "hybrid_sft_cp1"),
             (RunSpec("hybrid_full_recompute_cp2", **_H, cp=2, **auto, recompute="full"), "hybrid_cp1"),
             (RunSpec("gpt_norm_out_recompute_cp2", **_P, cp=2, **auto, recompute="gdn_norm_out"), "gpt_cp1"),
             (RunSpec("hybrid_sft_cp4", **_H, data="sft", cp=4, **auto), "hybrid_sft_cp1")]
    rows += _with_pairs(RunSpec("gdnonly_idm_cp1", **_G, **IDM))
    rows += [(RunSpec(f"gdnonly_idm_cp{cp}", **_G, **IDM, cp=cp, **auto), "gdnonly_idm_cp1") for cp in (4, 2)]
    rows += [(RunSpec(f"gdnonly_idm_padded_cp{cp}", **_G, **IDM, cp=cp, **auto, extra_args=PADDED_CUT),
              "gdnonly_idm_cp1") for cp in (4, 2)]
    rows += [(RunSpec("hybrid_idm_cp1", **_H, **IDM), "")]
    return rows + [(RunSpec(f"hybrid_idm_cp{cp}", **_H, **IDM, cp=cp, **auto), "hybrid_idm_cp1") for cp in (4, 2)]


def _flashqla(site: Optional[str]) -> list[tuple[RunSpec, str]]:
    # needs FlashQLA (pip install -e '.[flashqla]'; on the GPU machine --flashqla-site); head dims 128, bf16
    Q = dict(model="hybrid", backend="flashqla", site=site)
    return (_with_pairs(RunSpec("hybrid_flashqla_cp1", **Q))
            + [(RunSpec(f"hybrid_flashqla_cp{cp}_{m}", **Q, cp=cp, mode=m), "hybrid_flashqla_cp1")
               for cp, m in ((2, "chunkwise"), (2, "headwise"), (4, "chunkwise"))])


PARALLEL_PATTERN = "GEG*E-"
"""``pretrain_hybrid.py``'s pattern of groups ``parallel`` and ``fp8``: GDN, MoE, GDN, attention, MoE, MLP (the layer
kinds a Qwen3-Next-style model interleaves; 4 experts, top-2)."""
AUX_LOSS = ("--moe-aux-loss-coeff", "0.01")
"""A load-balancing loss over every routed token (Megatron's default coefficient is 0)."""
VPP_PATTERN = "GE|G*|E-|G-"
"""Four pipeline segments: at ``--pipeline-model-parallel-size 2``, two virtual stages per rank."""
MOE = dict(model="hybrid", pattern=PARALLEL_PATTERN, num_experts=4)


def _parallel() -> list[tuple[RunSpec, str]]:
    # priority for a call that cannot run them all: one CP > 1 run per parallelism with its CP=1 run and the
    # pairs of its model; then each with inter-document masking (the padded per-document cut) and the refusals;
    # then the other modes and CP=4; last the 8-rank runs. EP folds over DP x CP: at CP=1 2 data-parallel ranks.
    Q, M = MOE, dict(MOE, mtp_layers=1, mtp_pattern="*E")  # one MTP depth of attention + MoE, as Qwen3-Next's
    rows = _with_pairs(RunSpec("par_pp2_cp1", **Q, pp=2))
    rows += [(RunSpec("par_pp2_cp2_chunkwise", **Q, pp=2, cp=2, mode="chunkwise"), "par_pp2_cp1"),
             (RunSpec("par_ep2_cp1", **Q, ep=2, dp=2), ""),
             (RunSpec("par_ep2_cp2", **Q, ep=2, cp=2, mode="auto"), "par_ep2_cp1")]
    rows += _with_pairs(RunSpec("par_mtp_cp1", **M)) + [(RunSpec("par_mtp_cp2", **M, cp=2, mode="auto"), "par_mtp_cp1")]
    rows += [(RunSpec("par_pp2_idm_cp1", **Q, **IDM, pp=2), ""),
             (RunSpec("par_pp2_idm_cp2", **Q, **IDM, pp=2, cp=2, mode="auto"), "par_pp2_idm_cp1"),
             (RunSpec("par_ep2_idm_cp1", **Q, **IDM, ep=2, dp=2), ""),
             (RunSpec("par_ep2_idm_cp2", **Q, **IDM, ep=2, cp=2, mode="auto"), "par_ep2_idm_cp1"),
             (RunSpec("par_mtp_idm_cp1", **M, **IDM), ""),
             (RunSpec("par_mtp_idm_cp2", **M, **IDM, cp=2, mode="auto"), "par_mtp_idm_cp1")]
    # refused before step 1, naming the reason: a router loss that would count the pads; virtual pipeline stages
    rows += [(RunSpec("par_ep2_aux_idm_cp2", **Q, **IDM, ep=2, cp=2, mode="auto", extra_args=AUX_LOSS),
              REFUSED + "--moe-aux-loss-coeff 0.01"),
             (RunSpec("par_pp2_vpp_idm_cp2", **dict(Q, pattern=VPP_PATTERN), **IDM, pp=2, cp=2, mode="auto"),
              REFUSED + "with 2 virtual stages per rank")]
    rows += [(RunSpec(f"par_pp2_cp2_{m}", **Q, pp=2, cp=2, mode=m), "par_pp2_cp1") for m in MODES[1:]]
    rows += [(RunSpec("par_mtp_cp4", **M, cp=4, mode="auto"), "par_mtp_cp1"),
             (RunSpec("par_mtp_idm_cp4", **M, **IDM, cp=4, mode="auto"), "par_mtp_idm_cp1")]
    # the router's load-balancing loss under CP (no padding: allowed), then PP=2 x CP=4 (8 ranks; group main has
    # every mode at CP=4, so chunkwise only)
    rows += [(RunSpec("par_ep2_aux_cp1", **Q, ep=2, dp=2, extra_args=AUX_LOSS), ""),
             (RunSpec("par_ep2_aux_cp2", **Q, ep=2, cp=2, mode="auto", extra_args=AUX_LOSS), "par_ep2_aux_cp1")]
    return rows + [(RunSpec("par_pp2_cp4_chunkwise", **Q, pp=2, cp=4, mode="chunkwise"), "par_pp2_cp1"),
                   (RunSpec("par_pp2_idm_cp4", **Q, **IDM, pp=2, cp=4, mode="auto"), "par_pp2_idm_cp1")]


NO_GDN_PATTERN = "*-*-*-*-"
"""A model of attention and MLP layers only: Megatron's own attention CP, nothing of gdn-cp's."""


def _fp8() -> list[tuple[RunSpec, str]]:
    # issue 46: delayed scaling (Megatron's default recipe) and tensorwise (current) scaling, each judged on its own
    # FP8 noise pairs; the per-token-loss rows and the model without GDN layers test why delayed scaling moves the
    # grad norm at iteration 1 at CP > 1 (docs/megatron.md, "FP8 at CP > 1"). GDN dims multiples of 16 (FP8 GEMMs).
    D = dict(MOE, fp8="hybrid", gdn_heads=(4, 8))
    T, N = dict(D, fp8_recipe="tensorwise"), dict(model="hybrid", pattern=NO_GDN_PATTERN, fp8="hybrid")
    rows = _with_pairs(RunSpec("par_fp8_cp1", **D), "fp8")
    rows += [(RunSpec(f"par_fp8_cp{cp}", **D, cp=cp, mode="auto"), "par_fp8_cp1") for cp in (2, 4)]
    rows += _with_pairs(RunSpec("par_fp8t_cp1", **T), "fp8")
    rows += [(RunSpec(f"par_fp8t_cp{cp}", **T, cp=cp, mode="auto"), "par_fp8t_cp1") for cp in (2, 4)]
    rows += _with_pairs(RunSpec("fp8_nogdn_cp1", **N), "no_gdn")
    rows += [(RunSpec(f"fp8_nogdn_cp{cp}", **N, cp=cp), "fp8_nogdn_cp1") for cp in (2, 4)]
    return rows + [(RunSpec("par_fp8_idm_cp1", **D, **IDM), ""),
                   (RunSpec("par_fp8_idm_cp2", **D, **IDM, cp=2, mode="auto"), "par_fp8_idm_cp1")]


SWEEP_SIZES = dict(model="hybrid", pattern="G*G-", hidden=256, seq_length=1024, attention_heads=(4, 2), iterations=20, lr_warmup=5)
"""Group ``sweep``'s tiny model: GDN, attention, GDN, MLP (two layers per stage at PP=2), the GDN heads of the
other groups (their compiled kernels serve), 20 iterations."""


def _sweep(site: Optional[str]) -> list[tuple[RunSpec, str]]:
    # issue 46: through Megatron-LM's scripts, every PP x data flag x micro-batch x backend at CP 1 and 2; each
    # CP=2 run equal to its CP=1 run, or either refused before step 1 naming why. FLA first (no compile).
    rows, cp2 = [], []
    for tag, backend in (("fla", {}), ("qla", dict(backend="flashqla", site=site))):  # auto: FLA (no FlashQLA there)
        base = dict(SWEEP_SIZES, **backend)
        for pp in (1, 2):
            for data in ("none", "inter_document_masking"):
                for mbs in (2, 1):
                    name = f"sw_{tag}_pp{pp}_{'idm' if data != 'none' else 'sbhd'}_mb{mbs}"
                    one = RunSpec(f"{name}_cp1", **base, pp=pp, data=data, micro_batch=mbs)
                    rows.append((one, SWEEP))
                    cp2.append((dataclasses.replace(one, name=f"{name}_cp2", cp=2, mode="auto"), SWEEP + one.name))
        rows += noise_pairs(RunSpec(f"sw_{tag}_pp1_sbhd_mb2_cp1", **base), PAIRS_OF["default"])
    return rows + cp2


def matrix(groups=("main",), flashqla_site: Optional[str] = None) -> list[tuple[RunSpec, str]]:
    """``[(spec, reference)]`` of ``groups``, in :data:`GROUPS`' order. A reference is "" (a CP=1 run), a CP=1
    run's name, :data:`STOCK` / :data:`SWEEP` + a name, or :data:`REFUSED` + what the refusal names."""
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        raise ValueError(f"groups={unknown!r}: use {', '.join(GROUPS)}")
    made = {"main": _main, "fp32": _fp32, "more": _more, "flashqla": lambda: _flashqla(flashqla_site),
            "parallel": _parallel, "fp8": _fp8, "sweep": lambda: _sweep(flashqla_site)}
    return [entry for g in GROUPS if g in groups for entry in made[g]()]


def _model(spec: RunSpec) -> str:
    return model_key(spec.describe())


def with_references(todo: list, done=(), flashqla_site: Optional[str] = None) -> list:
    """``todo`` with what judges each run put before it when neither ``todo`` nor ``done`` (names of finished
    rows) has it: its CP=1 reference, and the noise pairs of its model (with their reference)."""
    every = matrix(GROUPS, flashqla_site)
    by = {s.name: (s, r) for s, r in every}
    pairs = [(s, r) for s, r in every if s.name.endswith("_noise")]
    have, out = {s.name for s, _ in todo} | set(done), []

    def bring(name):
        if name and name not in have and name in by:
            have.add(name)
            bring(base_name(by[name][1]))
            out.append(by[name])

    for spec, ref in todo:
        base = by.get(base_name(ref), (None,))[0]
        if base is not None and spec.cp > 1 and not ref.startswith(STOCK):
            for p, pref in pairs:
                if _model(by[pref][0]) == _model(base):
                    bring(pref)
                    bring(p.name)
        bring(base_name(ref))
        out.append((spec, ref))
    return out


# ---- time estimates, the plan and the device calls ----

START_S = {"hybrid": {1: 120.0, 2: 60.0, 4: 95.0}, "gpt": {1: 120.0, 2: 40.0, 4: 45.0}, "tiny": {1: 50.0, 2: 55.0}}
"""Start-up and the first two iterations with ~14 ranks side by side on one H200 (run 2026-12-03a, cold Triton
caches: hybrid (TE attention) CP=1 119 s, CP=2 23-66 s, CP=4 66-108 s; GPT CP=2 19 s, CP=4 17-23 s, CP=1 beside
hybrid's autotune 119 s; the small models of run 2026-12-02a started in 40-60 s)."""
ITERATION_S = {1: 0.4, 2: 0.8, 4: 1.0, "tiny": 0.2}
"""One later iteration under the same load (run 2026-12-03a medians: CP=1 0.34-0.40 s, CP=2 0.58-0.92 s, CP=4
0.70-1.08 s; all_gather x1.3)."""
FACTORS = {"all_gather": 1.3, "pp": 1.5, "experts": 1.3, "mtp": 1.2, "experts_start_s": 15.0, "flashqla_start_s": 90.0}
"""Guesses until a run measures them: per iteration x1.5 with pipeline stages (activations through the host),
x1.3 with experts, x1.2 with MTP; 15 s more start-up with experts (TE's grouped GEMM) and 90 s with FlashQLA
(TileLang compiles a forward and backward in ~2-3 min cold, once: later processes load it from
TILELANG_CACHE_DIR, which gpu_suite.sh carries between calls as .tl_cache)."""
PREP_S = 35.0
"""What a call spends of ``--budget-s`` on the data and Megatron's helpers before the first run (10-35 s seen)."""
REFUSED_S = 60.0
"""A run that must stop in ``validate_args``: its ranks import Megatron-LM and stop."""


H100_GIB = 79.6
"""The GPU a plan assumes where none is visible (``--dry-run`` here): plain device calls mostly get an H100."""


def ranks_that_fit(gpu_gib: float, todo: list) -> int:
    """Rank processes side by side on a GPU of ``gpu_gib``: each the memory of the largest run of ``todo``
    (``lm.gib_per_rank``: :data:`GIB_PER_RANK`, twice that in fp32)."""
    return max(1, int(gpu_gib // max((gib_per_rank(s.precision) for s, _ in todo), default=GIB_PER_RANK)))


def estimate_s(spec: RunSpec, ref: str = "") -> float:
    """Seconds ``spec`` takes on one H200 shared by ~14 ranks (:data:`START_S`, :data:`ITERATION_S`,
    :data:`FACTORS`); :data:`REFUSED_S` when ``ref`` says it must be refused."""
    if ref.startswith(REFUSED):
        return REFUSED_S
    f, tiny = FACTORS, spec.hidden < 512
    kind = "tiny" if tiny else "hybrid" if spec.model == "hybrid" and "*" in spec.pattern else "gpt"
    start = START_S[kind].get(spec.cp, max(START_S[kind].values())) + f["experts_start_s"] * bool(spec.num_experts)
    per = ITERATION_S["tiny"] * spec.cp if tiny else ITERATION_S.get(spec.cp, 0.3 * spec.cp)
    per *= ((f["all_gather"] if spec.mode == "all_gather" else 1.0) * (f["pp"] if spec.pp > 1 else 1.0)
            * (f["experts"] if spec.num_experts else 1.0) * (f["mtp"] if spec.mtp_layers else 1.0))
    return start + f["flashqla_start_s"] * (spec.backend == "flashqla") + (spec.iterations - 2) * per


def plan(todo: list, *, max_ranks: int, budget_s: float) -> list[dict]:
    """What :func:`run_matrix` would do if every run took :func:`estimate_s`: per run ``{"name", "world",
    "start_s", "end_s"}`` (None when it would not start). Same rule: matrix order, at most ``max_ranks`` ranks,
    a run only when its estimate fits the time left."""
    out, running, used, now = [], [], 0, 0.0
    for spec, ref in todo:
        est = estimate_s(spec, ref)
        if spec.world > max_ranks:
            out.append({"name": spec.name, "world": spec.world, "start_s": None, "end_s": None})
            continue
        while used + spec.world > max_ranks:
            now, world = heapq.heappop(running)
            used -= world
        if est > budget_s - now:
            out.append({"name": spec.name, "world": spec.world, "start_s": None, "end_s": None})
            continue
        heapq.heappush(running, (now + est, spec.world))
        used += spec.world
        out.append({"name": spec.name, "world": spec.world, "start_s": round(now), "end_s": round(now + est)})
    return out


def split_calls(todo: list, *, max_ranks: int, budget_s: float) -> tuple[list[list[dict]], list[str]]:
    """``todo`` over device calls: each call :func:`plan`'s started runs of what the calls before left (as
    ``--resume`` of the previous call's file runs the rest); and the names no call can start."""
    calls, left = [], list(todo)
    while left:
        steps = plan(left, max_ranks=max_ranks, budget_s=budget_s)
        started = [s for s in steps if s["start_s"] is not None]
        if not started:
            break
        calls.append(started)
        left = [e for e, s in zip(left, steps) if s["start_s"] is None]
    return calls, [s.name for s, _ in left]


# ---- running the matrix ----

def prepare_data(data_dir: Path, todo: list, *, source=None, max_bytes: int = byte_text.MAX_BYTES) -> dict:
    """Build the byte-level text and the SFT set cut from it into ``data_dir``; returns the provenance."""
    provenance = byte_text.build(data_dir, source=source, max_bytes=max_bytes)
    sft = [s for s, _ in todo if s.data == "sft"]
    rows = max([s.iterations * s.global_batch for s in sft] + [64])  # no SFT row read twice
    seq = max([s.seq_length for s in sft] + [4096])
    path = write_sft_set(Path(data_dir) / "sft.jsonl", text=byte_text.corpus_text(source, max_bytes), rows=rows, seq_length=seq)
    return provenance | {"sft": {"path": str(path), "rows": rows, "seq_length": seq, "sha256": byte_text.sha256_of(path)}}


RESUME_SAME = ("python", "torch", "triton", "fla", "flash_qla", "megatron_core", "gdn_cp", "gpu")
"""Versions a resumed file's rows must share with this call's."""


def load_resume(path) -> dict:
    """An earlier results file to go on from (none there yet: nothing to keep); ValueError when it is not one."""
    if not Path(path).exists():  # the first call of a sequence that resumes one file call after call
        logger.warning("--resume %s: no such file yet: running every row", path)
        return {"benchmark": "train_megatron_lm", "rule": RULE, "rows": [], "date": None, "data": {}}
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--resume {path}: cannot read it as JSON ({e}); pass a train_megatron_lm.json") from e
    if doc.get("benchmark") != "train_megatron_lm" or "data" not in doc:
        raise ValueError(f"--resume {path}: not a train_megatron_lm result with its data provenance "
                         f"(benchmark={doc.get('benchmark')!r}): pass a train_megatron_lm.json or run without --resume")
    if doc.get("rule") != RULE:  # rows judged by another rule (other schedule, fewer pairs): none is kept
        logger.warning("--resume %s: its rows were judged by rule %r, not %r: keeping none of them", path,
                       doc.get("rule"), RULE)
        doc = dict(doc, rows=[])
    return doc


def check_resume(earlier: dict, data: dict, stack: dict, path) -> None:
    """ValueError unless ``earlier``'s rows trained on the same text (``.bin`` sha256) and stack (:data:`RESUME_SAME`)."""
    if earlier["data"].get("bin_sha256") != data["bin_sha256"]:
        raise ValueError(f"--resume {path}: its rows trained on data with .bin sha256 {earlier['data'].get('bin_sha256')}, "
                         f"this machine's text gives {data['bin_sha256']} (Python {earlier['data'].get('python')} there, "
                         f"{data['python']} here): run without --resume")
    changed = [f"{k}: {earlier.get('versions', {}).get(k)} there, {stack.get(k)} here" for k in RESUME_SAME
               if earlier.get("versions", {}).get(k) != stack.get(k)]
    if changed:
        raise ValueError(f"--resume {path}: its rows ran on another stack ({'; '.join(changed)}): run without --resume")


def _finished(row: dict) -> bool:
    """A row a resumed call keeps: it ran, or stopped before step 1 as its reference wants."""
    return row["status"] == "ok" or row.get("verdict") in GOOD[3:]


def _not_run(spec: RunSpec, ref: str, status: str) -> dict:
    return {**spec.describe(), "status": status, "losses": [], "grad_norms": [], "reference": ref, "error": "",
            "estimate_s": round(estimate_s(spec, ref))}


def _finish(fut, spec: RunSpec, ref: str, log_dir: Path) -> dict:
    """The row of a run that ended: what the launcher returned, whether rank 0 reached Megatron's training loop
    (``training ...``: a stop before it is a refusal at configuration time, one after it a failure in step 1)."""
    try:
        row = fut.result().to_json()
    except Exception as e:  # noqa: BLE001 - the launcher itself failed: say so, go on
        row = {**spec.describe(), "status": "failed", "losses": [], "grad_norms": [], "error": repr(e)}
    log = log_dir / f"{spec.name}.rank0.log"
    row["reached_training"] = log.is_file() and "training ..." in log.read_text(encoding="utf-8", errors="replace")
    row["reference"], row["estimate_s"] = ref, round(estimate_s(spec, ref))
    return row


def _todo(args, done) -> list:
    """The runs of ``--groups`` (``--only``: those named) not ``done``, each with what judges it (:func:`with_references`)."""
    todo = [(s, ref) for s, ref in matrix(args.groups, args.flashqla_site)
            if (not args.only or any(k in s.name for k in args.only)) and s.name not in done]
    return with_references(todo, done, args.flashqla_site)


def _setup(args) -> tuple[list, dict, float]:
    """The runs still to do, the results document (data built, helpers compiled, resumed rows kept), the start."""
    t0 = time.monotonic()  # --budget-s counts from here: the data and the helpers (~10-60 s) are in it
    checkout, work = Path(args.checkout), Path(args.work or tempfile.mkdtemp(prefix="gdn_cp_mlm_"))
    earlier = load_resume(args.resume) if args.resume else None
    if earlier:
        judge(earlier["rows"], earlier["rule"])
    kept = [r for r in (earlier or {}).get("rows", []) if _finished(r)]
    todo = _todo(args, [r["name"] for r in kept])
    data, stack = prepare_data(work / "data", todo, source=args.text_source, max_bytes=args.text_bytes), versions()
    if kept:
        check_resume(earlier, data, stack, args.resume)
    for tree in {checkout, *([Path(args.stock_checkout)] if args.stock_checkout else [])}:
        build_dataset_helpers(tree)  # once, before runs start side by side (they would race to build them)
    doc = {"benchmark": "train_megatron_lm", "date": now_iso(), "machine": machine_info(), "versions": stack,
           "checkout": str(checkout), "work": str(work), "rule": RULE, "data": data, "groups": list(args.groups),
           "rule_parameters": dataclasses.asdict(RULES[RULE]), "pairs": {k: v[0] for k, v in PAIRS.items()},
           "resumed_from": {"file": str(args.resume), "date": earlier["date"], "rows": len(kept)} if earlier else None,
           "rows": kept}
    doc["prepared_s"] = round(time.monotonic() - t0, 1)
    return todo, doc, t0


def run_matrix(args) -> dict:
    todo, doc, t0 = _setup(args)
    work, checkout = Path(doc["work"]), Path(args.checkout)
    total_mib = gpu_memory_mib("total")
    max_ranks = _max_ranks(args, total_mib, todo)
    memory = doc["gpu_memory"] = {"total_mib": total_mib, "max_ranks": max_ranks, "gib_per_rank_assumed":
                                  None if args.max_ranks else round(GIB_PER_RANK, 2), "max_used_mib": None,
                                  "ranks_at_max": None, "samples": []}
    pool = cf.ThreadPoolExecutor(max_workers=len(todo) or 1)
    pending, running, used = list(todo), [], 0

    def sample_memory():  # every ~5 s: [s since the start, MiB used, ranks running, runs running]; and the most
        used_mib = gpu_memory_mib("used")
        if used_mib is None:
            return
        memory["samples"].append([round(time.monotonic() - t0), used_mib, used, len(running)])
        if used_mib > (memory["max_used_mib"] or 0):
            memory.update(max_used_mib=used_mib, ranks_at_max=used)

    def save():
        doc["tolerance"] = judge(doc["rows"])
        doc["elapsed_s"] = round(time.monotonic() - t0, 1)
        write_json(args.out, doc)

    while pending or running:
        left = args.budget_s - (time.monotonic() - t0)
        while pending and used + pending[0][0].world <= max_ranks:
            spec, ref = pending.pop(0)
            if spec.stock and not args.stock_checkout:
                doc["rows"].append(_not_run(spec, ref, "not run (no --stock-checkout)"))
            elif spec.backend == "flashqla" and spec.site is None:
                doc["rows"].append(_not_run(spec, ref, "not run (no --flashqla-site)"))
            elif estimate_s(spec, ref) > left:
                doc["rows"].append(_not_run(spec, ref, "not run (budget)"))
            else:
                used += spec.world
                logger.info("start %s (cp=%d, %d ranks in use, ~%.0f s, %.0f s left)", spec.name, spec.cp, used,
                            estimate_s(spec, ref), left)
                # only the autotune pairs take FLA's first config, whatever the caller's environment says
                fut = pool.submit(launch, spec, checkout=Path(args.stock_checkout) if spec.stock else checkout,
                                  log_dir=work / "logs", data_dir=work / "data",
                                  timeout_s=min(args.run_timeout_s, max(left - 5, 30)),
                                  extra_env={"GDN_CP_TEST_FAST_AUTOTUNE": "0"})
                running.append((fut, spec, ref))
        if pending and not running:  # the head needs more ranks than --max-ranks
            spec, ref = pending.pop(0)
            doc["rows"].append(_not_run(spec, ref, f"not run (needs {spec.world} ranks, {max_ranks} fit side by side)"))
            continue
        if not running:
            break
        done, _ = cf.wait([f for f, _, _ in running], timeout=5, return_when=cf.FIRST_COMPLETED)
        sample_memory()
        for fut, spec, ref in [x for x in running if x[0] in done]:
            running.remove((fut, spec, ref))
            used -= spec.world
            row = _finish(fut, spec, ref, work / "logs")
            doc["rows"].append(row)
            logger.info("done %s: %s in %.0f s%s", spec.name, row["status"], row.get("wall_s", 0),
                        f" ({row['error'][-300:]})" if row["status"] != "ok" else "")
            save()
    save()
    return doc


def _max_ranks(args, total_mib: Optional[float], todo: list) -> int:
    """``--max-ranks``, else what fits this GPU (:func:`ranks_that_fit`; an H100's where no GPU is seen), logged."""
    if args.max_ranks:
        return args.max_ranks
    gib = total_mib / 1024 if total_mib else H100_GIB
    ranks = ranks_that_fit(gib, todo)
    logger.info("%d rank processes side by side: %.1f GiB of GPU memory%s, ~%.1f GiB each%s", ranks, gib,
                "" if total_mib else " (no GPU seen: an H100's)", GIB_PER_RANK,
                " (x2: fp32 rows)" if any(s.precision == "fp32" for s, _ in todo) else "")
    return ranks


# ---- the command ----

def dry_run(args) -> int:
    """Build the data, write the SFT set and print the plan over device calls of ``--budget-s`` each (less
    :data:`PREP_S`); FlashQLA rows only with ``--flashqla-site`` (as on the device); ``--resume``'s finished rows
    left out, as the call would; run nothing."""
    todo = _todo(args, [r["name"] for r in load_resume(args.resume).get("rows", []) if _finished(r)] if args.resume else ())
    work = Path(args.work or tempfile.mkdtemp(prefix="gdn_cp_mlm_"))
    print(json.dumps(prepare_data(work / "data", todo, source=args.text_source, max_bytes=args.text_bytes), indent=1))
    refs = dict((s.name, ref) for s, ref in todo)
    runnable = [(s, ref) for s, ref in todo if not (s.backend == "flashqla" and s.site is None)]
    max_ranks = _max_ranks(args, gpu_memory_mib("total"), runnable)
    calls, never = split_calls(runnable, max_ranks=max_ranks, budget_s=args.budget_s - PREP_S)
    for k, steps in enumerate(calls, 1):
        print(f"call {k}: {len(steps)} runs, the last ending ~{max(s['end_s'] for s in steps)} s after the data")
        for s in steps:
            print(f"  {s['name']:34s} {s['world']:2d} ranks  {s['start_s']:4d} -> {s['end_s']:4d} s  ref {refs[s['name']] or '-'}")
    print(f"{len(runnable)} runs in {len(calls)} call(s) of --budget-s {args.budget_s:.0f} (the data: ~{PREP_S:.0f} s), "
          f"{max_ranks} ranks side by side; never started: {', '.join(never) or 'none'}; without --flashqla-site: "
          f"{len(todo) - len(runnable)} FlashQLA runs")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkout", help="a patched Megatron-LM checkout (core_v0.19.x)")
    p.add_argument("--out", default="train_megatron_lm.json", help="JSON written after every run")
    p.add_argument("--work", help="folder for the data, the SFT set and the per-rank logs (default: a temp dir)")
    p.add_argument("--budget-s", type=float, default=480, help="every run ends by then; none starts that would not")
    p.add_argument("--run-timeout-s", type=float, default=600, help="kill a run after this many seconds (and at "
                   "--budget-s; run 2026-12-07g: a CP=4 run beside 4 others on an H100 took over 300 s to iteration 1)")
    p.add_argument("--max-ranks", type=int, help="rank processes side by side (default: as many as the GPU's memory "
                   f"holds at ~{GIB_PER_RANK:.1f} GiB each, twice that for fp32: 14 on an H200, 8 on an H100)")
    p.add_argument("--only", nargs="*", help="run only the matrix entries whose name contains one of these")
    p.add_argument("--flashqla-site", help="an unpacked FlashQLA site (e.g. .site-tl), first on the PYTHONPATH of "
                   "the FlashQLA runs only")
    p.add_argument("--groups", type=csv_choices(GROUPS), default=("main",),
                   help=f"comma-separated matrix groups of {', '.join(GROUPS)} (default main)")
    p.add_argument("--stock-checkout", help="an unpatched copy of the checkout, for the stock rows")
    p.add_argument("--resume", metavar="JSON", help="an earlier result of this benchmark: keep its finished rows, "
                   "run the rest")
    p.add_argument("--text-source", help="the standard library folder to read (default: this Python's)")
    p.add_argument("--text-bytes", type=int, default=byte_text.MAX_BYTES, help="size of the text in bytes")
    p.add_argument("--dry-run", action="store_true", help="build the data and print the plan; run nothing")
    p.add_argument("--plot", metavar="JSON", help="draw JSON's PNG beside it and print its table; run nothing")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    setup_logging()
    if args.plot:
        doc = json.loads(Path(args.plot).read_text())
        tols = judge(doc["rows"], doc["rule"])
        print(table(doc, tols))
        plot(doc, Path(args.plot).with_suffix(".png"), tols)
        return 0
    if args.dry_run:
        return dry_run(args)
    if not args.checkout:
        p.error("--checkout is required (or --plot, --dry-run)")
    doc = run_matrix(args)
    print(table(doc, doc["tolerance"]))
    bad = not_as_required(doc["rows"])
    if bad:
        logger.error("not as required: %s", ", ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
