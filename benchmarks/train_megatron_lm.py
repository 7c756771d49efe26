"""Megatron-LM's own training scripts at CP > 1 against CP=1, on text the model is still learning: per-iteration
loss and grad norm.

Runs ``pretrain_hybrid.py`` (pattern ``G-G-*-``: GDN, MLP, TE attention; and GDN-only ``G-G-``) and
``pretrain_gpt.py`` (``--experimental-attention-variant gated_delta_net``, 3 GDN layers + 1 attention
layer) from a patched Megatron-LM checkout through :mod:`gdn_cp_testing.megatron.lm`: bf16 (fp32 rows:
group ``fp32``), TransformerEngine specs, no dropout, 50 iterations, lr 6e-4 (constant after 5 warm-up
iterations: still learning at the end), at the sizes of :class:`~gdn_cp_testing.megatron.lm.RunSpec`
(sequence 4096, micro-batch 2, global batch 4, hidden 1024, FFN 2048, GDN 4 key / 12 value heads of dim
128, 8 attention heads in 4 groups): above the sizes where Megatron-LM's JIT warm-up leaves the global
CUDA generator at a CP-independent offset (../shared/DESIGN.md; docs/megatron.md "Initial weights and CP").
CP=1 over NCCL, CP=2 / 4 as gloo ranks sharing one GPU (or one rank per GPU over NCCL where there are
enough GPUs).

**Data** (:mod:`gdn_cp_testing.megatron.byte_text`): the Python standard library's source of the machine
that runs the benchmark, byte-level tokens (``NullTokenizer``, ``--vocab-size 258``), one document per
top-level block, built as a Megatron indexed dataset into ``--work`` before the runs (seconds); the
``--sft`` runs read a packed SFT set cut from the same text. Its provenance (Python version, files,
tokens, sha256 of the ``.bin``) is the results' ``data``. (Megatron-LM's mock data was memorised within 6
iterations, after which no tolerance told a right run from a wrong one.)

**Verdict** (:func:`judge`, rule :data:`RULE`): at every iteration, a bf16 run's loss within
max(2e-3, 3x the running maximum of the CP=1 noise pairs) of its CP=1 run's (relative); an fp32 run's
within 1e-6 at iteration 1 and 1e-4 at every iteration. A CP=1 reference must still be learning at the
end (:func:`still_learning`). The grad norm is reported against 3x its noise, not judged. Stock rows are
reported, never required to match. Files written before this rule (no ``rule`` key) are judged by theirs
(:data:`LEGACY_RULE`).

**Groups** (``--groups``, run in this order; a noise pair is the CP=1 run again with
``--no-bias-swiglu-fusion``). Wall time of the runs (preparation not counted: add ~10-60 s) estimated for
one H200 with 16 cores, 14 ranks side by side, from run 2026-12-02e's logs (20 iterations: start-up and
first two iterations 50-85 s, then 0.1-0.2 s per iteration at CP=1 and 0.7-2 s at CP=2 / 4;
:func:`estimate_s`; ``--dry-run`` prints the plan):

* ``main`` (18 runs, ~520 s): both scripts' CP=1 run and noise pair; CP=2 and CP=4 in every mode
  (chunkwise, headwise, all_gather); stock megatron-core 0.19.2 at CP=2 from an unpatched copy of the
  checkout (``--stock-checkout``; its conv1d starts elsewhere at these sizes);
* ``fp32`` (8 runs, ~250 s): the GDN-only model in fp32 at CP=1, CP=2 / 4 in every mode, and its noise
  pair (reported);
* ``more`` (18 runs, ~420 s; 16 and main's two CP=1 runs that the recompute rows need): first what run
  2026-12-02e did not reach: ``pretrain_gpt.py`` with ``--dataloader-inter-document-masking
  --calculate-per-token-loss`` at CP=1 / 4 / 2 (attention layers: the padded per-document cut);
  ``--sft --calculate-per-token-loss`` (hybrid, CP=1 / 2); full recompute (hybrid, CP=2) and
  ``gdn_norm_out`` selective recompute (GPT: megatron-core allows it only for the gated_delta_net
  variant), against main's CP=1 runs; ``--sft`` at CP=4; the GDN-only model with inter-document masking
  on the whole-row cut (CP=1 / 4 / 2) and on the padded cut (``--linear-cp-thd-split per_document``, CP=4 /
  2: its step time is the padded cut's cost, meaningful with one rank per GPU); last ``pretrain_hybrid.py``
  with inter-document masking (CP=1 / 4 / 2; shown on mock data before);
* ``flashqla`` (3 runs): the hybrid model on FlashQLA's kernels (``--linear-cp-backend flashqla``) at CP=2
  (chunkwise, headwise) against CP=1 on FlashQLA; ``--flashqla-site`` puts an unpacked FlashQLA site first
  on those runs' PYTHONPATH only.
* ``parallel`` (30 runs, ~1700 s; its factors are guesses: :data:`PARALLEL_FACTORS`): issue 42, the
  parallelism Qwen3-Next trains with, on ``pretrain_hybrid.py`` with :data:`PARALLEL_PATTERN` (GDN, MoE,
  attention and MLP layers; 4 experts, top-2), each CP > 1 run against the same layout at CP=1: PP=2 x CP=2
  (every mode; and CP=4, 8 ranks), EP=2 x CP=2 (at CP=1 the 2 expert-parallel ranks are 2 data-parallel
  ones), one MTP depth (``/*E``) at CP=2 and 4, FP8 (``--fp8-format hybrid``) at CP=2 judged on FP8's own
  noise pair (the bf16 rows on theirs, ``par_mtp_cp1_noise``); each with ``--dataloader-inter-document-masking --calculate-per-token-loss`` (the padded
  per-document cut at CP > 1); refused before step 1: a router load-balancing loss with that cut (it would
  count the pads) and virtual pipeline stages with it; a load-balancing loss without the flag (allowed).
  In priority order for a call that cannot run them all (:func:`_parallel`): one call of ~420 s runs about
  half, ``--resume`` the rest.

A run whose CP=1 reference is in no selected group (nor in ``--resume``'s file) brings it along.

**Budget** (``--budget-s``, counted from the start: the benchmark ends within it): first the data, and
Megatron's C++ dataset helpers once per checkout (runs side by side would race to build them; ~20 s each
on a fresh checkout). Runs start in matrix order under ``--max-ranks``, each only when its estimate fits
the time left (else ``not run (budget)``); runs still going at the budget's end are killed. The JSON (``--out``) is rewritten after every run. ``--resume FILE.json`` keeps FILE's finished
rows (the same data: its ``.bin`` sha256 must be this one's) and runs the rest, so a second device call
finishes what the first could not, into one file. ``--plot FILE.json`` draws ``FILE.png`` and prints the
table, on any machine.

    python3 -m benchmarks.train_megatron_lm --checkout /tmp/mlm --out $OUT/train_megatron_lm.json --groups main
    python3 -m benchmarks.train_megatron_lm --checkout /tmp/mlm --dry-run --groups main,fp32,more
    python3 -m benchmarks.train_megatron_lm --plot benchmarks/results/train_megatron_lm.json
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import json
import logging
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from gdn_cp_testing.megatron import byte_text
from gdn_cp_testing.megatron.lm import RunSpec, build_dataset_helpers, launch, write_sft_set

from .common import machine_info, now_iso, save_figure, setup_logging, versions, write_json

logger = logging.getLogger("benchmarks.train_megatron_lm")

NOISE = ("--no-bias-swiglu-fusion",)

REFUSED = "refused:"
"""A reference starting with this: the run must stop before its first step, with an error naming what follows."""

PADDED_CUT = ("--linear-cp-thd-split", "per_document")
"""A GDN-only model's --dataloader-inter-document-masking rows padded and cut per document (as a model with
attention layers gets them) instead of cut whole."""

STOCK = "stock:"
"""A stock megatron-core run (an unpatched checkout) compared with this CP=1 run: reported, never required
to match (at these sizes stock's conv1d starts from another draw than CP=1's)."""

GROUPS = ("main", "fp32", "more", "flashqla", "parallel")
MODES = ("chunkwise", "headwise", "all_gather")
_H, _P, _G = dict(model="hybrid"), dict(model="gpt"), dict(model="hybrid", pattern="G-G-")


def _main() -> list[tuple[RunSpec, str]]:
    rows = []
    for name, kind in (("hybrid", _H), ("gpt", _P)):
        rows += [(RunSpec(f"{name}_cp1", **kind), ""),
                 (RunSpec(f"{name}_cp1_noise", **kind, extra_args=NOISE), f"{name}_cp1")]
    for name, kind in (("hybrid", _H), ("gpt", _P)):
        rows += [(RunSpec(f"{name}_cp{cp}_{m}", **kind, cp=cp, mode=m), f"{name}_cp1") for cp in (4, 2) for m in MODES]
    rows += [(RunSpec(f"{name}_cp2_stock", **kind, cp=2, stock=True), STOCK + f"{name}_cp1")
             for name, kind in (("hybrid", _H), ("gpt", _P))]
    return rows


def _fp32() -> list[tuple[RunSpec, str]]:
    F = dict(_G, precision="fp32")
    return ([(RunSpec("gdnonly_fp32_cp1", **F), "")]
            + [(RunSpec(f"gdnonly_fp32_cp{cp}_{m}", **F, cp=cp, mode=m), "gdnonly_fp32_cp1") for cp in (4, 2) for m in MODES]
            + [(RunSpec("gdnonly_fp32_cp1_noise", **F, extra_args=NOISE), "gdnonly_fp32_cp1")])


def _more() -> list[tuple[RunSpec, str]]:
    # first the rows run 2026-12-02e did not reach, in issue 39's order; hybrid inter-document masking (shown on
    # mock data) last
    idm = dict(data="inter_document_masking")
    rows = [(RunSpec("gpt_idm_cp1", **_P, **idm), "")]
    rows += [(RunSpec(f"gpt_idm_cp{cp}", **_P, **idm, cp=cp, mode="auto"), "gpt_idm_cp1") for cp in (4, 2)]
    rows += [(RunSpec("hybrid_sft_cp1", **_H, data="sft"), ""),
             (RunSpec("hybrid_sft_cp2", **_H, data="sft", cp=2, mode="auto"), "hybrid_sft_cp1"),
             (RunSpec("hybrid_full_recompute_cp2", **_H, cp=2, mode="auto", recompute="full"), "hybrid_cp1"),
             (RunSpec("gpt_norm_out_recompute_cp2", **_P, cp=2, mode="auto", recompute="gdn_norm_out"), "gpt_cp1"),
             (RunSpec("hybrid_sft_cp4", **_H, data="sft", cp=4, mode="auto"), "hybrid_sft_cp1")]
    rows += [(RunSpec("gdnonly_idm_cp1", **_G, **idm), "")]
    rows += [(RunSpec(f"gdnonly_idm_cp{cp}", **_G, **idm, cp=cp, mode="auto"), "gdnonly_idm_cp1") for cp in (4, 2)]
    rows += [(RunSpec(f"gdnonly_idm_padded_cp{cp}", **_G, **idm, cp=cp, mode="auto", extra_args=PADDED_CUT),
              "gdnonly_idm_cp1") for cp in (4, 2)]
    rows += [(RunSpec("hybrid_idm_cp1", **_H, **idm), "")]
    rows += [(RunSpec(f"hybrid_idm_cp{cp}", **_H, **idm, cp=cp, mode="auto"), "hybrid_idm_cp1") for cp in (4, 2)]
    return rows


def _flashqla(site: Optional[str]) -> list[tuple[RunSpec, str]]:
    # needs FlashQLA installed (pip install -e '.[flashqla]'); head dims 128, bf16
    Q = dict(model="hybrid", backend="flashqla", site=site)
    return [(RunSpec("hybrid_flashqla_cp1", **Q), ""),
            (RunSpec("hybrid_flashqla_cp2_chunkwise", **Q, cp=2, mode="chunkwise"), "hybrid_flashqla_cp1"),
            (RunSpec("hybrid_flashqla_cp2_headwise", **Q, cp=2, mode="headwise"), "hybrid_flashqla_cp1")]


PARALLEL_PATTERN = "GEG*E-"
"""``pretrain_hybrid.py``'s pattern of group ``parallel``: GDN, MoE, GDN, attention, MoE, MLP (the layer kinds a
Qwen3-Next-style model interleaves; 4 experts, top-2)."""
AUX_LOSS = ("--moe-aux-loss-coeff", "0.01")
"""A load-balancing loss over every routed token (Megatron's default coefficient is 0)."""
VPP_PATTERN = "GE|G*|E-|G-"
"""Four pipeline segments: at ``--pipeline-model-parallel-size 2``, two virtual stages per rank."""


def _parallel() -> list[tuple[RunSpec, str]]:
    # priority for a call that cannot run them all (~420 s, 14 ranks: about 11-13 runs): first one CP > 1 run per
    # parallelism of issue 42 (pipeline, experts, MTP, FP8) with its CP=1 run; then each with inter-document
    # masking (the model has attention layers: the padded per-document cut) and the refusals; then the other
    # modes and CP=4; last the 8-rank runs
    Q, idm = dict(model="hybrid", pattern=PARALLEL_PATTERN, num_experts=4), dict(data="inter_document_masking")
    M = dict(Q, mtp_layers=1, mtp_pattern="*E")  # one MTP depth of attention + MoE, as Qwen3-Next's
    F = dict(Q, fp8="hybrid", gdn_heads=(4, 8))  # GDN in_proj / out_proj dims multiples of 16, as FP8 GEMMs want
    # EP folds over DP x CP: at CP=1 the 2 expert-parallel ranks are 2 data-parallel ones
    rows = [(RunSpec("par_pp2_cp1", **Q, pp=2), ""),
            (RunSpec("par_pp2_cp2_chunkwise", **Q, pp=2, cp=2, mode="chunkwise"), "par_pp2_cp1"),
            (RunSpec("par_ep2_cp1", **Q, ep=2, dp=2), ""),
            (RunSpec("par_ep2_cp2", **Q, ep=2, cp=2, mode="auto"), "par_ep2_cp1"),
            (RunSpec("par_mtp_cp1", **M), ""),
            # the bf16 noise pair of these layouts (run 2026-12-03b: pairs of the dense models drifted 0.9-2.2% apart by
            # iteration 50, so a call of this group alone needs its own)
            (RunSpec("par_mtp_cp1_noise", **M, extra_args=NOISE), "par_mtp_cp1"),
            (RunSpec("par_mtp_cp2", **M, cp=2, mode="auto"), "par_mtp_cp1"),
            (RunSpec("par_fp8_cp1", **F), ""),
            (RunSpec("par_fp8_cp1_noise", **F, extra_args=NOISE), "par_fp8_cp1"),
            (RunSpec("par_fp8_cp2", **F, cp=2, mode="auto"), "par_fp8_cp1")]
    rows += [(RunSpec("par_pp2_idm_cp1", **Q, **idm, pp=2), ""),
             (RunSpec("par_pp2_idm_cp2", **Q, **idm, pp=2, cp=2, mode="auto"), "par_pp2_idm_cp1"),
             (RunSpec("par_ep2_idm_cp1", **Q, **idm, ep=2, dp=2), ""),
             (RunSpec("par_ep2_idm_cp2", **Q, **idm, ep=2, cp=2, mode="auto"), "par_ep2_idm_cp1"),
             (RunSpec("par_mtp_idm_cp1", **M, **idm), ""),
             (RunSpec("par_mtp_idm_cp2", **M, **idm, cp=2, mode="auto"), "par_mtp_idm_cp1"),
             (RunSpec("par_fp8_idm_cp1", **F, **idm), ""),
             (RunSpec("par_fp8_idm_cp2", **F, **idm, cp=2, mode="auto"), "par_fp8_idm_cp1")]
    # refused before step 1, naming the reason: a router loss that would count the pads; virtual pipeline stages
    rows += [(RunSpec("par_ep2_aux_idm_cp2", **Q, **idm, ep=2, cp=2, mode="auto", extra_args=AUX_LOSS),
              REFUSED + "--moe-aux-loss-coeff 0.01"),
             (RunSpec("par_pp2_vpp_idm_cp2", **dict(Q, pattern=VPP_PATTERN), **idm, pp=2, cp=2, mode="auto"),
              REFUSED + "with 2 virtual stages per rank")]
    rows += [(RunSpec(f"par_pp2_cp2_{m}", **Q, pp=2, cp=2, mode=m), "par_pp2_cp1") for m in MODES[1:]]
    rows += [(RunSpec("par_mtp_cp4", **M, cp=4, mode="auto"), "par_mtp_cp1"),
             (RunSpec("par_mtp_idm_cp4", **M, **idm, cp=4, mode="auto"), "par_mtp_idm_cp1")]
    # the router's load-balancing loss under CP (no padding: allowed), then PP=2 x CP=4 (8 ranks) in every mode
    rows += [(RunSpec("par_ep2_aux_cp1", **Q, ep=2, dp=2, extra_args=AUX_LOSS), ""),
             (RunSpec("par_ep2_aux_cp2", **Q, ep=2, cp=2, mode="auto", extra_args=AUX_LOSS), "par_ep2_aux_cp1")]
    rows += [(RunSpec(f"par_pp2_cp4_{m}", **Q, pp=2, cp=4, mode=m), "par_pp2_cp1") for m in MODES]
    rows += [(RunSpec("par_pp2_idm_cp4", **Q, **idm, pp=2, cp=4, mode="auto"), "par_pp2_idm_cp1")]
    return rows


def matrix(groups=("main",), flashqla_site: Optional[str] = None) -> list[tuple[RunSpec, str]]:
    """``[(spec, reference name)]`` of ``groups`` (the module docstring), in priority order: the groups
    in :data:`GROUPS`' order, CP=1 runs first within a group, then the runs that take the most ranks. The
    reference of a CP=1 run is its noise partner (or nothing); a stock run's is :data:`STOCK` + its CP=1
    run. A new row is one ``(RunSpec(...), reference)`` line in its group."""
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        raise ValueError(f"groups={unknown!r}: use {', '.join(GROUPS)}")
    made = {"main": _main, "fp32": _fp32, "more": _more, "flashqla": lambda: _flashqla(flashqla_site),
            "parallel": _parallel}
    return [entry for g in GROUPS if g in groups for entry in made[g]()]


def _base(ref: str) -> str:
    """The CP=1 run a reference names ("" for none or a refusal)."""
    return "" if ref.startswith(REFUSED) else ref.removeprefix(STOCK)


def with_references(todo: list, done=(), flashqla_site: Optional[str] = None) -> list:
    """``todo`` with each run's CP=1 reference put before it, when neither ``todo`` nor ``done`` (names of
    finished rows) has it: ``--groups more`` alone still has its recompute rows' CP=1 runs."""
    every = {s.name: (s, r) for s, r in matrix(GROUPS, flashqla_site)}
    have = {s.name for s, _ in todo} | set(done)
    out = []
    for spec, ref in todo:
        base = _base(ref)
        if base and base not in have and base in every:
            out.append(every[base])
            have.add(base)
        out.append((spec, ref))
    return out


# ------------------------------------------------------------------------------------------------
# time estimates and the plan
# ------------------------------------------------------------------------------------------------

START_S = {"hybrid": 105.0, "gpt": 65.0}
"""Start-up, compile and the first two iterations, 14 ranks side by side (run 2026-12-02e: hybrid
models with TE attention 60-85 s before iteration 3 and 105-130 s in all at 20 iterations; GPT 50-60 s)."""
ITERATION_S = {1: 0.2, 2: 0.9, 4: 1.0}
"""One later iteration under the same load (2026-12-02e medians: CP=1 0.1-0.2 s, CP=2 0.7-1.1 s, CP=4
0.8-1.0 s; all_gather 1.5x)."""


PARALLEL_FACTORS = {"pp": 1.5, "experts": 1.3, "mtp": 1.2, "fp8": 1.0, "start_s": 15.0}
"""Group ``parallel``'s guesses until a run measures them (none has: the rows need the GPU): per-iteration
time x1.5 with pipeline stages (activations through the host between stages sharing one GPU), x1.3 with
experts, x1.2 with MTP; 15 s more start-up with experts (TE's grouped GEMM)."""


REFUSED_S = 60.0
"""A run that must stop in ``validate_args``: its ranks import Megatron-LM and stop (seconds on an idle machine;
up to a minute beside 14 busy ranks)."""


def estimate_s(spec: RunSpec, ref: str = "") -> float:
    """Seconds ``spec`` takes on one H200 shared by ~14 ranks (the module docstring; group ``parallel``:
    :data:`PARALLEL_FACTORS`); :data:`REFUSED_S` when ``ref`` says it must be refused."""
    if ref.startswith(REFUSED):
        return REFUSED_S
    kind = "hybrid" if spec.model == "hybrid" and "*" in spec.pattern else "gpt"
    per_iteration = ITERATION_S.get(spec.cp, 0.3 * spec.cp) * (1.5 if spec.mode == "all_gather" else 1.0)
    f = PARALLEL_FACTORS
    per_iteration *= ((f["pp"] if spec.pp > 1 else 1.0) * (f["experts"] if spec.num_experts else 1.0)
                      * (f["mtp"] if spec.mtp_layers else 1.0) * (f["fp8"] if spec.fp8 else 1.0))
    start = START_S[kind] + 20.0 * (spec.cp == 1 and kind == "hybrid") + (f["start_s"] if spec.num_experts else 0.0)
    return start + spec.iterations * per_iteration


def plan(todo: list, *, max_ranks: int, budget_s: float) -> list[dict]:
    """What :func:`run_matrix` would do if every run took :func:`estimate_s`: per run ``{"name", "world",
    "start_s", "end_s"}`` (None when it would not start). Same start rule: matrix order, at most
    ``max_ranks`` ranks, a run only when its estimate fits the time left."""
    import heapq

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


# ------------------------------------------------------------------------------------------------
# the verdict
# ------------------------------------------------------------------------------------------------

RULE = "noise_or_floor"
"""bf16: loss within max(:data:`BF16_FLOOR`, 3x the noise) at every iteration; fp32: :data:`FP32_LIMITS`;
CP=1 references still learning at the end; grad norm reported, not judged."""
LEGACY_RULE = "noise"
"""Files written before :data:`RULE` (no ``rule`` key; mock data, 20 iterations): loss and grad norm within
3x the noise at every iteration, floor :data:`PRINT_FLOOR`, for every precision."""
BF16_FLOOR = 2e-3
FP32_LIMITS = (1e-6, 1e-4)
"""fp32: relative loss difference at iteration 1, and at every iteration."""

PRINT_FLOOR = {"loss": 1e-5, "grad_norm": 2e-3}
"""Differences below these cannot be read from Megatron's log: it prints the loss with 7 significant
digits and the grad norm with 3 decimals (about 1 at these sizes)."""

QUANTITIES = {"loss": "losses", "grad_norm": "grad_norms"}


def numerics(row: dict) -> str:
    """The numerics class a row is judged in, against the noise pairs of its own class: its precision
    (``bf16``, ``fp32``), with ``+fp8`` for FP8 GEMMs (``bf16+fp8``: judged by the bf16 rule on FP8's own
    noise pairs). Rows written before the FP8 field are ``bf16`` / ``fp32``."""
    return row.get("precision", "bf16") + ("+fp8" if row.get("fp8") else "")


def rel_diffs(a, b) -> list[float]:
    """Per-iteration ``|a - b| / |b|`` (``[inf]`` if a value is missing or the lengths differ)."""
    if not a or not b or len(a) != len(b) or None in a or None in b:
        return [math.inf]
    return [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)]


