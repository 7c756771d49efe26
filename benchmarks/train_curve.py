#!/usr/bin/env python
"""Training curve: a small GDN + MLP language model trained at CP=1 and at CP=2 in every
``linear_cp_mode``, from the same seed and data; the loss curves must agree (target: max relative
difference <= 1e-4 in fp32).

Model (fp32, CPU): token embedding -> N blocks of [RMSNorm -> the REAL patched megatron-core 0.19.2
``GatedDeltaNet`` (``deterministic_mode=True``: gdn-cp's ``reference`` backend) -> residual ->
RMSNorm -> MLP (Linear, SiLU, Linear) -> residual] -> RMSNorm -> output head -> cross-entropy on
next-token targets. The GDN layers are built exactly as the CPU test suite builds them, with
``gdn_cp_testing.megatron.layer`` (CPU stand-ins for CUDA calls, FLA's l2norm and
TransformerEngine; the local in_proj / RMSNorm / out_proj submodules; seeded weights) to run
CPU-only Megatron. Every other parameter is drawn from a generator seeded by the run seed and
the parameter's name, so every run starts from the same weights.

Data: a synthetic, learnable, packed THD stream, one micro-batch per step (drawn from
``(seed, step)``, identical for every run): ``--tokens`` tokens cut into 2-8 sequences whose lengths
are multiples of 2*cp (= 4), so that the zigzag split is legal and sequences straddle the
contiguous rank boundary. Each sequence is a walk of one of 4 fixed Markov chains (next token = the
chain's successor of the current one with probability 0.9, else uniform noise); the chain is drawn
per sequence and must be inferred from the context, so a model that uses the conv and the recurrent
state gets below the bigram floor (JSON ``loss_floors_nats``: ideal 0.73, bigram-only 1.95, uniform
4.16 nats at vocab 64). The last token of each sequence has no target; targets never cross a
sequence boundary.

Sizes (full run): vocab 64, hidden 64, 2 blocks, GDN 4 key / 8 value heads of dim 16, conv kernel 4,
MLP 64-256-64; 2048 tokens per step, 100 steps, AdamW lr 3e-3, clip 1.0. ``--quick``: vocab 32,
hidden 32, head dim 8, MLP 64, 64 tokens, 5 steps.

CP=2 (2 gloo ranks, one torch thread each): every rank holds its zigzag rows of the micro-batch
(Megatron's load-balanced THD split), the PackedSeqParams carry the GLOBAL padded boundaries, each
rank sums its token losses and divides by the global token count (the reported loss is the
all-reduced sum), and after backward the gradients of the replicated parameters are all-reduced
over the CP group (one flat buffer: what Megatron's DP-CP gradient all-reduce does) before global
gradient-norm clipping and the optimizer step. CP=1 runs the same code on rank 0 alone (rank 1
waits). Runs: ``cp1``, then ``cp2-headwise``, ``cp2-chunkwise`` (the automatic layout-swap point:
at hidden_states for this shape), ``cp2-chunkwise-core`` (the swap forced around the core, so both
chunkwise paths are covered) and ``cp2-all_gather``.

Megatron-core: when the installed 0.19.2 is pristine, the benchmark patches a temporary COPY of it
(put first on sys.path for this process and its ranks, deleted at the end); the installed package is
never written. When it is already patched, it is used as is.

Reports, per CP=2 run: the max over steps of |loss - loss_cp1| / |loss_cp1|, the same for the
global gradient norm (before clipping; a more sensitive probe), and the max relative difference of
the final parameters (max |p - p_cp1| / max |p_cp1| over tensors, and ||p - p_cp1|| / ||p_cp1|| over
all of them). Writes JSON (machine, versions,
config, curves, differences, wall times) and a PNG (loss vs step, one line per run; |rel diff| vs
step on a log scale), and prints a table.

    python3 -m benchmarks.train_curve                       # 100 steps -> benchmarks/results/
    python3 -m benchmarks.train_curve --quick --out /tmp/tc.json   # smoke run (5 tiny steps)
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import math
import os
import sys
import tempfile
import time
import warnings
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gdn_cp.ops.accuracy import max_rel
from gdn_cp.patch import PatchError, ensure_patched
from gdn_cp_testing.megatron.layer import (assert_patched, build_gdn, install_cpu_shims, make_config, rank_groups,
                                           thd_params)
from gdn_cp_testing.packings import zigzag_rows
from gdn_cp_testing.probes import swap_points
from gdn_cp_testing.ranks import RankPool

from .common import (
    REPO_ROOT,
    add_out_arguments,
    format_table,
    load_average,
    machine_info,
    now_iso,
    resolve_out,
    save_figure,
    setup_logging,
    versions,
    write_json,
)

logger = logging.getLogger("benchmarks.train_curve")

CHAINS = 4  # Markov chains of the data; each sequence follows one of them
KEEP = 0.9  # probability that the next token is the chain's successor (else uniform noise)
CP = 2
UNIT = 2 * CP  # every sequence length is a multiple of 2*cp
TARGET_MAX_REL_DIFF = 1e-4
MODES = ("headwise", "chunkwise", "all_gather")
# name -> (cp, linear_cp_mode, chunkwise swap point)
RUNS = {
    "cp1": (1, "headwise", "auto"),
    "cp2-headwise": (2, "headwise", "auto"),
    "cp2-chunkwise": (2, "chunkwise", "auto"),
    "cp2-chunkwise-core": (2, "chunkwise", "core"),
    "cp2-all_gather": (2, "all_gather", "auto"),
}
# heads divisible by 2 (headwise needs heads % (TP*CP) == 0)
FULL = dict(steps=100, tokens=2048, vocab=64, hidden=64, layers=2, mlp_hidden=256,
            gdn=dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=16,
                     linear_value_head_dim=16, linear_conv_kernel_dim=4))
QUICK = dict(steps=5, tokens=64, vocab=32, hidden=32, layers=2, mlp_hidden=64,
             gdn=dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8,
                      linear_value_head_dim=8, linear_conv_kernel_dim=4))


# ------------------------------------------------------------------------------------------
# data (pure functions of (seed, step): identical in every process)
# ------------------------------------------------------------------------------------------
def _chains(seed: int, vocab: int) -> torch.Tensor:
    """[CHAINS, vocab]: the successor tables (random permutations) of the Markov chains."""
    gen = torch.Generator().manual_seed(10_007 * seed + 1)
    return torch.stack([torch.randperm(vocab, generator=gen) for _ in range(CHAINS)])


def micro_batch(seed: int, step: int, tokens: int, vocab: int, max_seqs: int = 8):
    """(tokens [T], targets [T], mask [T] bool, cu_seqlens list, chain per sequence) of one packed
    micro-batch: a pure function of (seed, step), identical in every process."""
    assert tokens % UNIT == 0 and tokens >= 4 * UNIT, tokens
    gen = torch.Generator().manual_seed(1_000_003 * seed + step)
    succ = _chains(seed, vocab)
    units = tokens // UNIT
    nseq = min(int(torch.randint(2, max_seqs + 1, (1,), generator=gen)), units // 2)
    # nseq - 1 distinct cut points (in units of 2*cp tokens), every sequence >= 2 units long
    while True:
        cuts = sorted(torch.randperm(units - 1, generator=gen)[: nseq - 1].add(1).tolist())
        bounds = [0] + cuts + [units]
        if all(b - a >= 2 for a, b in zip(bounds[:-1], bounds[1:])):
            break
    cu = [b * UNIT for b in bounds]
    seqs, chains = [], []
    for a, b in zip(cu[:-1], cu[1:]):
        n = b - a
        k = int(torch.randint(0, CHAINS, (1,), generator=gen))
        keep = (torch.rand(n, generator=gen) < KEEP).tolist()
        noise = torch.randint(0, vocab, (n,), generator=gen).tolist()
        table = succ[k].tolist()
        seq = [noise[0]]
        for i in range(1, n):
            seq.append(table[seq[-1]] if keep[i] else noise[i])
        seqs.append(torch.tensor(seq))
        chains.append(k)
    toks = torch.cat(seqs)
    targets = torch.roll(toks, -1)
    mask = torch.ones(tokens, dtype=torch.bool)
    mask[torch.tensor(cu[1:]) - 1] = False  # the last token of a sequence has no target
    return toks, targets, mask, cu, chains


def entropy_floor(vocab: int) -> dict:
    """Per-token loss of the ideal predictor that knows the sequence's chain, and of the best
    bigram predictor that does not (a mixture of the CHAINS successors; the chains' successors of a
    token may coincide, ignored here)."""
    q = (1 - KEEP) / vocab
    p_hit = KEEP + q
    known = -(p_hit * math.log(p_hit) + (vocab - 1) * q * math.log(q))
    p_mix = KEEP / CHAINS + q
    bigram = -(CHAINS * p_mix * math.log(p_mix) + (vocab - CHAINS) * q * math.log(q))
    return {"chain_known": round(known, 4), "bigram_only": round(bigram, 4), "uniform": round(math.log(vocab), 4)}


# ------------------------------------------------------------------------------------------
# model (built inside a rank)
# ------------------------------------------------------------------------------------------
def _init_like(name: str, p: torch.Tensor, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    n = torch.randn(p.shape, generator=gen, dtype=torch.float64)
    if "norm" in name.split(".")[-2]:  # RMSNorm weights
        v = torch.ones(p.shape, dtype=torch.float64)
    elif name == "embedding.weight":
        v = n
    elif p.dim() == 2:  # Linear [out, in]
        v = n / math.sqrt(p.shape[1])
        if name.endswith("mlp.2.weight"):
            v = 0.5 * v
    else:
        v = torch.zeros(p.shape, dtype=torch.float64)
    with torch.no_grad():
        p.copy_(v.to(p.dtype))


class Block(torch.nn.Module):
    def __init__(self, gdn, hidden: int, mlp_hidden: int):
        super().__init__()
        self.norm1 = torch.nn.RMSNorm(hidden, eps=1e-5)
        self.gdn = gdn
        self.norm2 = torch.nn.RMSNorm(hidden, eps=1e-5)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(hidden, mlp_hidden), torch.nn.SiLU(), torch.nn.Linear(mlp_hidden, hidden)
        )

    def forward(self, x, packed_seq_params):
        out, bias = self.gdn(self.norm1(x), None, packed_seq_params=packed_seq_params)
        x = x + (out if bias is None else out + bias)
        return x + self.mlp(self.norm2(x))


class TinyGDNLM(torch.nn.Module):
    def __init__(self, gdns, vocab: int, hidden: int, mlp_hidden: int, seed: int):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(Block(g, hidden, mlp_hidden) for g in gdns)
        self.final_norm = torch.nn.RMSNorm(hidden, eps=1e-5)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        for name, p in self.named_parameters():
            if ".gdn." not in name:  # GatedDeltaNet weights come from the test shims' set_params
                _init_like(name, p, seed)

    def forward(self, tokens, packed_seq_params):
        x = self.embedding(tokens).unsqueeze(1)  # [T_local, 1, H]: packed THD, batch 1
        for block in self.blocks:
            x = block(x, packed_seq_params)
        return self.head(self.final_norm(x)).squeeze(1)  # [T_local, V]


# ------------------------------------------------------------------------------------------
# one run, inside every rank of the pool
# ------------------------------------------------------------------------------------------
def _train_step(model, opt, params, group, rank: int, step: int, cfg: dict) -> tuple[float, float]:
    """One optimizer step on this rank's rows of step ``step``'s micro-batch: ``(loss, gradient norm)``, the
    loss summed over the CP group over the global target count, gradients all-reduced as DP-CP does."""
    cp = group.size()
    toks, targets, mask, cu, _ = micro_batch(cfg["seed"], step, cfg["tokens"], cfg["vocab"])
    n_global = int(mask.sum())
    rows = zigzag_rows(cu, cp, rank)
    psp = thd_params(cu)  # a fresh PackedSeqParams per micro-batch (its route cache lives on it)

    opt.zero_grad(set_to_none=True)
    logits = model(toks[rows], psp)
    token_loss = F.cross_entropy(logits, targets[rows], reduction="none")
    loss_sum = (token_loss * mask[rows].to(token_loss.dtype)).sum()
    (loss_sum / n_global).backward()

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    reported = loss_sum.detach().clone()
    if cp > 1:
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)  # DP-CP gradient all-reduce (replicated parameters)
        for g, r in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(r)
        dist.all_reduce(reported, group=group)
    for p, g in zip(params, grads):
        p.grad = g
    gnorm = torch.nn.utils.clip_grad_norm_(params, cfg["clip"])
    opt.step()

    return float(reported) / n_global, float(gnorm)


def train_run(ctx, run_name, cfg):
    """Train one run; returns a dict on rank 0 (and on rank 1 for CP=2), None where idle."""
    # megatron-core's import-time notices (no TE / Apex / absl on this machine): noise here
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    rank, world = ctx.rank, ctx.world_size
    install_cpu_shims()
    assert_patched()
    import megatron.core

    cp, mode, swap = RUNS[run_name]
    groups = rank_groups()  # every rank creates every group, in the same order
    if rank >= cp:
        return None
    group = groups["world"] if cp == world else groups["self"]
    assert group.size() == cp, (group.size(), cp)
    os.environ["GDN_CP_CHUNKWISE_SWAP"] = swap or "auto"  # this rank process's layers read it on their first call
    seed, steps = cfg["seed"], cfg["steps"]

    config = make_config(cp, mode, torch.float32, hidden_size=cfg["hidden"], num_layers=cfg["layers"],
                         linear_cp_thd_split="per_document", **cfg["gdn"])  # the rows are cut per document
    gdns = [build_gdn(config, group, seed=seed + 1 + i, layer_number=i + 1) for i in range(cfg["layers"])]
    model = TinyGDNLM(gdns, cfg["vocab"], cfg["hidden"], cfg["mlp_hidden"], seed)
    params = [p for p in model.parameters()]
    if cfg["optimizer"] == "adamw":
        opt = torch.optim.AdamW(params, lr=cfg["lr"], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    else:
        opt = torch.optim.SGD(params, lr=cfg["lr"], momentum=0.9)

    losses, grad_norms, step_s = [], [], []
    t_run = time.perf_counter()
    with swap_points() as seen:  # which layout-swap points chunkwise took, per layer
        for step in range(steps):
            t0 = time.perf_counter()
            loss, gnorm = _train_step(model, opt, params, group, rank, step, cfg)
            losses.append(loss)
            grad_norms.append(gnorm)
            step_s.append(time.perf_counter() - t0)
            if rank == 0 and (step == 0 or (step + 1) % cfg["log_every"] == 0 or step + 1 == steps):
                print(f"  [{run_name}] step {step + 1:>4}/{steps}  loss {losses[-1]:.6f}  grad norm {grad_norms[-1]:.4f}  "
                      f"({sum(step_s) / len(step_s):.3f} s/step)", flush=True)

    out = {
        "loss": losses,
        "grad_norm": grad_norms,
        "wall_s": time.perf_counter() - t_run,
        "median_step_s": sorted(step_s)[len(step_s) // 2],
        "megatron_core_file": megatron.core.__file__,
    }
    if rank == 0:
        out["final_params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        if mode == "chunkwise" and cp > 1:
            out["chunkwise_swap_points"] = sorted(set().union(*seen.values()))
    return out


# ------------------------------------------------------------------------------------------
# megatron-core: a patched copy when the installed one is pristine
# ------------------------------------------------------------------------------------------
def prepare_megatron(tmpdir: Path) -> dict:
    """Make the ranks import a patched megatron-core 0.19.2 without writing the installed one."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        raise SystemExit("megatron-core is not importable: pip install megatron-core==0.19.2")
    try:
        tree = ensure_patched(copy_to=tmpdir)
    except PatchError as err:
        raise SystemExit(f"installed megatron-core: {err}") from None
    if not tree.copied:
        return {"source": "installed (already patched)", "root": str(tree.root), "version": tree.version}
    sys.path.insert(0, str(tree.root))  # the spawned ranks inherit this sys.path
    importlib.invalidate_caches()
    return {"source": "temporary patched copy of the installed pristine package", "root": str(tree.source),
            "version": tree.version}


