"""The verdict of ``benchmarks/train_megatron_lm.py``: each CP > 1 run against its CP=1 run, inside a band made from
the noise pairs of its own model (a CP=1 run again with one harmless perturbation, ``train_megatron_lm.PAIRS``,
named ``<reference>_<kind>_noise``); the table and the plot of a results file. docs/performance.md ("Training
against CP=1: the judgement") states rule ``pairs_band`` (:data:`RULE`, its parameters in :data:`RULES`): the band,
what a model is (:func:`model_key`), the verdicts, and the legacy rule ``noise_or_floor`` that judges the committed
file. The raw files of runs 2026-12-02b, c, e (mock data, no ``rule`` key) were judged by ``noise``, which went in
issue 48 (``git show ce16681:benchmarks/mlm_verdict.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from pathlib import Path
from typing import Optional

from .common import pyplot, save_figure

REFUSED = "refused:"
"""A reference starting with this: the run must stop before its first step, with an error naming what follows."""
STOCK = "stock:"
"""A stock megatron-core run compared with this CP=1 run: reported, never required to match."""
SWEEP = "sweep:"
"""A sweep row: matches this CP=1 run (none: a CP=1 row), or is refused before its first step naming why."""
QUANTITIES = {"loss": "losses", "grad_norm": "grad_norms"}


@dataclasses.dataclass(frozen=True)
class Rule:
    """How the band is made from the noise pairs: ``envelope`` ``window`` (largest difference of any pair within
    ``window`` iterations) or ``running`` (running maximum); pairs pooled ``by`` ``model`` or by ``numerics``
    class; ``fp32_limits`` fixed fp32 loss limits (iteration 1, after) instead of the band."""

    envelope: str
    k: float
    floor: tuple  # (loss, grad norm)
    judged: tuple
    by: str
    window: int = 0
    min_pairs: int = 0
    fp32_limits: Optional[tuple] = None


RULE = "pairs_band"
RULES = {
    RULE: Rule("window", 3.0, (1e-5, 2e-3), ("loss", "grad_norm"), "model", window=1, min_pairs=3),
    "noise_or_floor": Rule("running", 3.0, (2e-3, 2e-3), ("loss",), "numerics", fp32_limits=(1e-6, 1e-4)),
}


def numerics(row: dict) -> str:
    """``bf16`` / ``fp32``, ``+fp8`` for FP8 GEMMs (with ``-tensorwise`` for that recipe)."""
    fp8 = "+fp8" + ("-" + row["fp8_recipe"] if row.get("fp8_recipe") not in (None, "delayed") else "")
    return row.get("precision", "bf16") + (fp8 if row.get("fp8") else "")


def model_key(row: dict) -> str:
    """What trains: script and layers, sizes, numerics, backend, experts, MTP, iterations and schedule."""
    layers = row.get("pattern") if row.get("model", "hybrid") == "hybrid" else \
        f"gpt{row.get('gpt_layers', 4)}/{row.get('gpt_attention_freq', 4)}"
    heads = "x".join(map(str, row.get("gdn_heads") or ()))
    return (f"{row.get('model', 'hybrid')}:{layers} h{row.get('hidden')} s{row.get('seq_length')} gdn{heads} "
            f"{numerics(row)} {row.get('backend') or 'auto'} e{row.get('num_experts') or 0} "
            f"mtp{row.get('mtp_layers') or 0} it{row.get('iterations')} "
            f"{row.get('lr_decay', 'constant')}")


def base_name(ref: str) -> str:
    """The CP=1 run a reference names ("" for none or a refusal)."""
    return "" if ref.startswith(REFUSED) else ref.removeprefix(STOCK).removeprefix(SWEEP)


def rel_diffs(a, b) -> list[float]:
    """Per-iteration ``|a - b| / |b|`` (``[inf]`` if a value is missing or the lengths differ)."""
    if not a or not b or len(a) != len(b) or None in a or None in b:
        return [math.inf]
    return [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)]


def _key(row: dict, by: dict, rule: Rule) -> str:
    """The pool a row is judged in: its reference's model (or its own numerics class, legacy rules)."""
    if rule.by == "numerics":
        return numerics(row)
    return model_key(by.get(base_name(row.get("reference", "")), row))


