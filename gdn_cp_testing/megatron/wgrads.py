"""Which parameter's gradient moves first: Megatron-LM runs' per-parameter gradients at their first iterations,
each CP > 1 run against its CP=1 reference, beside a noise pair's (issue 47: the hybrid's CP rows have their grad norm
4-6e-4 from CP=1's at iteration 1, a model with attention for its GDN layers under Megatron's own CP 2.2e-5).

Each run is :data:`RUNS`' spec through Megatron-LM's script (:func:`gdn_cp_testing.megatron.lm.launch`), with
Megatron's own dump of every parameter's ``main_grad`` (``--save-wgrads-interval 1``: after the reduction over the
data-parallel and CP ranks, all-reduced in full) and an exit after :data:`ITERATIONS` iterations
(``--exit-interval``: the learning-rate schedule stays the 50-iteration one). :func:`compare` reads iteration i's
dump of a run and of its reference and gives each parameter's relative L2 difference ``|g - g_ref| / |g_ref|``,
the largest first, and by layer kind (:func:`kind_of`).

    python3 -m gdn_cp_testing.megatron.wgrads --checkout /tmp/megatron-lm --work /tmp/wgrads --out $OUT/wgrads.json

(``benchmarks/gpu_suite.sh``'s stage ``wgrads`` runs that on the GPU machine; the ranks share its GPU.)
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import Optional

logger = logging.getLogger("gdn_cp_testing.megatron.wgrads")

ITERATIONS = 6
"""Iterations each run trains before it exits: iteration 1's gradients come before any update; the hybrid's SBHD
chunkwise row left its band at iteration 5 (run 2026-12-07g), so the dumps reach past it (run 2026-12-07o had 3)."""

MAX_RANKS = 8
"""Ranks side by side where the GPU's memory cannot be read (an H100's 80 GiB)."""


def ranks_that_fit(precision: str = "bf16") -> int:
    """Rank processes side by side on this machine's GPU: its memory (``lm.gpu_memory_mib``) over a rank's
    (``lm.gib_per_rank``: 8 on an H100, 14 on an H200 in bf16: the 13 ranks of :func:`runs` in one wave; half that
    in fp32); :data:`MAX_RANKS` (half in fp32) where nvidia-smi cannot say."""
    from .lm import GIB_PER_RANK, gib_per_rank, gpu_memory_mib

    total, per = gpu_memory_mib("total"), gib_per_rank(precision)
    # 2 at least: a CP=2 run needs both at once
    # (no reading: the memory MAX_RANKS bf16 ranks take)
    return max(2, round(MAX_RANKS * GIB_PER_RANK / per) if total is None else int(total / 1024 // per))


ON_GDN_CPS_PATH = (("GDN_CP_MLM_GDN_CP_AT_CP1", "1"),)
"""A run's environment that hands its CP=1 SBHD GDN calls to gdn-cp's path (``gdn_cp_testing.megatron.lm``)."""

ALSO_COMPARED = (("cp2_chunkwise", "cp1_gdn_cp"), ("cp2_headwise", "cp1_gdn_cp"))
"""Comparisons beside each run's with its reference (names after the model's ``hybrid_`` / ``gdnonly_fp32_``): the
SBHD CP runs against CP=1 on gdn-cp's own kernels (run 2026-12-07o: against stock's CP=1 they were as far as the
SwiGLU noise pair; on the floor of Megatron's own CP here, the gap is the kernels' rounding alone)."""

PRECISIONS = ("bf16", "fp32")
"""``--precision``: bf16, every run of :func:`runs`; fp32, the GDN-only model's (``G-G-``: TE's fused attention under
CP takes bf16 only) CP=1, noise pair, gdn-cp path and SBHD CP=2 runs, where bf16's rounding is out of the way: a
chunkwise gradient that differs from gdn-cp's CP=1 path by far more than headwise's, at iteration 1, is a bias, not
chaos (issue 47)."""


def model_name(precision: str) -> str:
    """The probed model's name prefix at ``precision`` (:data:`PRECISIONS`): its runs are ``<prefix>_cp1``, ..."""
    return "hybrid" if precision == "bf16" else "gdnonly_fp32"