# ------------------------------------------------------------------------------------------
# comparison, report, plot
# ------------------------------------------------------------------------------------------
def rel_diffs(curve, ref) -> list[float]:
    return [abs(a - b) / abs(b) for a, b in zip(curve, ref)]


def param_rel_diff(params, ref) -> tuple[float, str]:
    """(max over tensors of max |p - p_ref| / max |p_ref|, the name of that tensor)."""
    worst, where = 0.0, ""
    for name, want in ref.items():
        d = max_rel(params.get(name), want)
        if math.isnan(d) or (not math.isnan(worst) and d > worst):  # NaN is the worst and stays so
            worst, where = d, name
    return worst, where


def _display_path(path) -> str:
    p = Path(path).resolve()
    try:
        return str(p.relative_to(REPO_ROOT))
    except ValueError:
        return str(p)


def make_plot(report, path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib not installed: no plot written (pip install matplotlib)")
        return False
    runs = report["runs"]
    steps = list(range(1, report["config"]["steps"] + 1))
    fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(8, 8.2), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    styles = ["-", "--", "-.", ":", (0, (5, 1))]
    for (name, run), ls in zip(runs.items(), styles):
        ax0.plot(steps, run["loss"], linestyle=ls, linewidth=2.2 if name == "cp1" else 1.4, label=name)
    ax0.set_ylabel("loss (cross-entropy, nats)")
    c = report["config"]
    ax0.set_title(f"GDN+MLP LM, {c['layers']} blocks, hidden {c['hidden']}, {c['tokens']} packed THD tokens/step, "
                  f"fp32\nCP=1 vs CP=2 (gloo, reference backend), same seed and data", fontsize=10)
    ax0.grid(True, alpha=0.3)
    ax0.legend()
    for name, d in report["rel_diff_per_step"].items():
        zeros = sum(v == 0 for v in d)
        ax1.plot(steps, [v if v > 0 else float("nan") for v in d], marker=".", markersize=4, linewidth=0.7,
                 label=f"{name} ({zeros} steps equal)")
    ax1.axhline(TARGET_MAX_REL_DIFF, color="red", linestyle="--", linewidth=1, label=f"target {TARGET_MAX_REL_DIFF:g}")
    ax1.axhline(2.0**-23, color="gray", linestyle=":", linewidth=1, label="fp32 epsilon")
    ax1.set_yscale("log")
    ax1.set_xlabel("step")
    ax1.set_ylabel("|loss - loss_cp1| / loss_cp1")
    ax1.set_title("relative difference from CP=1 (steps with exactly equal losses are not drawn)", fontsize=10)
    ax1.grid(True, which="both", alpha=0.3)
    ax1.set_ylim(1e-8, 1e-3)
    ax1.legend(fontsize=8, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    return save_figure(fig, path)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=None, help=f"training steps per run (default {FULL['steps']}; "
                                                           f"--quick: {QUICK['steps']})")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: {QUICK['steps']} steps of {QUICK['tokens']} tokens, vocab {QUICK['vocab']}")
    p.add_argument("--tokens", type=int, default=None,
                   help=f"packed tokens per micro-batch, a multiple of {UNIT} (default {FULL['tokens']}, --quick {QUICK['tokens']})")
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS),
                   help="runs to do (cp1 is always done: it is the reference)")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default 3e-3 AdamW, 0.1 SGD)")
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip (default 1.0)")
    p.add_argument("--seed", type=int, default=0)
    add_out_arguments(p, "train_curve.json")
    p.add_argument("--plot", default=None, help="PNG path (default: the JSON path with .png)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run before the ranks count as hung")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    base = QUICK if args.quick else FULL
    args.steps = base["steps"] if args.steps is None else args.steps
    args.tokens = base["tokens"] if args.tokens is None else args.tokens
    if args.tokens % UNIT or args.tokens < 4 * UNIT:
        p.error(f"--tokens must be a multiple of {UNIT} and >= {4 * UNIT}")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    args.lr = (3e-3 if args.optimizer == "adamw" else 0.1) if args.lr is None else args.lr
    if "cp1" not in args.runs:
        args.runs = ["cp1"] + args.runs
    args.out = str(resolve_out(args, "train_curve.json", p))
    args.plot = args.plot or str(Path(args.out).with_suffix(".png"))
    args.base = base
    return args


