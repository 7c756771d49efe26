"""Pure helpers of ``layer_full.py``: its cases, packings and plan, and bytes per token from the CP
plan (how it measures is :mod:`benchmarks.measure`). No torch.distributed, no Megatron, no device
work: the main process uses them and the tests check them directly.

Words (see /work/shared/DESIGN.md): T is the global token count of one micro-batch, ``cu`` its
global padded boundaries (Python ints), T_local = T / cp the rows of one rank.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

from gdn_cp.layout import CONTIGUOUS, ZIGZAG, build_chunkwise_plan, build_sbhd_route, build_thd_route
from gdn_cp.ops.fused import GLUE_PATHS

from .measure import parse_tokens

__all__ = ["CASES", "CP1_CASES", "SLICE_CASES", "STOCK_CASES", "case_key", "LEVERS", "PACKINGS", "SPECS",
           "parse_plan", "GDNDims", "packing", "contiguous_slice", "rows_leaving", "bytes_per_token", "run_key"]

# The cases of one (T, packing) at CP >= 2, in the order they are reported.
CASES = ("stock_headwise", "headwise", "chunkwise_hidden", "chunkwise_core", "chunkwise_generic", "all_gather",
         "cp1_slice")
# ``--cp 1`` (one GPU, one process): per-rank work without communication. ``*_cp1`` run the whole
# packing, ``*_slice`` one contiguous slice of it per row (``--slice-of-cp N``: rank r's rows of a
# CP=N run, the ideal's per-rank work); ``stock_*`` run pristine megatron-core, ``patched_*`` gdn-cp's
# THD path at CP=1.
CP1_CASES = ("stock_cp1", "patched_cp1", "stock_slice", "patched_slice")
SLICE_CASES = ("stock_slice", "patched_slice")
STOCK_CASES = ("stock_headwise", "stock_cp1", "stock_slice")
PACKINGS = ("mixed8", "sbhd")
# Where the layer's submodules come from (``gdn_cp_testing.megatron.layer.SPECS``): ``local``
# (ColumnParallelLinear / torch RMSNorm / RowParallelLinear) or ``te`` (Megatron's own GDN spec:
# TransformerEngine's LayerNorm-fused in_proj, TENorm out_norm, TERowParallelLinear out_proj).
SPECS = ("local", "te")
# gdn-cp levers a patched row can run with switched off (benchmark-side, in the rank process; never
# a library flag), each beside the row with every lever on, in the same run, rows and weights:
# ``fused_norm``: the layer's own out_norm * act(z) instead of FLA's fused gated RMSNorm;
# ``glue_triton`` / ``glue_compiled`` / ``glue_unfused``: the glue path of that name (GDN_CP_GLUE) in place of the
# default (gdn_cp.ops.fused), so that every path is timed beside the default in the same run;
# ``split_cat``: in_proj's output gradient concatenated by torch.split's backward (gdn_cp.ops.fused.split);
# ``key_heads_by_backend``: glue.REPEAT_KEY_HEADS_IN_CONV off (runs 2026-12-06l/o's ``key_heads_in_conv`` rows: on);
# ``narrow_copy``: split.WIDE_COLUMN_COPY off, the groups' copies element by element (runs 2026-12-07d/e's ``wide_copy``: on);
# ``halo_apart``: triton_conv.HALO_ROWS_APART and SCAN_HALO_TAIL on: the halo read apart, forward and backward;
# ``scan_branch`` / ``scan_branch_ftz``: triton_conv.SCAN_BRANCH_MASKS on (the scan's masks by branches) / and FTZ_SIGMOID.
GLUE_LEVERS = {f"glue_{path}": path for path in GLUE_PATHS}
"""The levers that only pick the glue path (``glue_<path>`` -> path): a row of one is named by its path."""
LEVERS = ("fused_norm", *GLUE_LEVERS, "split_cat", "key_heads_by_backend", "narrow_copy", "halo_apart", "scan_branch",
          "scan_branch_ftz")

# mixed8: eight sequences of mixed lengths (fractions of T; long and short together).
_MIXED8 = (0.31, 0.04, 0.17, 0.09, 0.22, 0.02, 0.10, 0.05)


@dataclass(frozen=True)
class GDNDims:
    """The GDN layer shape on one TP rank (TP=1 here). Defaults: Qwen3.5-9B's GDN layers."""

    hidden: int = 4096
    num_k_heads: int = 16
    num_v_heads: int = 32
    head_k_dim: int = 128
    head_v_dim: int = 128
    conv_width: int = 4

    @property
    def conv_dim(self) -> int:  # q | k | v channels before the conv
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim


def run_key(row: dict) -> tuple:
    """Rows with the same run key describe the same measurement (the GPU, machine size, CP, T, dtype,
    shape, compile-only or timed, the CP size a ``--cp 1`` run slices for, the layer spec, the
    FLA version and gdn-cp's requested backend); a newer run replaces them. Rows from before ``spec``
    existed are ``local``, from before ``--backend`` existed ``auto``."""
    k = row.get("knobs", {})
    return (row.get("device"), (row.get("versions") or {}).get("gpu"), row.get("gpus"), row.get("cp"), row.get("tp"), row.get("T"), k.get("dtype"),
            tuple(sorted(k.get("dims", {}).items())), bool(k.get("compile_only")), k.get("slice_of_cp"),
            row.get("spec") or "local", (row.get("versions") or {}).get("fla"), k.get("linear_cp_backend") or "auto")


def case_key(row: dict) -> str:
    """The case name, with the slice's rank for ``*_slice`` rows (one row per rank), the spec when it
    is not ``local``, the lever switched off, if any, and gdn-cp's backend when one was named
    (``--backend``; gdn-cp's cases only): ``patched_slice[r1]``, ``patched_slice[r1]|te``,
    ``patched_slice[r1]|te|-fused_norm``, ``patched_slice[r1]|te|flashqla``."""
    rank = row.get("slice_rank")
    key = row["case"] if rank is None else f"{row['case']}[r{rank}]"
    if (row.get("spec") or "local") != "local":
        key += f"|{row['spec']}"
    if row.get("lever_off"):
        key += f"|-{row['lever_off']}"
    backend = (row.get("knobs") or {}).get("linear_cp_backend") or "auto"
    if backend != "auto" and row["case"] not in STOCK_CASES:
        key += f"|{backend}"
    return key


def parse_plan(text: str) -> list[tuple[str, str | None, int]]:
    """``--plan``: comma list of ``SPEC[-LEVER]:T`` units in run order -> ``[(spec, lever_off, T)]``.

    ``te:32K,te:128K,te-fused_norm:32K,local:128K``: Megatron's TE spec at 32K (stock and gdn-cp),
    then at 128K, then gdn-cp with the fused norm off at 32K, then the local spec at 128K. A unit
    with a lever runs only the patched cases (the lever is gdn-cp's)."""
    units = []
    for item in (t.strip() for t in str(text).split(",")):
        if not item:
            continue
        head, sep, tokens = item.partition(":")
        spec, _, lever = head.partition("-")
        if not sep or spec not in SPECS or (lever and lever not in LEVERS):
            raise ValueError(f"plan unit {item!r} must be SPEC[-LEVER]:T with SPEC in {SPECS} and LEVER in {LEVERS}, "
                             f"e.g. te:32K or te-fused_norm:128K")
        unit = (spec, lever or None, parse_tokens(tokens))
        if unit in units:
            raise ValueError(f"plan unit {item!r} is given twice")
        units.append(unit)
    if not units:
        raise ValueError(f"plan {text!r} names no unit")
    return units