def _pairs(rows: list[dict], by: dict, rule: Rule) -> dict:
    """``{pool: [{"run", "reference", "loss": [d(i)], "grad_norm": [d(i)]}]}`` of the noise pairs that ran."""
    pools: dict = {}
    for r in rows:
        ref = by.get(r.get("reference", ""), {})
        if not r["name"].endswith("_noise") or r["status"] != "ok" or ref.get("status") != "ok":
            continue
        d = {q: rel_diffs(r[key], ref[key]) for q, key in QUANTITIES.items()}
        if all(math.isfinite(x) for q in d for x in d[q]):
            pools.setdefault(_key(r, by, rule), []).append({"run": r["name"], "reference": ref["name"], **d})
    return pools


def _envelope(diffs: list[list[float]], rule: Rule, n: int) -> list[float]:
    if not diffs:
        return [0.0] * n
    if rule.envelope == "running":
        per_pair = [list(itertools.accumulate(d, max)) for d in diffs]
        env = [max(d[i] for d in per_pair if i < len(d)) for i in range(max(map(len, per_pair)))]
    else:
        top = [max(d[i] for d in diffs if i < len(d)) for i in range(max(map(len, diffs)))]
        w = rule.window
        env = [max(top[max(0, i - w):i + w + 1]) for i in range(len(top))]
    return (env + [env[-1]] * n)[:n]


def bands(rows: list[dict], rule_name: str = RULE) -> dict:
    """Per pool (:func:`model_key`, or numerics class under ``noise_or_floor``), the band per iteration:
    ``{"loss": [...], "grad_norm": [...], "judged": [...], "pairs": [{"run", "loss", "grad_norm"}], "noise":
    {"loss", "grad_norm"} (the pairs' largest differences), "short": why nothing is judged, or None}``."""
    if rule_name not in RULES:
        raise ValueError(f"rule={rule_name!r}: use one of {', '.join(RULES)} (a file without a 'rule' key was "
                         "judged by 'noise', gone since issue 48)")
    rule, by = RULES[rule_name], {r["name"]: r for r in rows}
    pools = _pairs(rows, by, rule)
    keys = {_key(r, by, rule) for r in rows} | set(pools)
    out = {}
    for key in sorted(keys):
        pairs = pools.get(key, [])
        n = max([len(r.get("losses") or []) for r in rows if _key(r, by, rule) == key] + [1])
        tol = {"judged": list(rule.judged), "short": None,
               "pairs": [{"run": p["run"], **{q: max(p[q]) for q in QUANTITIES}} for p in pairs],
               "noise": {q: max([max(p[q]) for p in pairs] + [0.0]) for q in QUANTITIES}}
        for q, floor in zip(QUANTITIES, rule.floor):
            tol[q] = [max(floor, rule.k * x) for x in _envelope([p[q] for p in pairs], rule, n)]
        if rule.fp32_limits and key == "fp32":
            tol["loss"] = [rule.fp32_limits[0]] + [rule.fp32_limits[1]] * (n - 1)
        if len(pairs) < rule.min_pairs:
            tol["short"] = f"{len(pairs)} of the {rule.min_pairs} noise pairs of its model ran"
        out[key] = tol
    return out


def still_learning(losses: list, window: int = 10, floor: float = 0.5) -> dict:
    """Whether a run was still learning at its end: the mean loss of the last ``window`` iterations below
    the mean of the ``window`` before, and the last loss at least ``floor`` (not memorised)."""
    if len(losses) < 2 * window or None in losses:
        return {"ok": False, "why": f"{len(losses)} iterations logged: need {2 * window}"}
    last, before = statistics.fmean(losses[-window:]), statistics.fmean(losses[-2 * window:-window])
    return {"ok": last < before and losses[-1] >= floor, "last_mean": last, "previous_mean": before,
            "last": losses[-1]}


def _first_line(error: str) -> str:
    why = (error or "").partition("): ")[2].strip().splitlines()[:1]
    return why[0][:120] if why else "no error printed"


def _not_ok(r: dict) -> str:
    """The verdict of a row that logged no full run (refusals, failures, rows not run)."""
    ref = r["reference"]
    if r["status"].startswith("not run"):  # never started: nothing to judge, refusal or not
        return r["status"]
    if ref.startswith(REFUSED):
        named = ref[len(REFUSED):]
        if r["status"] == "refused":
            return ("refused before step 1 (as required)" if named in r.get("error", "")
                    else f"stopped before step 1, but not by the refusal naming {named}")
        return "should have been refused"
    if r["status"] == "refused" and ref.startswith(SWEEP) and not r.get("reached_training", True):
        r["refusal"] = _first_line(r.get("error", ""))
        return "refused before step 1 (with its reason)"
    if r["status"] == "refused":
        return f"failed before step 1 ({_first_line(r.get('error', ''))})"
    return f"did not run ({r['status']})"