def _run_all(args, cfg) -> tuple[dict, dict, float]:
    """Every run of ``args.runs`` in one pool of CP ranks: ``(rank 0's result per run, megatron-core's version
    and source, the pool's wall seconds)``."""
    with tempfile.TemporaryDirectory(prefix="gdn_cp_train_curve_") as tmp:
        mcore = prepare_megatron(Path(tmp))
        print(f"megatron-core {mcore['version']}: {mcore['source']}", flush=True)
        print(f"config: {cfg}", flush=True)
        t0 = time.perf_counter()
        pool = RankPool(CP, device="cpu", timeout_s=args.timeout)
        results = {}
        try:
            for name in args.runs:
                print(f"run {name} ({RUNS[name][0]} rank(s), mode {RUNS[name][1]}, swap {RUNS[name][2]})", flush=True)
                per_rank = pool.run(train_run, name, cfg)
                r0 = per_rank[0]
                if RUNS[name][0] > 1:  # every rank saw the same all-reduced loss
                    assert per_rank[1]["loss"] == r0["loss"], f"{name}: ranks disagree on the loss"
                results[name] = r0
                print(f"  [{name}] done in {r0['wall_s']:.1f} s", flush=True)
        finally:
            pool.close()
        pool_wall = time.perf_counter() - t0

    return results, mcore, pool_wall