def _running_max(values: list[float]) -> list[float]:
    out, m = [], 0.0
    for v in values:
        m = max(m, v)
        out.append(m)
    return out


def _noise(rows: list[dict], precision: str) -> tuple[dict, dict]:
    """Per quantity, the running maximum over iterations (and the maximum over pairs) of the relative
    differences of the ``precision`` noise pairs; and a summary ``{"loss", "grad_norm", "pairs"}``."""
    by = {r["name"]: r for r in rows}
    noise = {"loss": 0.0, "grad_norm": 0.0, "pairs": []}
    envelope: dict[str, list[float]] = {"loss": [], "grad_norm": []}
    for r in rows:
        if numerics(r) != precision or not r["name"].endswith("_noise") or r["status"] != "ok":
            continue
        ref = by.get(r["reference"], {})
        if ref.get("status") != "ok":
            continue
        pair = {"run": r["name"], "reference": ref["name"]}
        for q, key in QUANTITIES.items():
            run = _running_max(rel_diffs(r[key], ref[key]))
            env = envelope[q]
            envelope[q] = [max(x, y) for x, y in zip(run, env)] + run[len(env):] + env[len(run):]
            pair[q] = run[-1]
            noise[q] = max(noise[q], run[-1])
        noise["pairs"].append(pair)
    return envelope, noise


