"""Run Megatron-LM's own training scripts (``pretrain_hybrid.py``, ``pretrain_gpt.py``) from a patched
checkout, on ranks that share one GPU or one rank per GPU: the test-only launcher behind
``benchmarks/train_megatron_lm.py`` and the GPU tests of Megatron-LM end to end.

What is Megatron-LM's own: the script, its argument parser and ``validate_args``, its ``get_batch``
and ``forward_step`` (Megatron's CP batch splits: per-sequence, per-document with ``--sft``, whole row
with ``--dataloader-inter-document-masking``), TransformerEngine specs and attention, DDP, the
optimizer and the training loop. What this module adds, in the rank process only
(:func:`install_rank_shims`), and only where the run needs it:

* **ranks sharing one GPU** (CP > number of GPUs): NCCL refuses two ranks on one GPU, so the ranks
  use gloo (``--distributed-backend gloo``) and every rank gets ``LOCAL_RANK=0``. Megatron's DDP
  issues its bucket collectives inside ``torch.distributed._coalescing_manager``, which gloo cannot
  coalesce for CUDA tensors: here they are issued one by one (the same reductions, in the same
  order). FLA's cp context gathers into ``[world, n, ...]`` outputs, which gloo rejects: they are
  viewed flat (:func:`gdn_cp_testing.ranks.adapt_fla_collectives_for_gloo`). TE attention under CP
  then needs ``--cp-comm-type a2a`` (p2p sends CUDA tensors point to point, which gloo cannot).
  Megatron's own point-to-point transfers (pipeline stages' activations and shapes, MTP's roll under CP)
  go through the host (:mod:`.host_p2p`);
* **``--sft``**: Megatron-LM's SFT dataset reads JSONL through HuggingFace ``datasets`` and tokenizes
  conversations with a HuggingFace chat tokenizer, neither of which the test machines have. The
  stand-ins read the JSONL this module writes (:func:`write_sft_set`: every message's content is a
  space-separated list of token ids, byte-level slices of the benchmark's text) and tokenize a
  conversation as Megatron's SFT tokenizer would for such ids: the ids of every message in order, the
  targets of non-assistant messages masked (``-100``). ``SFTDataset`` itself packs, pads every
  conversation to a multiple of 2*cp and builds ``cu_seqlens``, as in a real SFT run;
* ``GDN_CP_TEST_FAST_AUTOTUNE=1``: FLA's autotuners take their first working config
  (:func:`gdn_cp_testing.ranks.maybe_fast_autotune`); numerics stay valid, timings do not.

The other runs read the Python standard library's source as byte-level tokens, an indexed dataset built by
:mod:`.byte_text` into the run's data folder (``--data-path``), each run with its own ``--data-cache-path``
(Megatron writes its sample indices there: runs side by side would race on one cache).

Per-iteration ``lm loss`` and ``grad norm`` are read from the log Megatron prints (``--log-interval
1``); a rank that fails ends the run within seconds (its peers are killed) with its last lines kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.abc
import importlib.util
import json
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from .byte_text import PAD, PREFIX, VOCAB

_CLONE = str(Path(__file__).resolve().parents[2])  # the clone's root: gdn_cp_testing is not installed

__all__ = [
    "DATA_FLAGS",
    "GIB_PER_RANK",
    "gib_per_rank",
    "RECOMPUTE",
    "RunSpec",
    "RunResult",
    "megatron_lm_args",
    "parallelism_args",
    "parse_training_log",
    "launch",
    "gpu_memory_mib",
    "build_dataset_helpers",
    "write_sft_set",
    "install_rank_shims",
    "main",
]

logger = logging.getLogger(__name__)

DATA_FLAGS = {
    "none": [],
    # --calculate-per-token-loss: at CP > 1 a model with attention layers gets every document padded to a
    # multiple of 2*cp, and the pads fall unevenly on the ranks (validate_args refuses it without the flag); the
    # CP=1 runs and the GDN-only ones take it too, so that every run of the flag trains the same objective
    "inter_document_masking": ["--dataloader-inter-document-masking", "--calculate-per-token-loss"],
    "sft": ["--sft"],
}
"""Megatron-LM's data flags that decide how a packed row is cut over the CP ranks (README "Train a model", docs/megatron.md "which cut")."""

RECOMPUTE = {
    "none": [],
    "full": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    "gdn_norm_out": ["--recompute-granularity", "selective", "--recompute-modules", "gdn_norm_out"],
}

PRECISIONS = {"bf16": ["--bf16"], "fp32": []}
"""The run's precision flags: fp32 runs (GDN-only models: TE's fused attention under CP takes bf16 / fp16
only) show the CP=1 match with bf16 rounding out of the way."""