def _compare(results: dict) -> tuple[dict, dict, list, bool]:
    """Each run against cp1: ``(entry per run, relative loss difference per step, table rows, all met)``."""
    ref = results["cp1"]
    runs, per_step, rows = {}, {}, []
    all_met = True
    for name, r in results.items():
        entry = {
            "cp": RUNS[name][0], "linear_cp_mode": RUNS[name][1] if RUNS[name][0] > 1 else None,
            "chunkwise_swap": RUNS[name][2] if RUNS[name][1] == "chunkwise" and RUNS[name][0] > 1 else None,
            "loss": r["loss"], "grad_norm": r["grad_norm"], "wall_s": round(r["wall_s"], 3),
            "median_step_s": round(r["median_step_s"], 4),
        }
        if "chunkwise_swap_points" in r:
            entry["chunkwise_swap_points_used"] = r["chunkwise_swap_points"]
        if name != "cp1":
            d = rel_diffs(r["loss"], ref["loss"])
            per_step[name] = d
            entry["max_rel_diff_loss"] = max(d)
            entry["max_rel_diff_grad_norm"] = max(rel_diffs(r["grad_norm"], ref["grad_norm"]))
            entry["max_rel_diff_final_params"], entry["final_params_worst_tensor"] = param_rel_diff(
                r["final_params"], ref["final_params"])
            entry["rel_l2_final_params"] = math.sqrt(
                sum(float((r["final_params"][n].double() - w.double()).square().sum()) for n, w in ref["final_params"].items())
                / sum(float(w.double().square().sum()) for w in ref["final_params"].values()))
            entry["exactly_equal_loss_steps"] = sum(v == 0 for v in d)
            entry["met"] = entry["max_rel_diff_loss"] <= TARGET_MAX_REL_DIFF
            all_met &= entry["met"]
            rows.append([name, f"{entry['max_rel_diff_loss']:.2e}", f"{entry['max_rel_diff_grad_norm']:.2e}",
                         f"{entry['max_rel_diff_final_params']:.2e}", f"{r['loss'][-1]:.4f}",
                         f"{r['wall_s']:.1f}", "yes" if entry["met"] else "NO"])
        runs[name] = entry

    return runs, per_step, rows, all_met


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_logging(args.verbose)
    cfg = dict(
        steps=args.steps, tokens=args.tokens, vocab=args.base["vocab"], hidden=args.base["hidden"],
        layers=args.base["layers"], mlp_hidden=args.base["mlp_hidden"], gdn=args.base["gdn"], optimizer=args.optimizer, lr=args.lr,
        clip=args.clip, seed=args.seed, log_every=max(1, args.steps // 10),
    )
    t_start = time.perf_counter()
    load_before = load_average()
    results, mcore, pool_wall = _run_all(args, cfg)
    ref = results["cp1"]
    nseqs, straddle = [], 0
    for step in range(cfg["steps"]):
        cu = micro_batch(cfg["seed"], step, cfg["tokens"], cfg["vocab"])[3]
        nseqs.append(len(cu) - 1)
        straddle += any(a < cfg["tokens"] // CP < b for a, b in zip(cu[:-1], cu[1:]))
    n_params = sum(t.numel() for t in ref["final_params"].values())
    runs, per_step, rows, all_met = _compare(results)

    report = {
        "benchmark": "train_curve",
        "date": now_iso(),
        "machine": machine_info(),
        "versions": versions({"megatron_core": mcore["version"]}),
        "megatron_core": mcore,
        "command": "python3 -m benchmarks.train_curve " + " ".join(sys.argv[1:] if argv is None else argv),
        "config": {
            **{k: v for k, v in cfg.items() if k != "log_every"},
            "quick": args.quick, "cp": CP, "dtype": "float32", "backend": "reference (deterministic_mode=True)",
            "parameters": n_params, "loss_floors_nats": entropy_floor(cfg["vocab"]),
            "model": (f"embedding -> {cfg['layers']} x [RMSNorm -> megatron GatedDeltaNet -> residual -> RMSNorm -> "
                      f"MLP {cfg['hidden']}-{cfg['mlp_hidden']}-{cfg['hidden']} (SiLU) -> residual] -> RMSNorm -> head"),
            "data": (f"synthetic packed THD, {cfg['tokens']} tokens/step, 2-8 sequences per step (lengths multiples "
                     f"of {UNIT}), each a walk of one of {CHAINS} fixed Markov chains (successor with probability "
                     f"{KEEP}, else uniform), a new micro-batch per step"),
            "sequences_per_step": nseqs,
            "steps_with_a_sequence_across_the_contiguous_rank_boundary": straddle,
            "loss": "sum of next-token cross-entropy over ranks / global target count (last token of a sequence has none)",
            "grads": "all-reduced (sum) over the CP group, then global-norm clipping, then the optimizer step",
            "optimizer_details": ("AdamW betas (0.9, 0.95), eps 1e-8, weight decay 0.01" if cfg["optimizer"] == "adamw"
                                  else "SGD momentum 0.9"),
            "torch_threads_per_rank": 1,
        },
        "target": {"max_rel_diff_loss": TARGET_MAX_REL_DIFF, "all_met": all_met},
        "max_rel_diff_loss": {n: runs[n]["max_rel_diff_loss"] for n in runs if n != "cp1"},
        "runs": runs,
        "rel_diff_per_step": per_step,
        "wall_s": {"total": round(time.perf_counter() - t_start, 2), "pool_and_runs": round(pool_wall, 2),
                   "per_run": {n: runs[n]["wall_s"] for n in runs}},
        "load_average_before": load_before,
        "load_average_after": load_average(),
    }
    plotted = False if args.no_plot else make_plot(report, args.plot)
    report["plot"] = _display_path(args.plot) if plotted else None
    write_json(args.out, report)

    print()
    print(f"training curve, CP=2 vs CP=1, {cfg['steps']} steps, fp32; loss at step 1 {ref['loss'][0]:.4f}, "
          f"at step {cfg['steps']} {ref['loss'][-1]:.4f} (cp1 {ref['wall_s']:.1f} s)")
    print(format_table(["run", "max rel diff loss", "grad norm", "final params", "final loss", "wall s",
                        f"<= {TARGET_MAX_REL_DIFF:g}"], rows))
    print(f"total {report['wall_s']['total']:.1f} s; load average {load_before} -> {report['load_average_after']}")
    print(f"wrote {args.out}" + (f" and {args.plot}" if plotted else ""))
    return 0 if all_met else 1


if __name__ == "__main__":
    sys.exit(main())