def tolerance(rows: list[dict], precision: str = "bf16", rule: str = RULE) -> dict:
    """Per iteration, the relative difference from CP=1 that ``precision`` runs of ``rows`` are allowed
    under ``rule`` (:data:`RULE` or :data:`LEGACY_RULE`): ``{"loss": [...], "grad_norm": [...], "judged":
    [quantities the verdict reads], "noise": {...}}``, lists as long as the longest run.

    3x the noise pairs' running maximum, not the difference at that iteration alone: two bf16 runs drift
    apart as training goes and their difference crosses zero on the way; not one figure for the whole
    run either, which would let through a run that starts away from CP=1 (stock's CP=2)."""
    if rule not in (RULE, LEGACY_RULE):
        raise ValueError(f"rule={rule!r}: use {RULE!r} or {LEGACY_RULE!r} (files without a 'rule' key)")
    envelope, noise = _noise(rows, precision)
    n = max([len(r.get("losses") or []) for r in rows if numerics(r) == precision] + [1])

    def three_x(q: str) -> list[float]:
        env = envelope[q] + [envelope[q][-1] if envelope[q] else 0.0] * n
        return [3 * x for x in env[:n]]

    grad_norm = [max(x, PRINT_FLOOR["grad_norm"]) for x in three_x("grad_norm")]
    if rule == LEGACY_RULE:
        loss, judged = [max(x, PRINT_FLOOR["loss"]) for x in three_x("loss")], ["loss", "grad_norm"]
    elif precision == "fp32":
        loss, judged = [FP32_LIMITS[0]] + [FP32_LIMITS[1]] * (n - 1), ["loss"]
    else:
        loss, judged = [max(x, BF16_FLOOR) for x in three_x("loss")], ["loss"]
    return {"loss": loss, "grad_norm": grad_norm, "judged": judged, "noise": noise}