def packing(name: str, t_global: int, align: int) -> tuple[str, list[int]]:
    """``(layout, cu)`` of a named packing of ``t_global`` tokens, every length a multiple of ``align``.

    - ``mixed8``: THD, 8 sequences of mixed lengths (31%, 4%, 17%, 9%, 22%, 2%, 10%, 5% of T;
      rounding goes to the longest);
    - ``sbhd``: SBHD, one sequence of T tokens (S = T, B = 1).

    ``align`` must be a multiple of 2*cp (Megatron's zigzag cut); 64 (FLA's chunk) by default.
    """
    if align < 1 or t_global % align:
        raise ValueError(f"T={t_global} must be a positive multiple of --align={align}; pick T or --align to fit")
    units = t_global // align
    if name == "sbhd":
        return "sbhd", [0, t_global]
    if name == "mixed8":
        lengths = [int(units * f) for f in _MIXED8]
        if min(lengths) < 1:
            raise ValueError(f"packing mixed8 needs T={t_global} >= {math.ceil(1 / min(_MIXED8))}*align "
                             f"(align={align}); use a larger T or a smaller --align")
        lengths[lengths.index(max(lengths))] += units - sum(lengths)
        return "thd", list(itertools.accumulate((n * align for n in lengths), initial=0))
    raise ValueError(f"packing must be one of {PACKINGS}, got {name!r}")


def contiguous_slice(cu: Sequence[int], cp: int, rank: int) -> list[int]:
    """Local boundaries of rank ``rank``'s contiguous rows ``[r*T/cp, (r+1)*T/cp)`` of ``cu``: the
    pieces of the sequences it overlaps (what chunkwise computes there, and what cp1_slice runs)."""
    part = cu[-1] // cp
    lo, hi = rank * part, (rank + 1) * part
    return [0] + sorted({c - lo for c in cu if lo < c < hi}) + [part]


# ---- bytes per token, from the plan ----

def rows_leaving(layout: str, cu: Sequence[int], cp: int, rank: int, source: str, target: str) -> int:
    """Rows of rank ``rank`` that a ``source -> target`` route sends to OTHER ranks (rows that
    stay on the rank are not counted)."""
    if layout == "sbhd":
        route = build_sbhd_route(cu[-1], 1, cp, rank, source, target)
    else:
        route = build_thd_route(list(cu), cp, rank, source, target)
    return sum(route.send_splits) - route.send_splits[rank]


def _exchange_bytes(path: str, cu: Sequence[int], cp: int, rank: int, dims: GDNDims, act_bytes: int) -> int:
    """chunkwise's halo and state exchange per fwd+bwd on ``rank`` (sizes of what each path sends).

    - ``generic`` (gdn-cp's own, gloo / reference): when some sequence crosses a rank boundary,
      all-gather of every rank's W-1 tail rows ``[W-1, C]`` (backward: reduce-scatter) and of one
      ``[Hv, Dk, Dk+Dv]`` fp32 state summary per rank (backward: reduce-scatter);
    - ``fla`` (FLA's cp_context, NCCL): the W-1 conv tail rows to the next rank (backward: to the
      previous one), and an all-gather of one ``[Hv, Dk, Dk+Dv]`` fp32 block per rank, forward and
      backward;
    - ``flashqla`` (FlashQLA's inter-card context for the scan, FLA's for the conv): the same conv
      tails, and one all-gather per direction of a block packed from ``[Hv, Dk, Dv]`` (forward: the
      last sequence's final state from zero; backward: the first one's state gradient) and ``[Hv, Dk,
      Dk]`` (its transition matrix), in the activations' dtype (``chunk/cp/preprocess.py``: ``pack_hm``).
    """
    state = dims.num_v_heads * dims.head_k_dim * (dims.head_k_dim + dims.head_v_dim) * 4
    tail = (dims.conv_width - 1) * dims.conv_dim * act_bytes
    if path == "fla":
        return tail * (rank < cp - 1) + tail * (rank > 0) + 2 * (cp - 1) * state
    if path == "flashqla":
        packed = dims.num_v_heads * dims.head_k_dim * (dims.head_k_dim + dims.head_v_dim) * act_bytes
        return tail * (rank < cp - 1) + tail * (rank > 0) + 2 * (cp - 1) * packed
    if path == "generic":
        if not build_chunkwise_plan(list(cu), cp, rank, dims.conv_width).any_straddle:
            return 0
        return 2 * (cp - 1) * tail + 2 * (cp - 1) * state
    raise ValueError(f"chunkwise exchange path must be 'generic', 'fla' or 'flashqla', got {path!r}")


