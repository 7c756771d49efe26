"""Megatron-LM's own training scripts at CP > 1 against CP=1: per-iteration loss and grad norm.

Runs ``pretrain_hybrid.py`` (pattern ``G-G-*-``: GDN, MLP, TE attention; and GDN-only ``G-G-``) and
``pretrain_gpt.py`` (``--experimental-attention-variant gated_delta_net``, 3 GDN layers + 1 attention
layer) from a patched Megatron-LM checkout through :mod:`gdn_cp_testing.megatron.lm`: mock data, bf16,
TransformerEngine specs, no dropout, 20 iterations, at the sizes of :class:`~gdn_cp_testing.megatron.lm.RunSpec`
(sequence 4096, micro-batch 2, global batch 4, hidden 1024, FFN 2048, GDN 4 key / 12 value heads of dim
128, 8 attention heads in 4 groups): above the sizes where Megatron-LM's JIT warm-up, which draws
(seq / cp) x micro-batch x FFN elements from the global CUDA generator before the model is built, leaves
that generator at the same offset for every CP size (../shared/DESIGN.md; docs/megatron.md "Initial
weights and CP"). CP=1 over NCCL, CP=2 / 4 as gloo ranks sharing one GPU (or one rank per GPU over NCCL
where there are enough GPUs). The matrix (:func:`matrix`), group ``main``:

* noise: each model's CP=1 run twice, the second with one kernel choice changed
  (``--no-bias-swiglu-fusion``: the MLP's SwiGLU unfused); 3x the largest relative difference of these
  pairs, per precision, is the tolerance (:func:`tolerance_from_noise`);
* no data flag (SBHD rows): both scripts at CP=2 and CP=4 in every mode (headwise, chunkwise,
  all_gather) against CP=1;
* stock megatron-core 0.19.2 at CP=2 from an unpatched copy of the checkout (``--stock-checkout``):
  how far Megatron's own CP run is from CP=1 at these sizes (its conv1d starts elsewhere); judged, never
  required to match;
* ``--dataloader-inter-document-masking`` (with ``--calculate-per-token-loss``; Megatron-LM's mock data:
  documents of 1-4095 tokens, cut at the row ends): CP=2 and 4 (``--linear-cp-mode auto``), the
  GDN-only model on the whole-row cut (stock's, exact) and the models with attention layers (both
  scripts) on the padded per-document cut (every document padded to a multiple of 2*cp); the GDN-only
  model on the padded cut too (``--linear-cp-thd-split per_document``), whose step time
  (``iteration_ms``, meaningful with one rank per GPU) is the padded cut's cost against the whole row;
* ``--sft`` (a packed SFT set written here, with ``--calculate-per-token-loss``): CP=2, auto;
* recompute: CP=2 with full recompute (hybrid), with ``gdn_norm_out`` selective recompute (GPT:
  megatron-core allows it only for ``experimental_attention_variant='gated_delta_net'``).

Group ``flashqla``: the hybrid model on FlashQLA's kernels (``--linear-cp-backend flashqla``) at CP=2
(chunkwise, headwise) against CP=1 on FlashQLA; ``--flashqla-site`` puts an unpacked FlashQLA site first on
those runs' PYTHONPATH only, so that every other run keeps ``auto``'s choice without it (FLA). Group ``diagnose`` tells rounding from a wrong result: GDN-only models in fp32 at CP=2
and 4.

Before any run, Megatron's C++ dataset helpers are built once in each checkout
(:func:`~gdn_cp_testing.megatron.lm.build_dataset_helpers`): runs started side by side on a fresh
checkout would race to build them. Runs go side by side under a rank budget (``--max-ranks``) in the
order of the matrix, within ``--budget-s``; the JSON (``--out``) is rewritten after every run, so a
time-out keeps what finished. ``--plot FILE.json`` draws ``FILE.png`` (losses per iteration, CP=1
against CP > 1) and prints the table, on any machine.

    python3 -m benchmarks.train_megatron_lm --checkout /tmp/mlm --out $OUT/train_megatron_lm.json
    python3 -m benchmarks.train_megatron_lm --plot benchmarks/results/train_megatron_lm.json
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import tempfile
import time
from typing import Optional
from pathlib import Path

from gdn_cp_testing.megatron.lm import RunSpec, build_dataset_helpers, launch, write_sft_set

from .common import machine_info, now_iso, setup_logging, versions, write_json  # noqa: F401

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

GROUPS = ("main", "diagnose", "flashqla")


def matrix(groups=("main",), flashqla_site: Optional[str] = None) -> list[tuple[RunSpec, str]]:
    """``[(spec, reference name)]`` in priority order; the reference of a CP=1 run is its noise
    partner (or itself); a stock run's reference is :data:`STOCK` + its CP=1 run.

    ``main``: what the README's claims rest on (the module docstring). ``diagnose``: what tells bf16
    rounding from a wrong result: GDN-only models in fp32 (CP=2 chunkwise and CP=4 on SBHD rows)."""
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        raise ValueError(f"groups={unknown!r}: use {', '.join(GROUPS)}")
    H, G, P = dict(model="hybrid"), dict(model="hybrid", pattern="G-G-"), dict(model="gpt")
    F = dict(model="hybrid", pattern="G-G-", precision="fp32")
    modes = ("chunkwise", "headwise", "all_gather")
    core: list[tuple[RunSpec, str]] = []  # main's runs in priority order: a time budget cuts the tail
    rest: list[tuple[RunSpec, str]] = []
    if "main" in groups:
        for name, kind in (("hybrid", H), ("gpt", P)):
            core += [(RunSpec(f"{name}_cp1", **kind), ""),
                     (RunSpec(f"{name}_cp1_noise", **kind, extra_args=NOISE), f"{name}_cp1")]
            core += [(RunSpec(f"{name}_cp{cp}_{m}", **kind, cp=cp, mode=m), f"{name}_cp1") for cp in (2, 4) for m in modes]
            core += [(RunSpec(f"{name}_cp2_stock", **kind, cp=2, stock=True), STOCK + f"{name}_cp1")]
        for name, kind in (("hybrid", H), ("gpt", P)):
            core += [(RunSpec(f"{name}_idm_cp1", **kind, data="inter_document_masking"), "")]
            core += [(RunSpec(f"{name}_idm_cp{cp}", **kind, cp=cp, mode="auto", data="inter_document_masking"),
                      f"{name}_idm_cp1") for cp in (2, 4)]
        rest += [
            (RunSpec("gdnonly_idm_cp1", **G, data="inter_document_masking"), ""),
            (RunSpec("gdnonly_idm_cp1_noise", **G, data="inter_document_masking", extra_args=NOISE), "gdnonly_idm_cp1"),
            (RunSpec("gdnonly_idm_cp2", **G, cp=2, mode="auto", data="inter_document_masking"), "gdnonly_idm_cp1"),
            (RunSpec("gdnonly_idm_cp4", **G, cp=4, mode="auto", data="inter_document_masking"), "gdnonly_idm_cp1"),
            (RunSpec("hybrid_sft_cp1", **H, data="sft"), ""),
            (RunSpec("hybrid_sft_cp2", **H, cp=2, mode="auto", data="sft"), "hybrid_sft_cp1"),
            (RunSpec("hybrid_full_recompute_cp2", **H, cp=2, mode="auto", recompute="full"), "hybrid_cp1"),
            (RunSpec("gpt_norm_out_recompute_cp2", **P, cp=2, mode="auto", recompute="gdn_norm_out"), "gpt_cp1"),
            (RunSpec("gdnonly_idm_padded_cp2", **G, cp=2, mode="auto", data="inter_document_masking",
                     extra_args=PADDED_CUT), "gdnonly_idm_cp1"),
            (RunSpec("gdnonly_idm_padded_cp4", **G, cp=4, mode="auto", data="inter_document_masking",
                     extra_args=PADDED_CUT), "gdnonly_idm_cp1"),
        ]
    flashqla: list[tuple[RunSpec, str]] = []
    if "flashqla" in groups:  # needs FlashQLA installed (pip install -e '.[flashqla]'); head dims 128, bf16
        Q = dict(model="hybrid", backend="flashqla", site=flashqla_site)
        flashqla += [(RunSpec("hybrid_flashqla_cp1", **Q), ""),
                     (RunSpec("hybrid_flashqla_cp2_chunkwise", **Q, cp=2, mode="chunkwise"), "hybrid_flashqla_cp1"),
                     (RunSpec("hybrid_flashqla_cp2_headwise", **Q, cp=2, mode="headwise"), "hybrid_flashqla_cp1")]
    runs = core + flashqla + rest
    if "diagnose" in groups:
        runs += [
            (RunSpec("gdnonly_fp32_cp1", **F), ""),
            (RunSpec("gdnonly_fp32_cp1_noise", **F, extra_args=NOISE), "gdnonly_fp32_cp1"),
            (RunSpec("gdnonly_fp32_cp2_chunkwise", **F, cp=2, mode="chunkwise"), "gdnonly_fp32_cp1"),
            (RunSpec("gdnonly_fp32_cp4", **F, cp=4, mode="auto"), "gdnonly_fp32_cp1"),
        ]
    return runs


def rel_diffs(a, b) -> list[float]:
    """Per-iteration ``|a - b| / |b|`` (``[inf]`` if a value is missing or the lengths differ)."""
    if not a or not b or len(a) != len(b) or None in a or None in b:
        return [math.inf]
    return [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)]


PRINT_FLOOR = {"loss": 1e-5, "grad_norm": 2e-3}
"""Differences below these cannot be read from Megatron's log: it prints the loss with 7 significant
digits and the grad norm with 3 decimals (about 1 at these sizes)."""

QUANTITIES = {"loss": "losses", "grad_norm": "grad_norms"}


def _running_max(values: list[float]) -> list[float]:
    out, m = [], 0.0
    for v in values:
        m = max(m, v)
        out.append(m)
    return out


def tolerance_from_noise(rows: list[dict], precision: str = "bf16") -> dict:
    """The per-iteration tolerance CP > 1 runs of ``precision`` are held to: at iteration i, 3x the
    largest relative difference, up to iteration i, between two CP=1 runs of that precision that
    differ only in a kernel choice (per quantity), and never below what the log can show
    (:data:`PRINT_FLOOR`).

    Per iteration, not one figure for the run: two bf16 runs start within 1e-5 and drift apart as
    the training goes (seen at these sizes: 2e-5 at iteration 1, 6e-2 once Megatron-LM's mock data is
    learnt and the loss is near 0.01), so one figure over the whole run would let through a model
    that starts 1e-3 away (stock megatron-core's CP=2 does). Returns ``{"loss": [...], "grad_norm":
    [...], "noise": {"loss": max, "grad_norm": max, "pairs": [...]}}``; without noise pairs the
    lists are empty and the floor applies."""
    by = {r["name"]: r for r in rows}
    noise = {"loss": 0.0, "grad_norm": 0.0, "pairs": []}
    envelope: dict[str, list[float]] = {"loss": [], "grad_norm": []}
    for r in rows:
        if r.get("precision", "bf16") != precision or not r["name"].endswith("_noise") or r["status"] != "ok":
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
    return {q: [max(3 * x, PRINT_FLOOR[q]) for x in envelope[q]] for q in QUANTITIES} | {"noise": noise}


def _tolerance_at(tol: list[float], i: int, q: str) -> float:
    return tol[min(i, len(tol) - 1)] if tol else PRINT_FLOOR[q]


def judge(rows: list[dict]) -> dict:
    """Fill each row's ``verdict``: ``matches CP=1`` (every iteration within the tolerance of
    :func:`tolerance_from_noise`) / ``differs from CP=1`` / ``refused before step 1 (as required)`` /
    ``should have been refused`` / ``did not run``, and for stock rows (reference :data:`STOCK` + name)
    ``stock: matches CP=1`` / ``stock: differs from CP=1``; with the differences: largest
    (``loss_rel_diff``, ``grad_norm_rel_diff``), at iteration 1 (``..._it1``: before any update, the
    initial weights and the data path alone) and the first iteration over the tolerance
    (``first_iteration_over``). Returns the tolerance used per precision (``{"bf16": {...}, ...}``)."""
    tols = {p: tolerance_from_noise(rows, p) for p in sorted({r.get("precision", "bf16") for r in rows})}
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
            r["verdict"] = f"did not run ({r['status']})"
            continue
        stock = ref.startswith(STOCK)
        ref = ref[len(STOCK):] if stock else ref
        base = by.get(ref)
        if ref and (base is None or base["status"] != "ok"):
            r["verdict"] = "no CP=1 reference"
            continue
        if not ref:
            r["verdict"] = "reference"
            continue
        tol = tols[r.get("precision", "bf16")]
        over = []
        for q, key in QUANTITIES.items():
            diffs = rel_diffs(r[key], base[key])
            r[f"{q}_rel_diff"], r[f"{q}_rel_diff_it1"] = max(diffs), diffs[0]
            over += [i + 1 for i, d in enumerate(diffs) if not d <= _tolerance_at(tol[q], i, q)]
        r["first_iteration_over"] = min(over) if over else None
        if r["name"].endswith("_noise"):
            r["verdict"] = "noise pair"
            continue
        r["verdict"] = ("stock: " if stock else "") + ("differs from CP=1" if over else "matches CP=1")
    return tols


def run_matrix(args) -> dict:
    checkout = Path(args.checkout)
    work = Path(args.work or tempfile.mkdtemp(prefix="gdn_cp_mlm_"))
    sft_dir = work / "data"
    todo = [(s, ref) for s, ref in matrix(args.groups, args.flashqla_site) if not args.only or any(k in s.name for k in args.only)]
    write_sft_set(sft_dir / "sft.jsonl", seq_length=max((s.seq_length for s, _ in todo), default=4096))
    for tree in {checkout, *([Path(args.stock_checkout)] if args.stock_checkout else [])}:
        build_dataset_helpers(tree)  # once, before runs start side by side (they would race to build them)
    doc = {"benchmark": "train_megatron_lm", "date": now_iso(), "machine": machine_info(),
           "versions": versions(), "checkout": str(checkout), "rows": []}
    running, t0 = [], time.monotonic()
    import concurrent.futures as cf

    pool = cf.ThreadPoolExecutor(max_workers=len(todo) or 1)
    pending = list(todo)
    used = 0

    def save():
        doc["tolerance"] = judge(doc["rows"])
        doc["elapsed_s"] = round(time.monotonic() - t0, 1)
        write_json(args.out, doc)

    while pending or running:
        left = args.budget_s - (time.monotonic() - t0)
        while pending and left > 60 and used + pending[0][0].world <= args.max_ranks:
            spec, ref = pending.pop(0)
            if spec.stock and not args.stock_checkout:
                doc["rows"].append({**spec.describe(), "status": "not run (no --stock-checkout)", "losses": [],
                                    "grad_norms": [], "reference": ref, "error": ""})
                continue
            used += spec.world
            logger.info("start %s (cp=%d, %s ranks in use)", spec.name, spec.cp, used)
            fut = pool.submit(launch, spec, checkout=Path(args.stock_checkout) if spec.stock else checkout,
                              log_dir=work / "logs", data_dir=sft_dir,
                              timeout_s=min(args.run_timeout_s, max(left - 10, 30)))
            running.append((fut, spec, ref))
        if not running:
            break  # the budget is spent: the rest are listed as not run
        done, _ = cf.wait([f for f, _, _ in running], timeout=5, return_when=cf.FIRST_COMPLETED)
        for fut, spec, ref in [x for x in running if x[0] in done]:
            running.remove((fut, spec, ref))
            used -= spec.world
            try:
                row = fut.result().to_json()
            except Exception as e:  # noqa: BLE001 - the launcher itself failed: say so, go on
                row = {**spec.describe(), "status": "failed", "losses": [], "grad_norms": [], "error": repr(e)}
            row["reference"] = ref
            doc["rows"].append(row)
            logger.info("done %s: %s in %.0f s%s", spec.name, row["status"], row.get("wall_s", 0),
                        f" ({row['error'][-300:]})" if row["status"] != "ok" else "")
            save()
    for spec, ref in pending:
        doc["rows"].append({**spec.describe(), "status": "not run (budget)", "losses": [], "grad_norms": [],
                            "reference": ref, "error": ""})
    save()
    return doc


def step_ms(row: dict, skip: int = 3):
    """The median of Megatron's "elapsed time per iteration (ms)" after the first ``skip`` iterations
    (compile, autotune, warm-up), or None. Comparable between runs only with one rank per GPU (ranks
    sharing one GPU over gloo time the sharing)."""
    times = sorted(t for t in (row.get("iteration_ms") or [])[skip:] if t is not None)
    return times[len(times) // 2] if times else None


def table(doc: dict, tols: dict) -> str:
    """The rows as text, under ``tols`` (what :func:`judge` returned for them)."""
    def span(t: list[float]) -> str:
        return f"{t[0]:.1e} at iteration 1 .. {t[-1]:.1e} at {len(t)}" if t else "the log floor"

    lines = [f"tolerance {p}, per iteration: 3x the running maximum of the CP=1 noise pairs (floor: the log's "
             f"loss {PRINT_FLOOR['loss']:.0e}, grad norm {PRINT_FLOOR['grad_norm']:.0e}): loss {span(t['loss'])}; "
             f"grad norm {span(t['grad_norm'])}" for p, t in tols.items()]
    lines.append(f"{'run':30s} {'cp':>2s} {'mode':10s} {'data':24s} {'prec':4s} {'loss 1 -> last':>17s} "
                 f"{'loss it1':>8s} {'loss max':>8s} {'gnorm it1':>9s} {'gnorm max':>9s} {'over':>4s} {'ms/it':>6s}  verdict")

    def e(x) -> str:
        return f"{x:.1e}" if x is not None else "-"

    for r in doc["rows"]:
        losses = r.get("losses") or []
        first_last = f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses and None not in losses else "-"
        ms = step_ms(r)
        lines.append(f"{r['name']:30s} {r['cp']:>2d} {str(r['mode'] or '-'):10s} "
                     f"{r['data'] + ('+' + r['recompute'] if r['recompute'] != 'none' else ''):24s} "
                     f"{r.get('precision', 'bf16'):4s} {first_last:>17s} {e(r.get('loss_rel_diff_it1')):>8s} "
                     f"{e(r.get('loss_rel_diff')):>8s} {e(r.get('grad_norm_rel_diff_it1')):>9s} "
                     f"{e(r.get('grad_norm_rel_diff')):>9s} {str(r.get('first_iteration_over') or '-'):>4s} "
                     f"{(f'{ms:.0f}' if ms is not None else '-'):>6s}  {r.get('verdict', r['status'])}")
    lines += [f"note: {n}" for n in doc.get("notes", [])]
    return "\n".join(lines)


def plot(doc: dict, png: Path, tols: dict) -> None:
    """Per model family (a CP=1 reference and its runs): the loss per iteration (top) and, per run,
    ``|loss - CP=1 loss| / CP=1 loss`` per iteration on a log scale with the per-iteration tolerance (bottom):
    the curves overlap too closely to compare by eye."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {r["name"]: r for r in doc["rows"]}
    groups: dict[str, list] = {}
    for r in doc["rows"]:
        ref = r["reference"].removeprefix(STOCK)
        if r["status"] == "ok" and ref and not ref.startswith(REFUSED) and by.get(ref, {}).get("status") == "ok":
            groups.setdefault(ref, []).append(r)
    fig, axes = plt.subplots(2, max(len(groups), 1), figsize=(4.2 * max(len(groups), 1), 6.4), squeeze=False)
    for col, (ref, rows) in enumerate(groups.items()):
        base = by[ref]
        top, bottom = axes[0][col], axes[1][col]
        its = range(1, len(base["losses"]) + 1)
        top.plot(its, base["losses"], "k-", linewidth=1.6, label="CP=1")
        for r in rows:
            label = f"{r['name'].replace(ref.replace('_cp1', ''), '').strip('_')} (cp={r['cp']})"
            top.plot(its, r["losses"], "--", linewidth=1.0, label=label)
            diff = [max(abs(x - y) / abs(y), 1e-8) for x, y in zip(r["losses"], base["losses"])]
            bottom.semilogy(its, diff, "-", marker=".", linewidth=0.8, label=label)
        tol = tols[base.get("precision", "bf16")]["loss"]
        bottom.step(list(its), [_tolerance_at(tol, i, "loss") for i in range(len(its))], where="mid", color="red",
                    linewidth=0.8, label="tolerance (3x noise, running)")
        top.set_title(ref, fontsize=9)
        top.set_ylabel("lm loss")
        top.legend(fontsize=6)
        bottom.set_xlabel("iteration")
        bottom.set_ylabel("|loss - CP=1| / CP=1")
        bottom.legend(fontsize=5)
    v = doc.get("versions", {})
    fig.suptitle(f"Megatron-LM's scripts, CP > 1 against CP=1 ({v.get('gpu', '')}, megatron-core "
                 f"{v.get('megatron_core', '')}, FLA {v.get('fla', '')}, {doc['date'][:10]})", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=100)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkout", help="a patched Megatron-LM checkout (core_v0.19.x)")
    p.add_argument("--out", default="train_megatron_lm.json", help="JSON written after every run")
    p.add_argument("--work", help="folder for the SFT set and the per-rank logs (default: a temp dir)")
    p.add_argument("--budget-s", type=float, default=480, help="start no run after this many seconds")
    p.add_argument("--run-timeout-s", type=float, default=300, help="kill a run after this many seconds")
    p.add_argument("--max-ranks", type=int, default=12, help="rank processes side by side")
    p.add_argument("--only", nargs="*", help="run only the matrix entries whose name contains one of these")
    p.add_argument("--flashqla-site", help="an unpacked FlashQLA site (e.g. .site-tl), first on the PYTHONPATH of "
                   "group flashqla's runs only")
    p.add_argument("--groups", type=lambda t: tuple(t.split(",")), default=("main",),
                   help=f"comma-separated matrix groups of {', '.join(GROUPS)} (default main; see matrix())")
    p.add_argument("--stock-checkout", help="an unpatched copy of the checkout, for the stock rows")
    p.add_argument("--plot", metavar="JSON", help="draw JSON's PNG beside it and print its table; run nothing")
    args = p.parse_args(argv)
    setup_logging()
    if args.plot:
        import json

        doc = json.loads(Path(args.plot).read_text())
        doc["tolerance"] = judge(doc["rows"])
        print(table(doc, doc["tolerance"]))
        plot(doc, Path(args.plot).with_suffix(".png"), doc["tolerance"])
        return 0
    if not args.checkout:
        p.error("--checkout is required (or --plot)")
    doc = run_matrix(args)
    print(table(doc, doc["tolerance"]))
    good = ("reference", "noise pair", "matches CP=1", "refused before step 1 (as required)")
    bad = [r["name"] for r in doc["rows"] if r.get("verdict") not in good and not r.get("verdict", "").startswith("stock: ")]
    if bad:
        logger.error("not as required: %s", ", ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