def runs(precision: str = "bf16") -> list[tuple]:
    """``(RunSpec, reference name)``: the hybrid of the training benchmark's group ``main`` at CP=1, a noise pair
    (SwiGLU by eager ops), CP=1 through gdn-cp's path (its kernels, as CP > 1 runs them, against stock's ops), CP=2
    chunkwise and headwise; the same sizes with attention for the GDN layers (Megatron's CP only); the hybrid on
    packed documents (``--dataloader-inter-document-masking``), where CP=1 runs gdn-cp's path too. In fp32
    (:data:`PRECISIONS`) the first five on the GDN-only model."""
    from .lm import RunSpec

    base = model_name(precision)
    model = RunSpec(f"{base}_cp1", **({} if precision == "bf16" else dict(pattern="G-G-", precision="fp32")))
    again = dataclasses.replace
    first = [(model, ""), (again(model, name=f"{base}_cp1_swiglu_noise", extra_args=("--no-bias-swiglu-fusion",)),
                           model.name),
             (again(model, name=f"{base}_cp1_gdn_cp", env=ON_GDN_CPS_PATH), model.name),
             (again(model, name=f"{base}_cp2_chunkwise", cp=2, mode="chunkwise"), model.name),
             (again(model, name=f"{base}_cp2_headwise", cp=2, mode="headwise"), model.name)]
    if precision != "bf16":
        return first
    nogdn, idm = RunSpec("nogdn_cp1", pattern="*-*-*-"), RunSpec("hybrid_idm_cp1", data="inter_document_masking")
    return first + [(nogdn, ""), (again(nogdn, name="nogdn_cp2", cp=2), "nogdn_cp1"),
                    (idm, ""), (again(idm, name="hybrid_idm_cp2", cp=2, mode="auto"), "hybrid_idm_cp1")]


def dump_args(save_dir: Path) -> tuple[str, ...]:
    """The flags that make a run dump its gradients into ``save_dir`` and exit after :data:`ITERATIONS`
    (Megatron wants a save interval beside ``--save``; the checkpoint it writes at the exit holds no optimizer)."""
    return ("--save-wgrads-interval", "1", "--save", str(save_dir), "--save-interval", "100000",
            "--exit-interval", str(ITERATIONS), "--no-save-optim", "--no-save-rng", "--ckpt-format", "torch")


def dump_path(save_dir: Path, iteration: int) -> Path:
    """Where Megatron's ``save_grads`` writes iteration ``iteration``'s gradients (TP rank 0, one pipeline stage)."""
    return Path(save_dir) / "wgrads" / f"iter_{iteration:07d}" / "mp_rank_00.pth"


KINDS = (("gdn", r"\.(in_proj|conv1d|A_log|dt_bias|out_norm|out_proj)\b|self_attention\.(A_log|dt_bias)"),
         ("attention", r"self_attention\.(linear_qkv|linear_proj|q_layernorm|k_layernorm)"),
         ("mlp", r"\.mlp\."), ("norm", r"norm"), ("embedding", r"embedding"), ("output", r"output_layer"))
"""Layer kinds by parameter name (the first that matches; ``other`` where none does)."""


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if re.search(pattern, name)), "other")


def compare(grads: dict, reference: dict, top: int = 12) -> dict:
    """``grads`` and ``reference``: parameter name -> gradient tensor (one run's dump and its reference's, the same
    model). Returns the whole gradient's relative L2 difference, each parameter's (``top`` largest, with its kind
    and norm), and the largest per kind; ``along``, the cosine of the difference with the reference gradient (whole
    and per parameter): rounding leaves it near 0 (about ``1 / sqrt(numel)``); a gradient scaled sets it to -1 or 1,
    and a term lost or counted twice (a part of the gradient, so leaning its way) moves it away from 0. ValueError
    where the two dumps name other parameters."""
    if set(grads) != set(reference):
        raise ValueError(f"the dumps name other parameters: {sorted(set(grads) ^ set(reference))[:6]}: compare a run "
                         "with the reference of the same model")
    rows, total_diff, total_ref, total_dot = [], 0.0, 0.0, 0.0
    for name in sorted(reference):
        g, r = grads[name].double(), reference[name].double()
        diff, norm, dot = float((g - r).norm()), float(r.norm()), float(((g - r) * r).sum())
        total_diff, total_ref, total_dot = total_diff + diff ** 2, total_ref + norm ** 2, total_dot + dot
        rows.append({"param": name, "kind": kind_of(name), "rel": diff / norm if norm else float(diff > 0),
                     "norm": norm, "along": dot / (diff * norm) if diff and norm else 0.0, "numel": r.numel()})
    rows.sort(key=lambda row: -row["rel"])
    kinds = {}
    for row in rows:
        kinds.setdefault(row["kind"], row["rel"])  # rows run largest first
    along = total_dot / (total_diff * total_ref) ** 0.5 if total_diff and total_ref else 0.0
    return {"rel": (total_diff / total_ref) ** 0.5 if total_ref else 0.0, "along": along, "top": rows[:top],
            "largest_by_kind": kinds}


def run_status(result) -> str:
    """``ok`` where the run logged a loss at each of the first :data:`ITERATIONS` iterations (it then exits by
    ``--exit-interval``, which the launcher, expecting the schedule's 50, calls ``failed``: run 2026-12-07o); else
    the launcher's status."""
    losses = list(result.losses[:ITERATIONS])
    return "ok" if len(losses) == ITERATIONS and None not in losses else result.status