def still_learning(losses: list, window: int = 10, floor: float = 0.5) -> dict:
    """Whether a run was still learning at its end: the mean loss of the last ``window`` iterations below
    the mean of the ``window`` before, and the last loss at least ``floor`` (not memorised)."""
    if len(losses) < 2 * window or None in losses:
        return {"ok": False, "why": f"{len(losses)} iterations logged: need {2 * window}"}
    last, before = statistics.fmean(losses[-window:]), statistics.fmean(losses[-2 * window:-window])
    return {"ok": last < before and losses[-1] >= floor, "last_mean": last, "previous_mean": before,
            "last": losses[-1]}


def judge(rows: list[dict], rule: str = RULE) -> dict:
    """Fill each row's ``verdict``: ``reference`` (under :data:`RULE`: ``reference, not learning at the
    end`` when :func:`still_learning` says no) / ``noise pair`` / ``matches CP=1`` / ``differs from
    CP=1`` / ``refused before step 1 (as required)`` / ``should have been refused`` / ``not run (...)`` /
    ``did not run (...)``, and for stock rows (reference :data:`STOCK` + name) ``stock: matches CP=1`` /
    ``stock: differs from CP=1``; with the differences: largest (``loss_rel_diff``,
    ``grad_norm_rel_diff``), at iteration 1 (``..._it1``: the initial weights and the data path alone),
    the first iteration over the tolerance in a judged quantity (``first_iteration_over``) and in the
    grad norm (``grad_norm_first_over``). Returns the tolerance per precision (:func:`tolerance`)."""
    tols = {p: tolerance(rows, p, rule) for p in sorted({numerics(r) for r in rows})}
    by = {r["name"]: r for r in rows}
    for r in rows:
        ref = r["reference"]
        if ref.startswith(REFUSED):
            named = ref[len(REFUSED):]
            if r["status"] == "refused" and named in r.get("error", ""):
                r["verdict"] = "refused before step 1 (as required)"
            elif r["status"] == "refused":
                r["verdict"] = f"stopped before step 1, but not by the refusal naming {named}"
            else:
                r["verdict"] = "should have been refused"
            continue
        if r["status"] != "ok":
            if r["status"] == "refused":  # stopped before step 1 where nothing asked for a refusal: say why
                why = (r.get("error") or "").partition("): ")[2].strip().splitlines()[:1]
                r["verdict"] = f"failed before step 1 ({why[0][:80] if why else 'no error printed'})"
            else:
                r["verdict"] = r["status"] if r["status"].startswith("not run") else f"did not run ({r['status']})"
            continue
        base = by.get(_base(ref))
        if ref and (base is None or base["status"] != "ok"):
            r["verdict"] = "no CP=1 reference"
            continue
        if not ref:
            r["verdict"] = "reference"
            if rule == RULE:
                r["learning"] = still_learning(r["losses"])
                if not r["learning"]["ok"]:
                    r["verdict"] = "reference, not learning at the end"
            continue
        tol = tols[numerics(r)]
        over = {}
        for q, key in QUANTITIES.items():
            diffs = rel_diffs(r[key], base[key])
            r[f"{q}_rel_diff"], r[f"{q}_rel_diff_it1"] = max(diffs), diffs[0]
            over[q] = [i + 1 for i, d in enumerate(diffs) if not d <= tol[q][min(i, len(tol[q]) - 1)]]
        judged = sorted(over[q][0] for q in tol["judged"] if over[q])
        r["first_iteration_over"] = judged[0] if judged else None
        r["grad_norm_first_over"] = over["grad_norm"][0] if over["grad_norm"] else None
        if r["name"].endswith("_noise"):
            r["verdict"] = "noise pair"
            continue
        r["verdict"] = ("stock: " if ref.startswith(STOCK) else "") + ("differs from CP=1" if judged else "matches CP=1")
    return tols