SCRIPTS = ("pretrain_hybrid.py", "pretrain_gpt.py")


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One training run. ``mode`` None: no ``--linear-cp-mode`` flag (CP=1, or stock's default).

    ``model``: ``"hybrid"`` (pretrain_hybrid.py, ``pattern`` of G (GDN), * (attention), - (MLP), E (MoE:
    needs ``num_experts``)) or ``"gpt"`` (pretrain_gpt.py, ``--experimental-attention-variant
    gated_delta_net``: ``gpt_layers`` layers, every ``gpt_attention_freq``-th a softmax-attention layer; 0: GDN
    only).

    Parallelism beside CP (TP stays 1): ``pp`` pipeline stages (the pattern's layers split evenly), ``dp``
    data-parallel replicas, ``ep`` expert-parallel ranks (Megatron folds them over the DP x CP ranks, so
    ``dp * cp`` must divide by ``ep``); :attr:`world` = ``cp * pp * dp`` ranks. ``num_experts``: experts of every E
    layer (top-2 routing, expert FFN = ``hidden``, the alltoall token dispatcher, TE's grouped GEMM; no router
    auxiliary loss unless ``extra_args`` sets one). ``mtp_layers``: multi-token prediction depths
    (``--mtp-num-layers``; hybrid models also get ``mtp_pattern`` once per depth after the pattern's "/").
    ``fp8``: ``--fp8-format`` (TransformerEngine, bf16 runs only), ``fp8_recipe`` its ``--fp8-recipe``. The learning
    rate warms up for ``lr_warmup`` iterations to ``lr``, then decays (``lr_decay``) to ``min_lr`` at the last one."""

    name: str
    model: str = "hybrid"
    cp: int = 1
    mode: Optional[str] = None
    data: str = "none"
    recompute: str = "none"
    pattern: str = "G-G-*-"
    gpt_layers: int = 4
    gpt_attention_freq: int = 4
    iterations: int = 50
    seq_length: int = 4096
    micro_batch: int = 2
    global_batch: int = 4
    hidden: int = 1024
    gdn_heads: tuple = (4, 12)  # (key heads, value heads): a ratio other than 2
    gdn_head_dim: int = 128
    attention_heads: tuple = (8, 4)  # (query heads, query groups): head dim hidden / 8
    lr: float = 6e-4  # the peak, after lr_warmup iterations; then lr_decay down to min_lr at the last iteration
    lr_warmup: int = 10
    lr_decay: str = "cosine"  # --lr-decay-style: "cosine" (as pretraining runs), "linear" or "constant"
    min_lr: float = 6e-5
    backend: Optional[str] = None  # --linear-cp-backend (None: no flag, the config's default "auto")
    site: Optional[str] = None  # a folder put first on the ranks' PYTHONPATH (e.g. an unpacked FlashQLA site)
    seed: int = 1234
    env: tuple = ()  # extra environment, as (name, value) pairs (e.g. a kernel choice)
    extra_args: tuple = ()
    precision: str = "bf16"  # "bf16" (--bf16) or "fp32" (no precision flag: fp32 params and compute)
    stock: bool = False  # run from an unpatched checkout: stock megatron-core 0.19.2's GDN (headwise)
    pp: int = 1  # --pipeline-model-parallel-size
    dp: int = 1  # data-parallel replicas
    ep: int = 1  # --expert-model-parallel-size
    num_experts: Optional[int] = None  # --num-experts (the pattern's E layers)
    mtp_layers: int = 0  # --mtp-num-layers
    mtp_pattern: str = "*-"  # a hybrid model's layers per MTP depth (Megatron's "/" syntax)
    fp8: Optional[str] = None  # --fp8-format ("hybrid", "e4m3")
    fp8_recipe: Optional[str] = None  # --fp8-recipe ("delayed": Megatron's default; "tensorwise": current scaling)

    def __post_init__(self):
        if self.model not in ("hybrid", "gpt"):
            raise ValueError(f"RunSpec.model={self.model!r}: use 'hybrid' or 'gpt'")
        if self.data not in DATA_FLAGS:
            raise ValueError(f"RunSpec.data={self.data!r}: use one of {sorted(DATA_FLAGS)}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"RunSpec.recompute={self.recompute!r}: use one of {sorted(RECOMPUTE)}")
        if not isinstance(self.cp, int) or self.cp < 1:
            raise ValueError(f"RunSpec.cp={self.cp!r} must be a positive int")
        if self.precision not in PRECISIONS:
            raise ValueError(f"RunSpec.precision={self.precision!r}: use one of {sorted(PRECISIONS)}")
        if self.stock and self.backend is not None:
            raise ValueError(f"RunSpec.backend={self.backend!r} with stock=True: stock Megatron-LM has no "
                             "--linear-cp-backend; leave backend None")
        if self.stock and self.mode is not None:
            raise ValueError(f"RunSpec.mode={self.mode!r} with stock=True: stock Megatron-LM has no --linear-cp-mode; "
                             "leave mode None")
        for name in ("iterations", "seq_length", "micro_batch", "global_batch", "hidden", "gdn_head_dim", "pp", "dp", "ep"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"RunSpec.{name}={getattr(self, name)!r} must be a positive int")
        if self.lr_decay not in ("cosine", "linear", "constant"):
            raise ValueError(f"RunSpec.lr_decay={self.lr_decay!r}: use 'cosine', 'linear' or 'constant'")
        if self.global_batch % (self.micro_batch * self.dp):
            raise ValueError(f"RunSpec.global_batch={self.global_batch} must be a multiple of micro_batch x dp = "
                             f"{self.micro_batch} x {self.dp} (each data-parallel rank takes whole micro-batches)")
        self._check_parallelism()

    def _check_parallelism(self) -> None:
        """ValueError for pipeline / expert / MTP / FP8 fields that do not fit together."""
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"RunSpec.ep={self.ep} must divide dp x cp = {self.dp} x {self.cp}: Megatron folds the expert-"
                             "parallel ranks over the data- and context-parallel ranks (raise dp)")
        moe_layers = self.model == "hybrid" and "E" in self.pattern + (self.mtp_pattern if self.mtp_layers else "")
        if moe_layers != (self.num_experts is not None):
            raise ValueError(f"RunSpec.num_experts={self.num_experts!r} with pattern={self.pattern!r}: give num_experts "
                             "exactly when a hybrid pattern (or its MTP pattern) has E (MoE) layers")
        if self.num_experts is not None and (self.num_experts < 2 or self.num_experts % self.ep):
            raise ValueError(f"RunSpec.num_experts={self.num_experts} must be >= 2 (top-2 routing) and divide by "
                             f"ep={self.ep}")
        if self.ep > 1 and self.num_experts is None:
            raise ValueError(f"RunSpec.ep={self.ep} without num_experts: expert parallelism needs MoE (E) layers")
        segments = self.pattern.split("|") if self.model == "hybrid" else [""] * self.gpt_layers
        layers = len("".join(segments)) if self.model == "hybrid" else self.gpt_layers
        if (len(segments) if len(segments) > 1 else layers) % self.pp:
            raise ValueError(f"RunSpec.pp={self.pp} must divide the model's {layers} layers (the stages split them "
                             f"evenly), or its pattern's {len(segments)} '|' segments")
        if not isinstance(self.mtp_layers, int) or self.mtp_layers < 0:
            raise ValueError(f"RunSpec.mtp_layers={self.mtp_layers!r} must be an int >= 0")
        if self.fp8 is not None and (self.fp8 not in ("hybrid", "e4m3") or self.precision != "bf16"):
            raise ValueError(f"RunSpec.fp8={self.fp8!r} with precision={self.precision!r}: use fp8 'hybrid' or 'e4m3' "
                             "on a bf16 run (TransformerEngine computes the rest in bf16)")
        if self.fp8_recipe is not None and (self.fp8 is None or self.fp8_recipe not in ("delayed", "tensorwise")):
            raise ValueError(f"RunSpec.fp8_recipe={self.fp8_recipe!r} with fp8={self.fp8!r}: use 'delayed' or "
                             "'tensorwise' on an FP8 run (set fp8)")

    @property
    def script(self) -> str:
        return "pretrain_hybrid.py" if self.model == "hybrid" else "pretrain_gpt.py"

    @property
    def world(self) -> int:
        """Ranks of the run: every parallel dimension (TP is 1; EP folds over DP x CP)."""
        return self.cp * self.pp * self.dp

    @property
    def full_pattern(self) -> str:
        """``--hybrid-layer-pattern``: the pattern, then ``mtp_pattern`` once per MTP depth after "/"."""
        return self.pattern + "".join("/" + self.mtp_pattern for _ in range(self.mtp_layers))

    def describe(self) -> dict:
        return dataclasses.asdict(self) | {"script": self.script}


def megatron_lm_args(spec: RunSpec, *, data_dir: Optional[str] = None, one_gpu: bool = False) -> list[str]:
    """The script's command line for ``spec`` (its sizes: hidden, FFN 2 x hidden, GDN key / value heads and
    head dim, attention heads in groups; SwiGLU + RMSNorm as GDN needs, no dropout, bf16 or fp32; the
    byte-level text :mod:`.byte_text` built in ``data_dir``, or the SFT set :func:`write_sft_set` wrote there).

    ``one_gpu``: ranks share one GPU (gloo; TE attention's CP exchange through all-to-all)."""
    # query heads in groups: TE's all-to-all CP exchange (ranks sharing one GPU) splits the KV heads over
    # the CP ranks, so the groups must divide by CP (2 groups at CP=4 crash in TE's backend query, SIGFPE)
    heads = ["--num-attention-heads", str(spec.attention_heads[0]), "--num-query-groups", str(spec.attention_heads[1]),
             "--group-query-attention"]
    gdn = ["--linear-num-key-heads", str(spec.gdn_heads[0]), "--linear-num-value-heads", str(spec.gdn_heads[1]),
           "--linear-key-head-dim", str(spec.gdn_head_dim), "--linear-value-head-dim", str(spec.gdn_head_dim),
           "--linear-conv-kernel-dim", "4"]
    if spec.model == "hybrid":
        model = ["--spec", "megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec",
                 "--hybrid-layer-pattern", spec.full_pattern]
    else:
        freq = (f"([1]*{spec.gpt_layers})" if spec.gpt_attention_freq == 0 else str(spec.gpt_attention_freq))
        model = ["--num-layers", str(spec.gpt_layers), "--experimental-attention-variant", "gated_delta_net",
                 "--linear-attention-freq", freq]
    args = model + heads + gdn + [
        "--hidden-size", str(spec.hidden), "--ffn-hidden-size", str(2 * spec.hidden),
        "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear", "--position-embedding-type", "none",
        # no dropout: CP ranks draw their masks on other token sets than CP=1 does, which moves the loss
        # by ~1e-3 in stock Megatron-LM too (seen: CP=2 vs CP=1, stock and gdn-cp alike) and hides the match
        "--hidden-dropout", "0", "--attention-dropout", "0",
        "--untie-embeddings-and-output-weights",
        "--seq-length", str(spec.seq_length), "--max-position-embeddings", str(spec.seq_length),
        "--micro-batch-size", str(spec.micro_batch), "--global-batch-size", str(spec.global_batch),
        "--context-parallel-size", str(spec.cp),
        *PRECISIONS[spec.precision], "--lr", f"{spec.lr:g}", "--lr-decay-style", spec.lr_decay,
        *(["--min-lr", f"{spec.min_lr:g}"] if spec.lr_decay != "constant" else []),
        "--lr-warmup-iters", str(spec.lr_warmup),
        "--weight-decay", "0.01", "--clip-grad", "1.0",
        "--train-iters", str(spec.iterations), "--seed", str(spec.seed),
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
        "--log-interval", "1", "--eval-iters", "0", "--eval-interval", str(10 * spec.iterations),
        "--transformer-impl", "transformer_engine", "--no-create-attention-mask-in-dataloader",
        # the output layer's fused weight-gradient accumulation needs APEX's CUDA extension (not installed)
        "--no-gradient-accumulation-fusion",
    ]
    args += parallelism_args(spec)
    if spec.backend is not None:
        args += ["--linear-cp-backend", spec.backend]
    if spec.mode is not None:
        args += ["--linear-cp-mode", spec.mode]
    if one_gpu and spec.world > 1:
        args += ["--distributed-backend", "gloo", "--cp-comm-type", "a2a"]
    if data_dir is None:
        raise ValueError(f"RunSpec.data={spec.data!r} needs data_dir: the folder where byte_text.build wrote "
                         f"{PREFIX}.bin / .idx and write_sft_set wrote sft.jsonl")
    data = Path(data_dir)
    # each run its own index cache: Megatron writes its sample indices there, runs side by side would race
    cache = ["--data-cache-path", str(data / "cache" / spec.name)]
    if spec.data == "sft":
        # --calculate-per-token-loss: SFT loss masks differ between CP ranks; without it each rank averages
        # over its own tokens and the gradient is not CP=1's (validate_args refuses that, see thd_split)
        args += ["--sft", "--data-path", str(data / "sft.jsonl"), "--split", "100,0,0", *cache,
                 "--null-tokenizer-pad-id", str(PAD), "--calculate-per-token-loss"]
    else:
        args += ["--data-path", str(data / PREFIX), "--split", "100,0,0", *cache] + DATA_FLAGS[spec.data]
    return args + RECOMPUTE[spec.recompute] + list(spec.extra_args)


def parallelism_args(spec: RunSpec) -> list[str]:
    """The flags of ``spec``'s pipeline, expert, MTP and FP8 fields (none at their defaults)."""
    args = []
    if spec.pp > 1:
        args += ["--pipeline-model-parallel-size", str(spec.pp)]
    if spec.num_experts is not None:
        # top-2 routing over every expert of the layer, the alltoall dispatcher (Megatron refuses allgather with
        # variable sequence lengths, which pipeline stages of padded rows need) and TE's grouped GEMM
        args += ["--num-experts", str(spec.num_experts), "--moe-router-topk", "2", "--moe-ffn-hidden-size",
                 str(spec.hidden), "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm"]
    if spec.ep > 1:
        args += ["--expert-model-parallel-size", str(spec.ep)]
    if spec.mtp_layers:
        args += ["--mtp-num-layers", str(spec.mtp_layers)]
    if spec.fp8 is not None:
        args += ["--fp8-format", spec.fp8]
    if spec.fp8_recipe is not None:
        args += ["--fp8-recipe", spec.fp8_recipe]
    return args


def write_sft_set(path, *, text: bytes, rows: int = 64, seq_length: int = 2048, seed: int = 0) -> Path:
    """A JSONL SFT set for the stand-ins: ``rows`` lines, each a packed list of conversations
    (system, user, assistant; 2-5 of them, of 60-700 tokens) whose contents are consecutive slices of
    ``text`` as byte-level token ids (0..255; the pad id, :data:`PAD`, never occurs), written as
    space-separated ids. Lengths vary so that documents straddle CP ranks and need padding to 2*cp;
    every row leaves 64 tokens free, so no conversation is truncated at any CP size up to 8 (the same
    tokens train at CP=1 and CP > 1). Give ``rows`` >= iterations x global batch: SFTDataset repeats
    rows when it runs out. Returns the file."""
    if not text:
        raise ValueError("write_sft_set(text=b''): pass the text to cut the conversations from "
                         "(byte_text.corpus_text())")
    rng = random.Random(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    at = 0

    def ids(n):
        nonlocal at
        piece = [text[(at + i) % len(text)] for i in range(n)]  # wraps around the text's end
        at = (at + n) % len(text)
        return " ".join(map(str, piece))

    with path.open("w", encoding="utf-8") as f:
        for _ in range(rows):
            messages, budget = [], seq_length - 64  # slack: SFTDataset pads each conversation to 2*cp
            for _conv in range(rng.randint(2, 5)):
                n = min(budget, rng.randint(60, 700))
                if n < 12:
                    break
                a, b = rng.randint(1, n // 4), rng.randint(1, n // 3)
                messages += [{"role": "system", "content": ids(a)}, {"role": "user", "content": ids(b)},
                             {"role": "assistant", "content": ids(n - a - b)}]
                budget -= n
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


_ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+)\s*\|(.*)")
_FIELD = re.compile(r"(lm loss|grad norm|number of skipped iterations|number of nan iterations|"
                    r"elapsed time per iteration \(ms\)):\s*([-+0-9.eEnaif]+)")


def parse_training_log(text: str) -> dict:
    """``{"losses": [...], "grad_norms": [...], "iteration_ms": [...], "skipped": int, "nan": int}``
    from Megatron's training log lines (``iteration   3/  20 | ... | elapsed time per iteration (ms):
    900.1 | ... | lm loss: 7.9E+00 | ... | grad norm: 1.234 |``), one entry per iteration in order (a
    repeated iteration keeps its last line; a field a line lacks is None)."""
    per_iter: dict[int, dict] = {}
    for line in text.splitlines():
        m = _ITERATION.search(line)
        if not m:
            continue
        fields = {k: v for k, v in _FIELD.findall(m.group(3))}
        per_iter[int(m.group(1))] = fields
    out = {"losses": [], "grad_norms": [], "iteration_ms": [], "skipped": 0, "nan": 0}
    for it in sorted(per_iter):
        f = per_iter[it]
        out["losses"].append(float(f["lm loss"]) if "lm loss" in f else None)
        out["grad_norms"].append(float(f["grad norm"]) if "grad norm" in f else None)
        ms = f.get("elapsed time per iteration (ms)")
        out["iteration_ms"].append(float(ms) if ms is not None else None)
        out["skipped"] += int(float(f.get("number of skipped iterations", 0)))
        out["nan"] += int(float(f.get("number of nan iterations", 0)))
    return out


@dataclasses.dataclass
class RunResult:
    """What one run gave. ``status``: ``ok`` (every iteration logged a loss), ``refused`` (a rank
    stopped with an error before the first iteration), ``failed`` (after it), ``timeout``."""

    spec: RunSpec
    status: str
    losses: list
    grad_norms: list
    wall_s: float
    iteration_ms: list = dataclasses.field(default_factory=list)  # Megatron's "elapsed time per iteration"
    error: str = ""
    dist_backend: str = ""
    skipped: int = 0
    ended_after_failure_s: Optional[float] = None  # first rank failure seen -> every rank gone
    args: list = dataclasses.field(default_factory=list)  # the script's command line

    def to_json(self) -> dict:
        return {**self.spec.describe(), "args": self.args, "status": self.status, "losses": self.losses,
                "grad_norms": self.grad_norms, "iteration_ms": self.iteration_ms, "wall_s": round(self.wall_s, 1),
                "error": self.error,
                "dist_backend": self.dist_backend, "skipped_iterations": self.skipped}


def build_dataset_helpers(checkout, *, timeout_s: float = 600.0) -> None:
    """Compile Megatron's C++ dataset helpers in ``checkout`` (``make -C megatron/core/datasets``), once,
    before runs start side by side.

    Each Megatron-LM run compiles them on its rank 0 when they are missing (``_compile_dependencies``), so
    runs started together on a fresh checkout race to write the same ``helpers_cpp*.so`` (seen: ``file too
    short``, ``invalid ELF header``: the runs were reported as refused). ``make`` does nothing when the
    library is up to date. RuntimeError with make's output when it fails."""
    folder = Path(checkout) / "megatron" / "core" / "datasets"
    if not (folder / "Makefile").is_file():
        raise ValueError(f"checkout={str(checkout)!r} has no megatron/core/datasets/Makefile: pass a Megatron-LM checkout")
    done = subprocess.run(["make", "-C", str(folder)], capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"building Megatron's dataset helpers in {folder} failed (make exit code "
                           f"{done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no torch / no CUDA: no GPUs
        return 0


def _exit_words(code: Optional[int]) -> str:
    """`` (exit code 1)``, `` (killed by SIGSEGV)``: how a failed rank ended, for the run's error (a rank
    killed by a signal prints no Python exception; faulthandler, on in every rank, prints its stack)."""
    if code is None:
        return ""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f" (killed by {signal.Signals(-code).name})"
        return f" (killed by signal {-code})"
    return f" (exit code {code})"


_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b(:|$)")


def _error_tail(text: str, lines: int = 12) -> str:
    """The message of the last exception a rank printed (``ValueError: ...`` and the lines it
    continues on), without torchrun's ``[rankN]:`` prefixes; else the last ``lines`` lines."""
    keep = [_RANK_PREFIX.sub("", ln) for ln in text.splitlines() if ln.strip()]
    for i in range(len(keep) - 1, -1, -1):
        if _EXCEPTION_LINE.match(keep[i]):
            end = i + 1
            while end < len(keep) and not keep[end].startswith(("[", " ", "Warning", "W1", "I1")) and end - i < 6:
                end += 1  # a message that goes on over a few lines
            return "\n".join(keep[i:end])[-2000:]
    return "\n".join(keep[-lines:])[-2000:]


PORT_TAKEN = ("EADDRINUSE", "address already in use")
"""What a rank's log says when the rendezvous port it was given was taken before it listened (runs started
side by side pick free ports independently; seen 2026-12-03: a CP=4 run's rank 0 lost its port)."""


GIB_PER_RANK = 9.9
"""GPU memory one bf16 rank process of these runs may take, start-up and autotuning included: 14 ran side by side
on a 140.4 GiB H200 (runs 2026-12-03a to 2026-12-05j); 14 on an 79.6 GiB H100 ran out of memory in their first
step (run 2026-12-06c, the CUDA and NCCL allocations of every process; Megatron-LM's own report said 2.6 GiB
reserved per rank). fp32 rows take twice (16 on the H200 ran out of memory, 8 ran). Each call of
``benchmarks/train_megatron_lm.py`` records the GPU memory it saw used every ~5 s and at most (its JSON's
``gpu_memory``), to replace this figure with a measured one."""


def gib_per_rank(precision: str) -> float:
    """:data:`GIB_PER_RANK` for a run of ``precision`` (``RunSpec.precision``): twice that in fp32."""
    return GIB_PER_RANK * (2 if precision == "fp32" else 1)


def gpu_memory_mib(field: str) -> Optional[float]:
    """GPU 0's ``memory.total`` or ``memory.used`` in MiB from ``nvidia-smi`` (no CUDA context in this process:
    it would take memory from the ranks); None where there is no GPU."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu=memory.{field}", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        return float(out.split()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def launch(spec: RunSpec, *, checkout, log_dir, attempts: int = 3, **kwargs) -> RunResult:
    """:func:`launch_once`, started again on a new port (up to ``attempts`` times) when its rendezvous port
    was taken by another run before rank 0 listened: a collision between runs, not the run's outcome."""
    for attempt in range(attempts):
        result = launch_once(spec, checkout=checkout, log_dir=log_dir, **kwargs)
        if result.status == "ok" or result.losses or not any(m in result.error for m in PORT_TAKEN):
            return result
        logger.warning("%s: its rendezvous port was taken (attempt %d of %d): starting again on another port",
                       spec.name, attempt + 1, attempts)
    return result


def launch_once(spec: RunSpec, *, checkout, log_dir, data_dir=None, timeout_s: float = 600.0,
                gpus: Optional[int] = None, python: str = sys.executable, extra_env: Optional[dict] = None,
                failure_grace_s: float = 5.0) -> RunResult:
    """Run ``spec`` to the end (or its first failure) and return what it logged.

    One rank per GPU over NCCL when there are enough GPUs (``gpus``, default: what torch sees),
    else every rank on GPU 0 over gloo (see the module docstring). Each rank's output goes to
    ``log_dir/<name>.rank<r>.log``. A rank that exits non-zero ends the run: the others are killed
    after ``failure_grace_s``."""
    checkout, log_dir = Path(checkout), Path(log_dir)
    script = checkout / spec.script
    if not script.is_file():
        raise ValueError(f"checkout={str(checkout)!r} has no {spec.script}: pass a Megatron-LM checkout "
                         "(patched: `gdn-cp patch apply CHECKOUT`)")
    log_dir.mkdir(parents=True, exist_ok=True)
    gpus = _gpu_count() if gpus is None else gpus
    one_gpu = spec.world > max(gpus, 1)
    args = megatron_lm_args(spec, data_dir=data_dir, one_gpu=one_gpu)
    port = _free_port()
    procs, logs = [], []
    t0 = time.monotonic()
    for rank in range(spec.world):
        env = dict(os.environ)
        # one OpenMP thread per rank unless told otherwise, as torchrun does for several ranks on one machine
        # (runs side by side: 14 ranks x one thread per core would oversubscribe the cores many times over)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.update(extra_env or {})
        env.update(dict(spec.env))
        if spec.site is not None:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (spec.site, env.get("PYTHONPATH", "")) if p)
        env.update(RANK=str(rank), WORLD_SIZE=str(spec.world), LOCAL_RANK="0" if one_gpu else str(rank),
                   LOCAL_WORLD_SIZE="1" if one_gpu else str(spec.world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), CUDA_DEVICE_MAX_CONNECTIONS="1", PYTHONUNBUFFERED="1",
                   GDN_CP_MLM_ONE_GPU="1" if one_gpu else "0", PYTHONFAULTHANDLER="1",
                   PYTHONPATH=os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), _CLONE) if p))
        log = open(log_dir / f"{spec.name}.rank{rank}.log", "w", encoding="utf-8")
        logs.append(log)
        cmd = [python, "-m", "gdn_cp_testing.megatron.lm", "--checkout", str(checkout), "--script", spec.script,
               "--", *args]
        procs.append(subprocess.Popen(cmd, cwd=checkout, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    status, failed_rank, failed_at = None, None, None
    deadline = t0 + timeout_s
    while status is None:
        codes = [p.poll() for p in procs]
        bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            failed_rank, failed_at = bad[0], time.monotonic()
            grace = failed_at + failure_grace_s
            while time.monotonic() < grace and any(p.poll() is None for p in procs):
                time.sleep(0.2)
            status = "failed"
        elif all(c == 0 for c in codes):
            status = "ok"
        elif time.monotonic() > deadline:
            status = "timeout"
        else:
            time.sleep(0.5)
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    ended_after_failure = None if failed_at is None else time.monotonic() - failed_at
    for log in logs:
        log.close()
    wall = time.monotonic() - t0
    texts = [(log_dir / f"{spec.name}.rank{r}.log").read_text(encoding="utf-8", errors="replace")
             for r in range(spec.world)]
    # Megatron prints the iteration lines on the last rank (print_rank_last)
    parsed = parse_training_log(texts[-1])
    if status == "ok" and (len(parsed["losses"]) != spec.iterations or None in parsed["losses"]):
        status, failed_rank = "failed", spec.world - 1
    error = ""
    if status != "ok":
        rank = failed_rank if failed_rank is not None else spec.world - 1
        error = f"rank {rank}{_exit_words(procs[rank].returncode if failed_rank is not None else None)}: " + _error_tail(texts[rank])
        if status == "failed" and not parsed["losses"]:
            status = "refused"
    return RunResult(spec=spec, status=status, losses=parsed["losses"], grad_norms=parsed["grad_norms"], args=args,
                     iteration_ms=parsed["iteration_ms"],
                     wall_s=wall, error=error, dist_backend="gloo" if one_gpu and spec.world > 1 else "nccl",
                     skipped=parsed["skipped"], ended_after_failure_s=ended_after_failure)


# ------------------------------------------------------------------------------------------------
# Inside a rank process
# ------------------------------------------------------------------------------------------------

class _Issued:
    """What ``_coalescing_manager`` yields: the collectives inside were issued one by one and have
    completed (synchronous gloo), so waiting is a no-op."""

    def wait(self):
        return None


@contextlib.contextmanager
def _one_by_one(group=None, device=None, async_ops=False):
    if async_ops:
        raise RuntimeError("gdn_cp_testing.megatron.lm: overlapped grad reduction (async collectives inside "
                           "_coalescing_manager) is not supported on gloo ranks sharing one GPU; leave "
                           "--overlap-grad-reduce off")
    yield _Issued()


def _install_sft_stand_ins() -> None:
    """JSONL without HuggingFace ``datasets``; NullTokenizer conversations as token-id lists."""
    import numpy as np
    from megatron.core.tokenizers.text import text_tokenizer
    from megatron.training.datasets import sft_dataset

    def low_level_init(self, dataset_path: str) -> None:
        with open(dataset_path, encoding="utf-8") as f:
            self.dataset = [json.loads(line) for line in f if line.strip()]

    sft_dataset.SFTLowLevelDataset.__init__ = low_level_init
    original = text_tokenizer.MegatronTokenizerText.tokenize_conversation

    def tokenize_conversation(self, conversation, return_target, add_generation_prompt):
        if self.library != "null-text":
            return original(self, conversation, return_target, add_generation_prompt)
        tokens, targets = [], []
        for msg in conversation:
            ids = [int(x) for x in msg["content"].split()]
            tokens += ids
            targets += ids if msg["role"] == "assistant" else [sft_dataset.IGNORE_INDEX] * len(ids)
        tokens, targets = np.array(tokens, dtype=np.int64), np.array(targets, dtype=np.int64)
        return (tokens, targets) if return_target else tokens

    text_tokenizer.MegatronTokenizerText.tokenize_conversation = tokenize_conversation


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds no module itself: when ``name`` is imported, takes the spec the other finders give and
    runs ``patch(module)`` right after the module's own code, before anything can bind its names."""

    def __init__(self, name: str, patch):
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            self.patch(module)

        spec.loader.exec_module = exec_then_patch  # this module's own loader instance
        return spec


def when_imported(name: str, patch) -> None:
    """``patch(module)`` as soon as module ``name`` is imported (now, if it is): a shim that costs a
    rank no megatron import before its script imports megatron (a test's stand-in script never does)."""
    if name in sys.modules:
        patch(sys.modules[name])
    else:
        sys.meta_path.insert(0, _PatchOnImport(name, patch))


def install_rank_shims(argv: Sequence[str]) -> list[str]:
    """Install what this rank needs (module docstring); returns what was installed, for the log."""
    done = []
    from gdn_cp_testing.ranks import maybe_fast_autotune

    if maybe_fast_autotune():
        done.append("FLA autotune: first working config (GDN_CP_TEST_FAST_AUTOTUNE=1)")
    from gdn_cp_testing.env import read as env_setting

    if env_setting("GDN_CP_MLM_ONE_GPU") == "1":
        from gdn_cp_testing.ranks import adapt_fla_collectives_for_gloo

        from . import host_p2p

        when_imported("megatron.core.distributed.param_and_grad_buffer",
                      lambda buffers: setattr(buffers, "_coalescing_manager", _one_by_one))
        adapt_fla_collectives_for_gloo()
        host_p2p.install()
        done.append("ranks share one GPU: gloo, DDP bucket collectives one by one, FLA gathers viewed flat, "
                    "point-to-point transfers of CUDA tensors through the host")
    if env_setting("GDN_CP_MLM_GDN_CP_AT_CP1") == "1":
        from gdn_cp_testing.megatron.layer import dispatch_every_call

        when_imported("gdn_cp.megatron.gdn", dispatch_every_call)
        done.append("every GDN call through gdn-cp's path, CP=1 SBHD included (GDN_CP_MLM_GDN_CP_AT_CP1=1)")
    if "--sft" in argv:
        _install_sft_stand_ins()
        done.append("--sft: JSONL reader and token-id conversations (no HF datasets / chat tokenizer here)")
    return done


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m gdn_cp_testing.megatron.lm --checkout DIR --script pretrain_hybrid.py -- ARGS``:
    one rank of a run (``launch`` starts these)."""
    import argparse
    import runpy

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit("usage: python -m gdn_cp_testing.megatron.lm --checkout DIR --script NAME -- ARGS")
    cut = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m gdn_cp_testing.megatron.lm",
                                     description="One rank of a Megatron-LM training run (test-only launcher).")
    parser.add_argument("--checkout", required=True, help="a patched Megatron-LM checkout")
    parser.add_argument("--script", required=True, choices=SCRIPTS)
    ns = parser.parse_args(argv[:cut])
    script_args = argv[cut + 1 :]
    checkout = str(Path(ns.checkout).resolve())
    sys.path.insert(0, checkout)  # as `python pretrain_*.py` would: the checkout's megatron/ first
    for line in install_rank_shims(script_args):
        print(f"[gdn-cp launcher] {line}", flush=True)
    sys.argv = [str(Path(checkout) / ns.script), *script_args]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