def load_dump(path: Path) -> dict:
    """Megatron's dump (``{"model_chunk0": {name: tensor}}``) as one ``{name: tensor}``."""
    import torch

    chunks = torch.load(path, map_location="cpu", weights_only=False)
    return {f"{chunk}.{name}" if len(chunks) > 1 else name: t for chunk, params in chunks.items()
            for name, t in params.items()}


def run_all(checkout: Path, work: Path, timeout_s: float, max_ranks: int = MAX_RANKS, precision: str = "bf16") -> dict:
    """Every run of :func:`runs` (side by side, at most ``max_ranks`` ranks), then each compared with its reference
    at iterations 1..ITERATIONS. Returns the JSON document."""
    from . import byte_text
    from .lm import launch

    data = byte_text.build(work / "data")
    specs = [(dataclasses.replace(s, extra_args=s.extra_args + dump_args(work / "dumps" / s.name)), ref)
             for s, ref in runs(precision)]
    results, pending, running, used = {}, list(specs), {}, 0
    with cf.ThreadPoolExecutor(max_workers=len(specs)) as pool:
        while pending or running:
            while pending and used + pending[0][0].world <= max_ranks:
                spec, _ = pending.pop(0)
                used += spec.world
                running[pool.submit(launch, spec, checkout=checkout, log_dir=work / "logs", data_dir=work / "data",
                                    timeout_s=timeout_s, extra_env={"GDN_CP_TEST_FAST_AUTOTUNE": "0"})] = spec
            done, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
            for fut in done:
                spec = running.pop(fut)
                used -= spec.world
                try:
                    result = fut.result()
                except Exception as e:  # the launcher's own failure: this run's row says it, the others go on
                    results[spec.name] = {"status": "failed", "losses": [], "grad_norms": [], "error": repr(e)[-400:]}
                    logger.error("%s: the launcher failed: %r", spec.name, e)
                    continue
                results[spec.name] = {"status": run_status(result), "losses": result.losses[:ITERATIONS],
                                      "grad_norms": result.grad_norms[:ITERATIONS], "error": result.error[-400:]}
                logger.info("%s: %s (%.0f s)", spec.name, result.status, result.wall_s)
    doc = {"data": data, "iterations": ITERATIONS, "max_ranks": max_ranks, "precision": precision, "runs": results,
           "compared": {}}
    base = model_name(precision)
    also = [(f"{base}_{run}", f"{base}_{ref}") for run, ref in ALSO_COMPARED]
    for name, ref in [(spec.name, ref) for spec, ref in specs if ref] + also:
        for it in range(1, ITERATIONS + 1):
            paths = [dump_path(work / "dumps" / run, it) for run in (name, ref)]
            if all(p.is_file() for p in paths):
                doc["compared"][f"{name} vs {ref} @{it}"] = compare(*(load_dump(p) for p in paths))
            else:
                doc["compared"][f"{name} vs {ref} @{it}"] = {"missing": [str(p) for p in paths if not p.is_file()]}
    return doc


def summary(doc: dict) -> str:
    """One line per comparison: the whole gradient's difference, the largest parameter's, and each kind's."""
    lines = []
    for key, c in doc["compared"].items():
        if "missing" in c:
            lines.append(f"{key}: no dump ({', '.join(c['missing'])})")
            continue
        first = c["top"][0] if c["top"] else {"param": "-", "rel": 0.0}
        kinds = ", ".join(f"{k} {v:.1e}" for k, v in c["largest_by_kind"].items())
        lines.append(f"{key}: all {c['rel']:.2e} (along the gradient {c.get('along', 0.0):+.2f}); largest "
                     f"{first['param']} {first['rel']:.2e}; by kind: {kinds}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from .lm import GIB_PER_RANK

    p = argparse.ArgumentParser(prog="python -m gdn_cp_testing.megatron.wgrads", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkout", required=True, help="a patched Megatron-LM checkout (core_v0.19.x)")
    p.add_argument("--work", required=True, help="folder for the data, the dumps and the ranks' logs")
    p.add_argument("--out", required=True, help="JSON file: each run's first losses and grad norms, the comparisons")
    p.add_argument("--timeout-s", type=float, default=420, help="stop a run after this many seconds")
    p.add_argument("--max-ranks", type=int, default=None,
                   help=f"ranks side by side (default: the GPU's memory over {GIB_PER_RANK} GiB a rank, twice that in fp32)")
    p.add_argument("--precision", choices=PRECISIONS, default="bf16",
                   help="bf16: every run; fp32: the GDN-only model's CP=1, noise pair, gdn-cp path and CP=2 runs")
    return p


def main(argv: Optional[list] = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.max_ranks is not None and args.max_ranks < 2:
        p.error(f"--max-ranks {args.max_ranks}: the CP=2 runs need 2 ranks at once; give 2 or more")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    max_ranks = args.max_ranks or ranks_that_fit(args.precision)
    logger.info("%d ranks side by side", max_ranks)
    doc = run_all(Path(args.checkout), Path(args.work), args.timeout_s, max_ranks, args.precision)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(summary(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