GOOD = ("reference", "noise pair", "matches CP=1", "refused before step 1 (as required)")


def not_as_required(rows: list[dict]) -> list[str]:
    """Names of the rows whose verdict is not one the benchmark wants (stock rows are only reported)."""
    return [r["name"] for r in rows if r.get("verdict") not in GOOD and not r.get("verdict", "").startswith("stock: ")]


# ------------------------------------------------------------------------------------------------
# running the matrix
# ------------------------------------------------------------------------------------------------

def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def prepare_data(data_dir: Path, todo: list, *, source=None, max_bytes: int = byte_text.MAX_BYTES) -> dict:
    """Build the byte-level text (:func:`byte_text.build`) and the SFT set cut from it into ``data_dir``;
    returns the provenance the results record as ``data``."""
    provenance = byte_text.build(data_dir, source=source, max_bytes=max_bytes)
    sft = [s for s, _ in todo if s.data == "sft"]
    rows = max([s.iterations * s.global_batch for s in sft] + [64])  # no SFT row read twice
    seq = max([s.seq_length for s in sft] + [4096])
    path = write_sft_set(Path(data_dir) / "sft.jsonl", text=byte_text.corpus_text(source, max_bytes), rows=rows,
                         seq_length=seq)
    return provenance | {"sft": {"path": str(path), "rows": rows, "seq_length": seq, "sha256": _sha256(path)}}