def bytes_per_token(case: str, *, layout: str, cu: Sequence[int], cp: int, dims: GDNDims, act_bytes: int,
                    chunkwise_path: str = "generic") -> dict:
    """Bytes that leave each rank per forward+backward of one layer, divided by T_local.

    Counted from the plan (route send splits, all-to-all and all-gather sizes), never from
    send buffers: rows that stay on their rank are not counted. ``a`` = activation bytes, C =
    q|k|v channels, V = Hv*Dv, gates g|beta travel as fp32 (8*Hv bytes per token; at
    chunkwise's core swap g as fp32 and beta in the activation dtype, (4+a)*Hv):

    - stock_headwise: all-to-all of q|k|v|z|beta|alpha in ((C + V + 2Hv) a) and the normed
      output out (V a); (cp-1)/cp of each buffer leaves; backward the same;
    - headwise (gdn-cp): q|k|v (C a) and the gates in, the core output (V a) out; z stays;
    - all_gather: own q|k|v and gates to cp-1 peers; backward reduce-scatter sends (cp-1)/cp
      of the gathered buffer = the same bytes;
    - chunkwise_hidden, chunkwise_generic: hidden_states (H a) along zigzag->contiguous,
      out_proj's output back; backward the reverse; plus the halo/state exchange
      (:func:`_exchange_bytes`; chunkwise_generic always takes gdn-cp's own);
    - chunkwise_core: q|k|v + gates along zigzag->contiguous, the core output back; plus the
      exchange;
    - cp1_slice and every ``--cp 1`` case: nothing.

    Returns ``{"bytes_per_token": max over ranks, "bytes_per_token_mean", "per_rank", "exchange_per_rank"}``.
    """
    c, v, hv, h, a = dims.conv_dim, dims.value_dim, dims.num_v_heads, dims.hidden, act_bytes
    t_local = cu[-1] // cp
    gates = 8 * hv
    per_rank, exchange = [], []
    for r in range(cp):
        ex = 0
        if cp == 1 or case == "cp1_slice" or case in CP1_CASES:
            total = 0
        elif case == "stock_headwise":
            total = 2 * (cp - 1) * t_local * ((c + v + 2 * hv) * a + v * a) // cp
        elif case == "headwise":
            total = 2 * (cp - 1) * t_local * ((c + v) * a + gates) // cp
        elif case == "all_gather":
            total = 2 * (cp - 1) * t_local * (c * a + gates)
        elif case in ("chunkwise_hidden", "chunkwise_core", "chunkwise_generic"):
            moved = rows_leaving(layout, cu, cp, r, ZIGZAG, CONTIGUOUS) + rows_leaving(layout, cu, cp, r, CONTIGUOUS, ZIGZAG)
            per_row = (c + v) * a + (4 + a) * hv if case == "chunkwise_core" else 2 * h * a
            ex = _exchange_bytes(chunkwise_path, cu, cp, r, dims, a)
            total = moved * per_row + ex
        else:
            raise ValueError(f"case must be one of {CASES + CP1_CASES}, got {case!r}")
        per_rank.append(total / t_local)
        exchange.append(ex / t_local)
    return {
        "bytes_per_token": max(per_rank),
        "bytes_per_token_mean": sum(per_rank) / cp,
        "per_rank": per_rank,
        "exchange_per_rank": exchange,
        "chunkwise_exchange_path": chunkwise_path if case.startswith("chunkwise") else None,
    }
