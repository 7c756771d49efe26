"""Megatron-LM's own training scripts at CP > 1 against CP=1: per-iteration loss and grad norm.

Runs ``pretrain_hybrid.py`` (pattern ``G-G-*-``: GDN, MLP, TE attention; and GDN-only ``G-G-``) and
``pretrain_gpt.py`` (``--experimental-attention-variant gated_delta_net``, 3 GDN layers + 1 attention
layer) from a patched Megatron-LM checkout through :mod:`gdn_cp.testing.megatron.lm`: mock data, bf16,
TransformerEngine specs, 20 iterations; CP=1 over NCCL, CP=2 / 4 as gloo ranks sharing one GPU (or
one rank per GPU over NCCL where there are enough GPUs). The matrix (:func:`matrix`):

* noise: each model's CP=1 run twice, the second with one kernel choice changed
  (``--no-bias-swiglu-fusion``: the MLP's SwiGLU unfused); the largest relative difference of these
  pairs gives the tolerance (:func:`tolerance_from_noise`);
* no data flag (SBHD rows): CP=2 in every mode (headwise, chunkwise, all_gather) against CP=1;
* ``--dataloader-inter-document-masking``: CP=2 and 4 (``--linear-cp-mode auto``), GDN-only model
  (exact whole-row path) and models with attention layers (refused before the first step);
* ``--sft`` (a packed SFT set written here): CP=2 and 4, auto;
* recompute: CP=2 with full recompute (hybrid), with ``gdn_norm_out`` selective recompute (GPT:
  megatron-core allows it only for ``experimental_attention_variant='gated_delta_net'``).

Runs go side by side under a rank budget (``--max-ranks``) in the order of the matrix, within
``--budget-s``; the JSON (``--out``) is rewritten after every run, so a time-out keeps what finished.
``--plot FILE.json`` draws ``FILE.png`` (losses per iteration, CP=1 against CP > 1) and prints the
table, on any machine.

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
from pathlib import Path

from gdn_cp.testing.megatron.lm import RunSpec, launch, write_sft_set

from .common import machine_info, now_iso, setup_logging, versions, write_json  # noqa: F401

logger = logging.getLogger("benchmarks.train_megatron_lm")

NOISE = ("--no-bias-swiglu-fusion",)
REFUSED = "refused:"
REFUSED_IDM = REFUSED + "--dataloader-inter-document-masking"
"""A run expected to stop before its first step, with an error naming this flag."""


def matrix() -> list[tuple[RunSpec, str]]:
    """``[(spec, reference name)]`` in priority order; the reference of a CP=1 run is its noise
    partner (or itself)."""
    H, G, P = dict(model="hybrid"), dict(model="hybrid", pattern="G-G-"), dict(model="gpt")
    runs = [
        (RunSpec("hybrid_cp1", **H), ""),
        (RunSpec("hybrid_cp1_noise", **H, extra_args=NOISE), "hybrid_cp1"),
    ]
    runs += [(RunSpec(f"hybrid_cp2_{m}", **H, cp=2, mode=m), "hybrid_cp1") for m in ("chunkwise", "headwise", "all_gather")]
    runs += [
        (RunSpec("gdnonly_idm_cp1", **G, data="inter_document_masking"), ""),
        (RunSpec("gdnonly_idm_cp2", **G, cp=2, mode="auto", data="inter_document_masking"), "gdnonly_idm_cp1"),
        (RunSpec("hybrid_idm_cp2", **H, cp=2, mode="auto", data="inter_document_masking"), REFUSED_IDM),
        (RunSpec("hybrid_sft_cp1", **H, data="sft"), ""),
        (RunSpec("hybrid_sft_cp2", **H, cp=2, mode="auto", data="sft"), "hybrid_sft_cp1"),
        (RunSpec("gdnonly_idm_cp4", **G, cp=4, mode="auto", data="inter_document_masking"), "gdnonly_idm_cp1"),
        (RunSpec("hybrid_sft_cp4", **H, cp=4, mode="auto", data="sft"), "hybrid_sft_cp1"),
        (RunSpec("hybrid_full_recompute_cp2", **H, cp=2, mode="auto", recompute="full"), "hybrid_cp1"),
        (RunSpec("gpt_cp1", **P), ""),
        (RunSpec("gpt_cp1_noise", **P, extra_args=NOISE), "gpt_cp1"),
    ]
    runs += [(RunSpec(f"gpt_cp2_{m}", **P, cp=2, mode=m), "gpt_cp1") for m in ("chunkwise", "headwise", "all_gather")]
    runs += [
        (RunSpec("gpt_norm_out_recompute_cp2", **P, cp=2, mode="auto", recompute="gdn_norm_out"), "gpt_cp1"),
        (RunSpec("hybrid_idm_cp4", **H, cp=4, mode="auto", data="inter_document_masking"), REFUSED_IDM),
        (RunSpec("gpt_idm_cp2", **P, cp=2, mode="auto", data="inter_document_masking"), REFUSED_IDM),
        (RunSpec("gdnonly_idm_cp1_noise", **G, data="inter_document_masking", extra_args=NOISE), "gdnonly_idm_cp1"),
        (RunSpec("hybrid_sft_cp1_noise", **H, data="sft", extra_args=NOISE), "hybrid_sft_cp1"),
    ]
    return runs


def rel_diff(a, b) -> float:
    """Largest per-iteration ``|a - b| / |b|`` (inf if a value is missing or the lengths differ)."""
    if not a or not b or len(a) != len(b) or None in a or None in b:
        return math.inf
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def tolerance_from_noise(rows: list[dict]) -> dict:
    """The tolerance CP > 1 is held to: 3x the largest relative difference between two CP=1 runs that
    differ only in a kernel choice (per quantity), at least 1e-3 for the loss (Megatron prints 6
    digits; bf16 noise of such short runs is ~1e-3) and 1e-2 for the grad norm (3 decimals)."""
    by = {r["name"]: r for r in rows}
    noise = {"loss": 0.0, "grad_norm": 0.0, "pairs": []}
    for r in rows:
        if r["name"].endswith("_noise") and r["status"] == "ok" and by.get(r["reference"], {}).get("status") == "ok":
            ref = by[r["reference"]]
            dl, dg = rel_diff(r["losses"], ref["losses"]), rel_diff(r["grad_norms"], ref["grad_norms"])
            noise["pairs"].append({"run": r["name"], "reference": ref["name"], "loss": dl, "grad_norm": dg})
            noise["loss"], noise["grad_norm"] = max(noise["loss"], dl), max(noise["grad_norm"], dg)
    return {"loss": max(3 * noise["loss"], 1e-3), "grad_norm": max(3 * noise["grad_norm"], 1e-2), "noise": noise}


def judge(rows: list[dict]) -> dict:
    """Fill each row's ``verdict``: ``matches CP=1`` / ``differs from CP=1`` / ``refused before step 1
    (as required)`` / ``should have been refused`` / ``did not run``; returns the tolerance used."""
    tol = tolerance_from_noise(rows)
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
        if not ref or r["name"].endswith("_noise"):
            r["verdict"] = "reference" if not ref else "noise pair"
            if ref and ref in by:
                r["loss_rel_diff"] = rel_diff(r["losses"], by[ref]["losses"])
                r["grad_norm_rel_diff"] = rel_diff(r["grad_norms"], by[ref]["grad_norms"])
            continue
        base = by.get(ref)
        if base is None or base["status"] != "ok":
            r["verdict"] = "no CP=1 reference"
            continue
        r["loss_rel_diff"] = rel_diff(r["losses"], base["losses"])
        r["grad_norm_rel_diff"] = rel_diff(r["grad_norms"], base["grad_norms"])
        ok = r["loss_rel_diff"] <= tol["loss"] and r["grad_norm_rel_diff"] <= tol["grad_norm"]
        r["verdict"] = "matches CP=1" if ok else "differs from CP=1"
    return tol


def run_matrix(args) -> dict:
    checkout = Path(args.checkout)
    work = Path(args.work or tempfile.mkdtemp(prefix="gdn_cp_mlm_"))
    sft_dir = work / "data"
    write_sft_set(sft_dir / "sft.jsonl", seq_length=2048)
    todo = [(s, ref) for s, ref in matrix() if not args.only or any(k in s.name for k in args.only)]
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
            used += spec.world
            logger.info("start %s (cp=%d, %s ranks in use)", spec.name, spec.cp, used)
            fut = pool.submit(launch, spec, checkout=checkout, log_dir=work / "logs", data_dir=sft_dir,
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


def table(doc: dict) -> str:
    tol = doc.get("tolerance") or judge(doc["rows"])
    lines = [f"tolerance: loss {tol['loss']:.1e}, grad norm {tol['grad_norm']:.1e} (3x the CP=1 noise pairs: "
             f"loss {tol['noise']['loss']:.1e}, grad norm {tol['noise']['grad_norm']:.1e})",
             f"{'run':30s} {'cp':>2s} {'mode':10s} {'data':24s} {'loss 1 -> last':>17s} {'loss diff':>9s} "
             f"{'gnorm diff':>10s}  verdict"]
    for r in doc["rows"]:
        losses = r.get("losses") or []
        span = f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses and None not in losses else "-"
        dl = r.get("loss_rel_diff")
        dg = r.get("grad_norm_rel_diff")
        lines.append(f"{r['name']:30s} {r['cp']:>2d} {str(r['mode'] or '-'):10s} "
                     f"{r['data'] + ('+' + r['recompute'] if r['recompute'] != 'none' else ''):24s} {span:>17s} "
                     f"{(f'{dl:.1e}' if dl is not None else '-'):>9s} {(f'{dg:.1e}' if dg is not None else '-'):>10s}  "
                     f"{r.get('verdict', r['status'])}")
    return "\n".join(lines)


def plot(doc: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, list] = {}
    for r in doc["rows"]:
        if r["status"] == "ok":
            ref = r["reference"] or r["name"]
            groups.setdefault(r["name"] if ref.startswith(REFUSED) else ref, []).append(r)
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.6), squeeze=False)
    for ax, (ref, rows) in zip(axes[0], groups.items()):
        for r in rows:
            style = "-" if r["cp"] == 1 else "--"
            label = f"{r['name'].replace(ref, '').strip('_') or 'CP=1'} (cp={r['cp']})"
            ax.plot(range(1, len(r["losses"]) + 1), r["losses"], style, label=label, linewidth=1.2)
        ax.set_title(ref, fontsize=9)
        ax.set_xlabel("iteration")
        ax.set_ylabel("lm loss")
        ax.legend(fontsize=6)
    fig.suptitle(f"Megatron-LM scripts, CP > 1 vs CP=1 ({doc['machine'].get('gpu', '')}, {doc['date'][:10]})", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


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
    p.add_argument("--plot", metavar="JSON", help="draw JSON's PNG beside it and print its table; run nothing")
    args = p.parse_args(argv)
    setup_logging()
    if args.plot:
        import json

        doc = json.loads(Path(args.plot).read_text())
        doc["tolerance"] = judge(doc["rows"])
        print(table(doc))
        plot(doc, Path(args.plot).with_suffix(".png"))
        return 0
    if not args.checkout:
        p.error("--checkout is required (or --plot)")
    doc = run_matrix(args)
    print(table(doc))
    good = ("reference", "noise pair", "matches CP=1", "refused before step 1 (as required)")
    bad = [r["name"] for r in doc["rows"] if r.get("verdict") not in good]
    if bad:
        logger.error("not as required: %s", ", ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