RESUME_SAME = ("python", "torch", "triton", "fla", "flash_qla", "megatron_core", "gdn_cp", "gpu")
"""Versions a resumed file's rows must share with this call's."""


def load_resume(path) -> dict:
    """An earlier results file to go on from; ValueError when it is not one."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--resume {path}: cannot read it as JSON ({e}); pass a train_megatron_lm.json") from e
    if doc.get("benchmark") != "train_megatron_lm" or doc.get("rule") != RULE or "data" not in doc:
        raise ValueError(f"--resume {path}: not a train_megatron_lm result of rule {RULE!r} with its data "
                         f"provenance (benchmark={doc.get('benchmark')!r}, rule={doc.get('rule')!r})")
    return doc


def check_resume(earlier: dict, data: dict, stack: dict, path) -> None:
    """ValueError unless ``earlier``'s rows trained on the same text (``.bin`` sha256) and stack
    (:data:`RESUME_SAME`) as this call's: rows of two data sets or stacks are never judged together."""
    if earlier["data"].get("bin_sha256") != data["bin_sha256"]:
        raise ValueError(f"--resume {path}: its rows trained on data with .bin sha256 {earlier['data'].get('bin_sha256')}, "
                         f"this machine's text gives {data['bin_sha256']} (Python {earlier['data'].get('python')} there, "
                         f"{data['python']} here): run without --resume")
    changed = [f"{k}: {earlier.get('versions', {}).get(k)} there, {stack.get(k)} here" for k in RESUME_SAME
               if earlier.get("versions", {}).get(k) != stack.get(k)]
    if changed:
        raise ValueError(f"--resume {path}: its rows ran on another stack ({'; '.join(changed)}): run without --resume")


def _not_run(spec: RunSpec, ref: str, status: str) -> dict:
    return {**spec.describe(), "status": status, "losses": [], "grad_norms": [], "reference": ref, "error": "",
            "estimate_s": round(estimate_s(spec, ref))}