def _left(diffs: list[float], band: list[float]) -> tuple[float, Optional[dict]]:
    """The largest difference / band, and where the row first left the band (None when it never did)."""
    ratios = [d / band[min(i, len(band) - 1)] for i, d in enumerate(diffs)]
    over = [i for i, x in enumerate(ratios) if not x <= 1.0]
    if not over:
        return max(ratios), None
    i, worst = over[0], max(range(len(ratios)), key=lambda j: ratios[j])
    return max(ratios), {"iteration": i + 1, "diff": diffs[i], "band": band[min(i, len(band) - 1)],
                         "ratio": ratios[i], "iterations_over": len(over), "worst_iteration": worst + 1,
                         "worst_ratio": ratios[worst]}


def _compare(r: dict, base: dict, tol: dict) -> None:
    """Fill the differences of ``r`` from ``base`` and its verdict inside ``tol``."""
    r["left_band"] = {}
    for q, key in QUANTITIES.items():
        diffs = rel_diffs(r[key], base[key])
        r[f"{q}_rel_diff"], r[f"{q}_rel_diff_it1"] = max(diffs), diffs[0]
        r[f"{q}_ratio"], left = _left(diffs, tol[q])
        if left:
            r["left_band"][q] = left
    judged = sorted(r["left_band"][q]["iteration"] for q in tol["judged"] if q in r["left_band"])
    r["first_iteration_over"] = judged[0] if judged else None
    r["grad_norm_first_over"] = r["left_band"].get("grad_norm", {}).get("iteration")
    if r["name"].endswith("_noise"):
        r["verdict"] = "noise pair"
    elif r["reference"].startswith(STOCK):  # reported whatever the pairs
        r["verdict"] = "stock: " + ("differs from CP=1" if judged else "matches CP=1")
    elif tol["short"]:
        r["verdict"] = f"not judged ({tol['short']})"
    else:
        r["verdict"] = "differs from CP=1" if judged else "matches CP=1"


def judge(rows: list[dict], rule: str = RULE) -> dict:
    """Fill each row's ``verdict``: ``reference`` (``reference, not learning at the end`` when
    :func:`still_learning` says no) / ``noise pair`` / ``matches CP=1`` / ``differs from CP=1`` /
    ``not judged (...)`` / ``refused before step 1 (as required)`` / ``... (with its reason)`` (sweep rows) /
    ``should have been refused`` / ``not run (...)`` / ``did not run (...)`` / ``failed before step 1 (...)`` /
    ``no CP=1 reference``, and ``stock: ...`` for stock rows; with the differences (largest, at iteration 1,
    largest / band) and ``left_band``. Returns :func:`bands`."""
    tols = bands(rows, rule)
    by = {r["name"]: r for r in rows}
    for r in rows:
        if r["status"] != "ok" or r["reference"].startswith(REFUSED):
            r["verdict"] = _not_ok(r)
            continue
        base = by.get(base_name(r["reference"]))
        if not base_name(r["reference"]):
            r["learning"] = still_learning(r["losses"])
            r["verdict"] = "reference" if r["learning"]["ok"] else "reference, not learning at the end"
        elif base is None or base["status"] != "ok":
            r["verdict"] = "no CP=1 reference"
        else:
            _compare(r, base, tols[_key(r, by, RULES[rule])])
    return tols


GOOD = ("reference", "noise pair", "matches CP=1", "refused before step 1 (as required)",
        "refused before step 1 (with its reason)")


def not_as_required(rows: list[dict]) -> list[str]:
    """Names of the rows whose verdict is not one the benchmark wants (stock rows are only reported)."""
    return [r["name"] for r in rows if r.get("verdict") not in GOOD and not r.get("verdict", "").startswith("stock: ")]


# ---- the table and the plot ----

def step_ms(row: dict, skip: int = 3):
    """The median of Megatron's "elapsed time per iteration (ms)" after the first ``skip`` iterations, or None.
    Comparable between runs only with one rank per GPU (ranks sharing one GPU over gloo time the sharing)."""
    times = [t for t in (row.get("iteration_ms") or [])[skip:] if t is not None]
    return statistics.median_high(times) if times else None


def _e(x) -> str:
    return f"{x:.1e}" if x is not None else "-"