def run_matrix(args) -> dict:
    t0 = time.monotonic()  # --budget-s counts from here: the data and the helpers (~10-60 s) are in it
    checkout = Path(args.checkout)
    work = Path(args.work or tempfile.mkdtemp(prefix="gdn_cp_mlm_"))
    data_dir = work / "data"
    earlier = load_resume(args.resume) if args.resume else None
    kept = [r for r in (earlier or {}).get("rows", []) if r["status"] == "ok"]
    todo = [(s, ref) for s, ref in matrix(args.groups, args.flashqla_site)
            if (not args.only or any(k in s.name for k in args.only)) and s.name not in {r["name"] for r in kept}]
    todo = with_references(todo, [r["name"] for r in kept], args.flashqla_site)
    data, stack = prepare_data(data_dir, todo, source=args.text_source, max_bytes=args.text_bytes), versions()
    if earlier:
        check_resume(earlier, data, stack, args.resume)
    for tree in {checkout, *([Path(args.stock_checkout)] if args.stock_checkout else [])}:
        build_dataset_helpers(tree)  # once, before runs start side by side (they would race to build them)
    doc = {"benchmark": "train_megatron_lm", "date": now_iso(), "machine": machine_info(), "versions": stack,
           "checkout": str(checkout), "rule": RULE, "data": data, "groups": list(args.groups),
           "resumed_from": {"file": str(args.resume), "date": earlier["date"], "rows": len(kept)} if earlier else None,
           "rows": kept}
    doc["prepared_s"] = round(time.monotonic() - t0, 1)
    pool = cf.ThreadPoolExecutor(max_workers=len(todo) or 1)
    pending, running, used = list(todo), [], 0

    def save():
        doc["tolerance"] = judge(doc["rows"])
        doc["elapsed_s"] = round(time.monotonic() - t0, 1)
        write_json(args.out, doc)

    while pending or running:
        left = args.budget_s - (time.monotonic() - t0)
        while pending and used + pending[0][0].world <= args.max_ranks:
            spec, ref = pending.pop(0)
            if spec.stock and not args.stock_checkout:
                doc["rows"].append(_not_run(spec, ref, "not run (no --stock-checkout)"))
            elif estimate_s(spec, ref) > left:
                doc["rows"].append(_not_run(spec, ref, "not run (budget)"))
            else:
                used += spec.world
                logger.info("start %s (cp=%d, %d ranks in use, ~%.0f s, %.0f s left)", spec.name, spec.cp, used,
                            estimate_s(spec, ref), left)
                fut = pool.submit(launch, spec, checkout=Path(args.stock_checkout) if spec.stock else checkout,
                                  log_dir=work / "logs", data_dir=data_dir,
                                  timeout_s=min(args.run_timeout_s, max(left - 5, 30)))
                running.append((fut, spec, ref))
        if pending and not running:  # the head needs more ranks than --max-ranks
            spec, ref = pending.pop(0)
            doc["rows"].append(_not_run(spec, ref, f"not run (needs {spec.world} ranks, --max-ranks {args.max_ranks})"))
            continue
        if not running:
            break
        done, _ = cf.wait([f for f, _, _ in running], timeout=5, return_when=cf.FIRST_COMPLETED)
        for fut, spec, ref in [x for x in running if x[0] in done]:
            running.remove((fut, spec, ref))
            used -= spec.world
            try:
                row = fut.result().to_json()
            except Exception as e:  # noqa: BLE001 - the launcher itself failed: say so, go on
                row = {**spec.describe(), "status": "failed", "losses": [], "grad_norms": [], "error": repr(e)}
            row["reference"], row["estimate_s"] = ref, round(estimate_s(spec, ref))
            doc["rows"].append(row)
            logger.info("done %s: %s in %.0f s%s", spec.name, row["status"], row.get("wall_s", 0),
                        f" ({row['error'][-300:]})" if row["status"] != "ok" else "")
            save()
    save()
    return doc


# ------------------------------------------------------------------------------------------------
# reading the results
# ------------------------------------------------------------------------------------------------

def step_ms(row: dict, skip: int = 3):
    """The median of Megatron's "elapsed time per iteration (ms)" after the first ``skip`` iterations
    (compile, autotune, warm-up), or None. Comparable between runs only with one rank per GPU (ranks
    sharing one GPU over gloo time the sharing)."""
    times = sorted(t for t in (row.get("iteration_ms") or [])[skip:] if t is not None)
    return times[len(times) // 2] if times else None


def _e(x) -> str:
    return f"{x:.1e}" if x is not None else "-"


def table(doc: dict, tols: dict) -> str:
    """The rows as text, under ``tols`` (what :func:`judge` returned for them)."""
    def span(t: list[float]) -> str:
        return f"{t[0]:.1e} at iteration 1 .. {t[-1]:.1e} at {len(t)}" if t else "-"

    lines = []
    d = doc.get("data")
    if d:
        lines.append(f"data: Python {d['python']} standard library, byte-level: {d['files']} files, {d['documents']} "
                     f"documents, {d['tokens']} tokens, .bin sha256 {d['bin_sha256'][:16]}")
    lines += [f"tolerance {p} (rule {doc.get('rule', LEGACY_RULE)}, judged: {', '.join(t['judged'])}): loss "
              f"{span(t['loss'])}; grad norm {span(t['grad_norm'])}; noise pairs: loss {t['noise']['loss']:.1e}, "
              f"grad norm {t['noise']['grad_norm']:.1e}" for p, t in tols.items()]
    lines.append(f"{'run':30s} {'cp':>2s} {'mode':10s} {'data':24s} {'numerics':9s} {'loss 1 -> last':>17s} "
                 f"{'loss it1':>8s} {'loss max':>8s} {'gnorm it1':>9s} {'gnorm max':>9s} {'over':>4s} {'ms/it':>6s}  verdict")
    for r in doc["rows"]:
        losses = r.get("losses") or []
        first_last = f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses and None not in losses else "-"
        ms = step_ms(r)
        lines.append(f"{r['name']:30s} {r['cp']:>2d} {str(r['mode'] or '-'):10s} "
                     f"{r['data'] + ('+' + r['recompute'] if r['recompute'] != 'none' else ''):24s} "
                     f"{numerics(r):9s} {first_last:>17s} {_e(r.get('loss_rel_diff_it1')):>8s} "
                     f"{_e(r.get('loss_rel_diff')):>8s} {_e(r.get('grad_norm_rel_diff_it1')):>9s} "
                     f"{_e(r.get('grad_norm_rel_diff')):>9s} {str(r.get('first_iteration_over') or '-'):>4s} "
                     f"{(f'{ms:.0f}' if ms is not None else '-'):>6s}  {r.get('verdict', r['status'])}")
    lines += [f"note: {n}" for n in doc.get("notes", [])]
    return "\n".join(lines)


def plot_panels(doc: dict, tols: dict) -> list[dict]:
    """What :func:`plot` draws, one panel per CP=1 reference with runs against it: ``{"reference",
    "precision", "losses", "tolerance": [per iteration], "runs": [{"name", "label", "losses", "diff"}]}``,
    ``diff`` the relative loss difference per iteration (floored at 1e-8 for the log scale)."""
    by = {r["name"]: r for r in doc["rows"]}
    panels: dict[str, dict] = {}
    for r in doc["rows"]:
        ref = _base(r["reference"])
        base = by.get(ref)
        if r["status"] != "ok" or not ref or base is None or base["status"] != "ok" or len(r["losses"]) != len(base["losses"]):
            continue
        precision = numerics(base)
        panel = panels.setdefault(ref, {"reference": ref, "precision": precision, "losses": base["losses"],
                                        "tolerance": tols[precision]["loss"][:len(base["losses"])], "runs": []})
        label = f"{r['name'].replace(ref.replace('_cp1', ''), '').strip('_')} (cp={r['cp']})"
        panel["runs"].append({"name": r["name"], "label": label, "losses": r["losses"],
                              "diff": [max(d, 1e-8) for d in rel_diffs(r["losses"], base["losses"])]})
    return list(panels.values())


def plot(doc: dict, png: Path, tols: dict) -> bool:
    """Per CP=1 reference: the loss per iteration (top) and each run's relative loss difference from it,
    log scale, against the tolerance per iteration (bottom): how the difference grows. False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plot (pip install -e '.[bench]')")
        return False
    panels = plot_panels(doc, tols)
    cols = max(len(panels), 1)
    fig, axes = plt.subplots(2, cols, figsize=(4.2 * cols, 6.4), squeeze=False)
    for col, p in enumerate(panels):
        top, bottom = axes[0][col], axes[1][col]
        its = list(range(1, len(p["losses"]) + 1))
        top.plot(its, p["losses"], "k-", linewidth=1.6, label="CP=1")
        for run in p["runs"]:
            top.plot(its, run["losses"], "--", linewidth=1.0, label=run["label"])
            bottom.semilogy(its, run["diff"], "-", marker=".", linewidth=0.8, label=run["label"])
        bottom.step(its, p["tolerance"], where="mid", color="red", linewidth=0.8, label="tolerance")
        top.set_title(f"{p['reference']} ({p['precision']})", fontsize=9)
        top.set_ylabel("lm loss")
        top.legend(fontsize=6)
        bottom.set_xlabel("iteration")
        bottom.set_ylabel("|loss - CP=1| / CP=1")
        bottom.legend(fontsize=5)
    v, d = doc.get("versions", {}), doc.get("data") or {}
    data = f"stdlib bytes, Python {d['python']}, {d['tokens']} tokens" if d else "mock data"
    fig.suptitle(f"Megatron-LM's scripts, CP > 1 against CP=1 on {data}\n({v.get('gpu', '')}, megatron-core "
                 f"{v.get('megatron_core', '')}, FLA {v.get('fla', '')}, {doc['date'][:10]})", fontsize=9)
    return save_figure(fig, png)


def dry_run(args) -> int:
    """Build the data, write the SFT set and print the plan; run nothing."""
    todo = [(s, ref) for s, ref in matrix(args.groups, args.flashqla_site) if not args.only or any(k in s.name for k in args.only)]
    todo = with_references(todo, (), args.flashqla_site)
    work = Path(args.work or tempfile.mkdtemp(prefix="gdn_cp_mlm_"))
    print(json.dumps(prepare_data(work / "data", todo, source=args.text_source, max_bytes=args.text_bytes), indent=1))
    steps = plan(todo, max_ranks=args.max_ranks, budget_s=args.budget_s)
    for step, (spec, ref) in zip(steps, todo):
        when = f"{step['start_s']:4d} -> {step['end_s']:4d} s" if step["start_s"] is not None else "not run (budget)"
        print(f"{spec.name:30s} {spec.world:2d} ranks  {when:18s}  ref {ref or '-'}")
    ends = [s["end_s"] for s in steps if s["end_s"] is not None]
    print(f"{len(ends)} of {len(steps)} runs within --budget-s {args.budget_s:.0f}, last ends at ~{max(ends, default=0)} s "
          f"(--max-ranks {args.max_ranks}; a real call spends ~10-60 s of the budget on the data and the helpers first)")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkout", help="a patched Megatron-LM checkout (core_v0.19.x)")
    p.add_argument("--out", default="train_megatron_lm.json", help="JSON written after every run")
    p.add_argument("--work", help="folder for the data, the SFT set and the per-rank logs (default: a temp dir)")
    p.add_argument("--budget-s", type=float, default=480, help="every run ends by then; none starts that would not")
    p.add_argument("--run-timeout-s", type=float, default=300, help="kill a run after this many seconds")
    p.add_argument("--max-ranks", type=int, default=14, help="rank processes side by side")
    p.add_argument("--only", nargs="*", help="run only the matrix entries whose name contains one of these")
    p.add_argument("--flashqla-site", help="an unpacked FlashQLA site (e.g. .site-tl), first on the PYTHONPATH of "
                   "group flashqla's runs only")
    p.add_argument("--groups", type=lambda t: tuple(t.split(",")), default=("main",),
                   help=f"comma-separated matrix groups of {', '.join(GROUPS)} (default main; see matrix())")
    p.add_argument("--stock-checkout", help="an unpatched copy of the checkout, for the stock rows")
    p.add_argument("--resume", metavar="JSON", help="an earlier result of this benchmark: keep its finished rows, "
                   "run the rest")
    p.add_argument("--text-source", help="the standard library folder to read (default: this Python's)")
    p.add_argument("--text-bytes", type=int, default=byte_text.MAX_BYTES, help="size of the text in bytes")
    p.add_argument("--dry-run", action="store_true", help="build the data and print the plan; run nothing")
    p.add_argument("--plot", metavar="JSON", help="draw JSON's PNG beside it and print its table; run nothing")
    args = p.parse_args(argv)
    setup_logging()
    if args.plot:
        doc = json.loads(Path(args.plot).read_text())
        tols = judge(doc["rows"], doc.get("rule", LEGACY_RULE))
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