def table(doc: dict, tols: dict) -> str:
    """The rows as text, under ``tols`` (what :func:`judge` returned for them)."""
    lines, d = [], doc.get("data")
    if d:
        lines.append(f"data: Python {d['python']} standard library, byte-level: {d['files']} files, {d['documents']} "
                     f"documents, {d['tokens']} tokens, .bin sha256 {d['bin_sha256'][:16]}")
    for key, t in tols.items():
        pairs = ", ".join(f"{p['run']} {p['loss']:.1e}/{p['grad_norm']:.1e}" for p in t["pairs"]) or "none"
        lines.append(f"band [{key}] (rule {doc['rule']}, judged: {', '.join(t['judged'])}): loss "
                     f"{t['loss'][0]:.1e} at iteration 1 .. {max(t['loss']):.1e} at most; grad norm {t['grad_norm'][0]:.1e}"
                     f" .. {max(t['grad_norm']):.1e}; pairs (loss/grad norm): {pairs}" + (f"; {t['short']}" if t["short"] else ""))
    lines.append(f"{'run':30s} {'cp':>2s} {'mode':10s} {'data':24s} {'loss 1 -> last':>17s} {'loss it1':>8s} "
                 f"{'loss max':>8s} {'gn it1':>8s} {'gn max':>8s} {'ratio':>5s} {'over':>4s} {'ms/it':>6s}  verdict")
    for r in doc["rows"]:
        losses, ms = r.get("losses") or [], step_ms(r)
        ratio = max(r.get("loss_ratio") or 0, r.get("grad_norm_ratio") or 0)
        lines.append(f"{r['name']:30s} {r['cp']:>2d} {str(r['mode'] or '-'):10s} "
                     f"{r['data'] + ('+' + r['recompute'] if r['recompute'] != 'none' else ''):24s} "
                     f"{(f'{losses[0]:.4f} -> {losses[-1]:.4f}' if losses and None not in losses else '-'):>17s} "
                     f"{_e(r.get('loss_rel_diff_it1')):>8s} {_e(r.get('loss_rel_diff')):>8s} "
                     f"{_e(r.get('grad_norm_rel_diff_it1')):>8s} {_e(r.get('grad_norm_rel_diff')):>8s} "
                     f"{(f'{ratio:.2f}' if ratio else '-'):>5s} {str(r.get('first_iteration_over') or '-'):>4s} "
                     f"{(f'{ms:.0f}' if ms is not None else '-'):>6s}  {r.get('verdict', r['status'])}")
    return "\n".join(lines + [f"note: {n}" for n in doc.get("notes", [])])


def plot_panels(doc: dict, tols: dict) -> list[dict]:
    """What :func:`plot` draws, one panel per CP=1 reference with runs against it: ``{"reference", "precision",
    "losses", "tolerance": [loss band per iteration], "runs": [{"name", "label", "losses", "diff"}]}``, ``diff``
    the relative loss difference per iteration (floored at 1e-8 for the log scale)."""
    by, rule = {r["name"]: r for r in doc["rows"]}, RULES[doc["rule"]]
    panels: dict[str, dict] = {}
    for r in doc["rows"]:
        ref = base_name(r["reference"])
        base = by.get(ref)
        if r["status"] != "ok" or not ref or base is None or base["status"] != "ok" or len(r["losses"]) != len(base["losses"]):
            continue
        panel = panels.setdefault(ref, {"reference": ref, "precision": numerics(base), "losses": base["losses"],
                                        "tolerance": tols[_key(r, by, rule)]["loss"][:len(base["losses"])], "runs": []})
        label = f"{r['name'].replace(ref.replace('_cp1', ''), '').strip('_')} (cp={r['cp']})"
        panel["runs"].append({"name": r["name"], "label": label, "losses": r["losses"],
                              "diff": [max(d, 1e-8) for d in rel_diffs(r["losses"], base["losses"])]})
    return list(panels.values())


def plot(doc: dict, png: Path, tols: dict) -> bool:
    """Per CP=1 reference: the loss per iteration (top) and each run's relative loss difference from it, log
    scale, against the band per iteration (bottom). False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    panels = plot_panels(doc, tols)
    fig, axes = plt.subplots(2, max(len(panels), 1), figsize=(4.2 * max(len(panels), 1), 6.4), squeeze=False)
    for col, p in enumerate(panels):
        top, bottom = axes[0][col], axes[1][col]
        its = list(range(1, len(p["losses"]) + 1))
        top.plot(its, p["losses"], "k-", linewidth=1.6, label="CP=1")
        for run in p["runs"]:
            top.plot(its, run["losses"], "--", linewidth=1.0, label=run["label"])
            bottom.semilogy(its, run["diff"], "-", marker=".", linewidth=0.8, label=run["label"])
        bottom.step(its, p["tolerance"], where="mid", color="red", linewidth=0.8, label="band")
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
