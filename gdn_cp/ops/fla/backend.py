"""FLA (flash-linear-attention) backend: CUDA kernels behind the reference backend's interface.

Tensors are THD packed without a batch dimension (token first). FLA wants ``[1, T, ...]`` and
``cu_seqlens`` as a device tensor; both are built here from the caller's Python ints, once per
distinct boundary list (a small cache of device copies, filled with non-blocking host->device
copies), so no call ever reads device data back to the host.

Feature detection instead of a version pin: :func:`fla_available`, :func:`fla_version`,
:func:`has_cp_context`, :func:`has_zigzag_layout`. FLA itself is imported lazily (importing it
touches CUDA), so importing this module is safe on a CPU-only machine.

What was tested where is in ``docs/gpu-results.md``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ...layout.device import host_to_device

__all__ = [
    "FLA_MAX_HEAD_K_DIM",
    "FLA_MIN_HEAD_DIM",
    "causal_conv1d",
    "check_chunkwise_layout",
    "chunk_gated_delta_rule",
    "chunkwise_core",
    "fla_available",
    "fla_version",
    "has_cp_context",
    "has_zigzag_layout",
]

# chunk_gated_delta_rule_fwd_h asserts K <= 256 (FLA 0.4.2 .. 0.6); tl.dot needs every block dim >= 16.
FLA_MAX_HEAD_K_DIM = 256
FLA_MIN_HEAD_DIM = 16

_CACHE_KEY = "fla_cp_context"


# --------------------------------------------------------------------------------------------
# feature detection
# --------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def fla_version() -> str | None:
    """Installed FLA version string (from package metadata; FLA is not imported), or None."""
    for dist in ("fla-core", "flash-linear-attention"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    if importlib.util.find_spec("fla") is None:
        return None
    try:  # a source checkout on sys.path without metadata
        return str(getattr(_import_fla(), "__version__", "unknown"))
    except Exception:  # noqa: BLE001 - detection must never raise
        return None


@functools.lru_cache(maxsize=1)
def _import_fla():
    return importlib.import_module("fla")


@functools.lru_cache(maxsize=1)
def _fla_import_error() -> str | None:
    if importlib.util.find_spec("fla") is None:
        return "the package 'fla' is not installed (pip install flash-linear-attention)"
    try:
        _import_fla()
        importlib.import_module("fla.ops.gated_delta_rule")
        importlib.import_module("fla.modules.convolution")
    except Exception as exc:  # noqa: BLE001 - FLA raises many kinds at import (Triton, CUDA)
        return f"importing fla failed: {type(exc).__name__}: {exc}"
    return None


def fla_available() -> bool:
    """True when FLA's GDN kernels and causal conv import (they need CUDA and a Triton FLA accepts)."""
    return _fla_import_error() is None


def _require_fla() -> None:
    err = _fla_import_error()
    if err is not None:
        raise RuntimeError(
            f"FLA backend unavailable: {err}. Fix: install flash-linear-attention (>= 0.4.2) with a "
            "Triton it supports on a CUDA machine, or use gdn_cp.ops.reference."
        )


@functools.lru_cache(maxsize=1)
def _fla_api() -> dict[str, Any]:
    _require_fla()
    gdr = importlib.import_module("fla.ops.gated_delta_rule")
    conv = importlib.import_module("fla.modules.convolution")
    api: dict[str, Any] = {
        "chunk_gated_delta_rule": gdr.chunk_gated_delta_rule,
        "causal_conv1d": conv.causal_conv1d,
    }
    try:
        cp = importlib.import_module("fla.ops.cp")
        api["build_cp_context"] = cp.build_cp_context
    except Exception:  # noqa: BLE001
        api["build_cp_context"] = None
    return api


def _params(fn) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def has_cp_context() -> bool:
    """True when FLA has ``fla.ops.cp.build_cp_context`` and both kernels take ``cp_context``."""
    if not fla_available():
        return False
    api = _fla_api()
    if api["build_cp_context"] is None:
        return False
    return ("cp_context" in _params(api["chunk_gated_delta_rule"])
            and "cp_context" in _params(api["causal_conv1d"]))


def native_cp_available(group) -> bool:
    """Whether :func:`chunkwise_core` (FLA's cp_context) can run on ``group``.

    FLA's context exchanges halos and states with ``all_gather_into_tensor`` into a
    ``[world, n, ...]`` output, which NCCL takes and gloo rejects; on a gloo group (several
    ranks on one GPU) the chunkwise mode exchanges them itself and runs FLA's kernels per rank.
    """
    if group is None or not has_cp_context():
        return False
    return torch.distributed.get_backend(group) == "nccl"


def has_zigzag_layout() -> bool:
    """True when ``build_cp_context`` takes ``layout=`` (FLA >= 0.6: layout="zigzag")."""
    return has_cp_context() and "layout" in _params(_fla_api()["build_cp_context"])


def _build_cp_context_kwargs(conv_kernel_size: int, cu_cpu: torch.Tensor, layout: str) -> dict[str, Any]:
    params = _params(_fla_api()["build_cp_context"])
    kwargs: dict[str, Any] = {}
    # The kernel-size argument was named conv1d_kernel_size (0.4.x) and kernel_size (some later trees).
    if "conv1d_kernel_size" in params:
        kwargs["conv1d_kernel_size"] = conv_kernel_size
    elif "kernel_size" in params:
        kwargs["kernel_size"] = conv_kernel_size
    else:
        raise RuntimeError("fla.ops.cp.build_cp_context takes no conv kernel size argument; "
                           "this FLA version is not supported by gdn_cp's chunkwise FLA path")
    if "cu_seqlens_cpu" in params:
        kwargs["cu_seqlens_cpu"] = cu_cpu
    if layout != "contiguous":
        kwargs["layout"] = layout
    return kwargs


# --------------------------------------------------------------------------------------------
# boundaries: validation and device copies (never read back from the device)
# --------------------------------------------------------------------------------------------

def _check_cu_seqlens(cu_seqlens: Sequence[int] | None, total: int, field: str = "cu_seqlens") -> list[int]:
    if cu_seqlens is None:
        return [0, total]
    if isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(
            f"{field} must be a list of Python ints (got a torch.Tensor on {cu_seqlens.device}); "
            "reading device boundaries would synchronize. Fix: pass the boundaries the route cache "
            "holds on the CPU (e.g. cu.tolist() once per micro-batch, outside the layer call)."
        )
    try:
        cu = [int(c) for c in cu_seqlens]
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{field} must be a sequence of ints, got {type(cu_seqlens).__name__}") from exc
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != total:
        raise ValueError(
            f"{field}={_short(cu)} must start at 0 and end at the number of rows ({total}). "
            f"Fix: pass the boundaries of exactly the rows given (local boundaries 0..{total})."
        )
    for i in range(len(cu) - 1):
        if cu[i + 1] < cu[i]:
            raise ValueError(
                f"{field} decreases at index {i + 1} ({cu[i]} -> {cu[i + 1]}): {_short(cu)}. "
                "Fix: boundaries must be non-decreasing cumulative lengths."
            )
    return cu


def _short(cu: Sequence[int], n: int = 12) -> str:
    cu = list(cu)
    return str(cu) if len(cu) <= n else f"[{', '.join(map(str, cu[:n]))}, ... ({len(cu)} entries)]"


def _nonempty(cu: list[int]) -> tuple[list[int], list[int]]:
    """Boundaries without empty segments, and the indices of the non-empty segments."""
    keep = [i for i in range(len(cu) - 1) if cu[i + 1] > cu[i]]
    return [0] + [cu[i + 1] for i in keep], keep


_DEVICE_CU: "OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]]" = OrderedDict()
_DEVICE_CU_MAX = 32


def _cu_tensors(cu: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cpu int64, device int64) copies of ``cu``; the device copy is non-blocking and cached.

    Reusing one device tensor per boundary list also lets FLA's identity-keyed caches
    (``prepare_chunk_indices``) hit across layers.
    """
    key = (tuple(cu), str(device))
    hit = _DEVICE_CU.get(key)
    if hit is not None:
        _DEVICE_CU.move_to_end(key)
        return hit
    cpu = torch.tensor(cu, dtype=torch.long)
    dev = host_to_device(cpu, device)
    _DEVICE_CU[key] = (cpu, dev)
    while len(_DEVICE_CU) > _DEVICE_CU_MAX:
        _DEVICE_CU.popitem(last=False)
    return cpu, dev


def _require_cuda(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cuda":
        raise ValueError(
            f"{name} is on {t.device}; the FLA backend runs Triton kernels on CUDA tensors only. "
            "Fix: move the inputs to a CUDA device, or use gdn_cp.ops.reference on the CPU."
        )


def _check_head_dims(head_k_dim: int, head_v_dim: int) -> None:
    if not (FLA_MIN_HEAD_DIM <= head_k_dim <= FLA_MAX_HEAD_K_DIM):
        raise ValueError(
            f"head_k_dim={head_k_dim} is outside what FLA's GDN kernels support "
            f"[{FLA_MIN_HEAD_DIM}, {FLA_MAX_HEAD_K_DIM}]. Fix: use a key head dim in that range, "
            "or the reference backend."
        )
    if head_v_dim < FLA_MIN_HEAD_DIM:
        raise ValueError(
            f"head_v_dim={head_v_dim} is below FLA's minimum {FLA_MIN_HEAD_DIM}. Fix: use a value head "
            "dim >= 16, or the reference backend."
        )


def _group_ratio(num_k_heads: int, num_v_heads: int) -> int:
    if num_k_heads <= 0 or num_v_heads <= 0 or num_v_heads % num_k_heads != 0:
        raise ValueError(
            f"num_v_heads={num_v_heads} must be a positive multiple of num_k_heads={num_k_heads} "
            "(value head h uses key head h // (num_v_heads // num_k_heads)). Fix: choose head counts "
            "that divide."
        )
    return num_v_heads // num_k_heads


def _expand_kv_groups(x: torch.Tensor, ratio: int) -> torch.Tensor:
    # [T, Hk, D] -> [T, Hv, D]; value head h reads key head h // ratio. FLA 0.4.2's GDN kernels
    # take one head count for q/k/v, so grouped heads are expanded here (autograd sums the copies).
    return x if ratio == 1 else x.repeat_interleave(ratio, dim=1)


# --------------------------------------------------------------------------------------------
# CP=1 ops: the reference backend's interface
# --------------------------------------------------------------------------------------------

def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    cu_seqlens: Sequence[int] | None = None,
    halo: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Depthwise causal conv over packed THD rows, restarting at every boundary.

    x [T, C], weight [C, W], bias [C] or None; ``halo`` [W-1, C] holds the W-1 rows that precede
    row 0 and belong to the segment that starts at row 0 (zeros where there is no such row).
    Returns [T, C] in x's dtype (SiLU applied when ``activation`` is "silu"/"swish").
    """
    _require_cuda("x", x)
    if x.dim() != 2:
        raise ValueError(f"x must be [T, C] (THD, no batch dim); got shape {tuple(x.shape)}. "
                         "Fix: flatten the batch into the token dim and pass cu_seqlens.")
    T, C = x.shape
    if weight.dim() != 2 or weight.shape[0] != C:
        raise ValueError(f"weight must be [C={C}, W]; got shape {tuple(weight.shape)}. "
                         "Fix: squeeze nn.Conv1d's [C, 1, W] weight to [C, W].")
    W = weight.shape[1]
    if bias is not None and tuple(bias.shape) != (C,):
        raise ValueError(f"bias must be [C={C}]; got shape {tuple(bias.shape)}")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation={activation!r} is not supported; use 'silu' or None")
    if halo is not None and tuple(halo.shape) != (W - 1, C):
        raise ValueError(f"halo must be [W-1={W - 1}, C={C}]; got shape {tuple(halo.shape)}. "
                         "Fix: pass the W-1 rows preceding row 0 (zeros where absent).")
    cu = _check_cu_seqlens(cu_seqlens, T)
    if T == 0:
        return x.new_empty(0, C)
    cu_ne, _ = _nonempty(cu)
    cu_cpu, cu_dev = _cu_tensors(cu_ne, x.device)
    n = len(cu_ne) - 1

    initial_state = None
    if halo is not None and W > 1:
        # FLA's conv state is [N, C, W]; column W-1 is the row just before the segment start and
        # column 0 is never read. Only the segment starting at row 0 continues from the halo.
        first = torch.cat([halo.new_zeros(C, 1), halo.to(x.dtype).t()], dim=1).unsqueeze(0)
        if n > 1:
            first = torch.cat([first, first.new_zeros(n - 1, C, W)], dim=0)
        initial_state = first.contiguous()

    y, _ = _fla_api()["causal_conv1d"](
        x=x.unsqueeze(0),
        weight=weight,
        bias=bias,
        initial_state=initial_state,
        output_final_state=False,
        activation=activation,
        cu_seqlens=cu_dev,
        cu_seqlens_cpu=cu_cpu,
    )
    return y.squeeze(0)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    cu_seqlens: Sequence[int] | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule over packed THD rows, the state restarting at every boundary.

    q, k [T, Hk, Dk]; v [T, Hv, Dv]; g [T, Hv] log-decay (computed in fp32); beta [T, Hv];
    initial_state [N, Hv, Dk, Dv] (N = len(cu_seqlens) - 1, empty segments included).
    Returns (o [T, Hv, Dv] in v's dtype, final_state [N, Hv, Dk, Dv] fp32 or None).
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _require_cuda(name, t)
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [T, Hk, Dk]; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"v must be [T={q.shape[0]}, Hv, Dv]; got {tuple(v.shape)}")
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    ratio = _group_ratio(Hk, Hv)
    _check_head_dims(Dk, Dv)
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (T, Hv):
            raise ValueError(f"{name} must be [T={T}, Hv={Hv}]; got {tuple(t.shape)}")
    cu = _check_cu_seqlens(cu_seqlens, T)
    n_all = len(cu) - 1
    if initial_state is not None and tuple(initial_state.shape) != (n_all, Hv, Dk, Dv):
        raise ValueError(
            f"initial_state must be [N={n_all}, Hv={Hv}, Dk={Dk}, Dv={Dv}] (one state per segment of "
            f"cu_seqlens, empty ones included); got {tuple(initial_state.shape)}"
        )
    cu_ne, keep = _nonempty(cu)
    n = len(keep)

    if n == 0:  # no rows at all
        o = v.new_empty(0, Hv, Dv)
        if not output_final_state:
            return o, None
        fs = (initial_state.float() if initial_state is not None
              else v.new_zeros(n_all, Hv, Dk, Dv, dtype=torch.float32))
        return o, fs

    h0 = None
    if initial_state is not None:
        h0 = initial_state.float()
        if n != n_all:
            h0 = torch.stack([h0[i] for i in keep], dim=0)
        h0 = h0.contiguous()

    cu_cpu, cu_dev = _cu_tensors(cu_ne, q.device)
    o, fs = _fla_api()["chunk_gated_delta_rule"](
        q=_expand_kv_groups(q, ratio).unsqueeze(0),
        k=_expand_kv_groups(k, ratio).unsqueeze(0),
        v=v.unsqueeze(0),
        g=g.float().unsqueeze(0),
        beta=beta.unsqueeze(0),
        scale=scale,
        initial_state=h0,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
        cu_seqlens=cu_dev,
        cu_seqlens_cpu=cu_cpu,
    )
    o = o.squeeze(0)
    if not output_final_state:
        return o, None
    if n != n_all:  # empty segments pass their state through unchanged
        pos = {seg: j for j, seg in enumerate(keep)}
        rows = []
        for i in range(n_all):
            if i in pos:
                rows.append(fs[pos[i]])
            elif initial_state is not None:
                rows.append(initial_state[i].float())
            else:
                rows.append(fs.new_zeros(Hv, Dk, Dv))
        fs = torch.stack(rows, dim=0)
    return o, fs


# --------------------------------------------------------------------------------------------
# chunkwise mode: FLA's native context parallelism on a contiguous partition
# --------------------------------------------------------------------------------------------

def check_chunkwise_layout(
    cu_seqlens_global: Sequence[int],
    cp_size: int,
    conv_kernel_size: int,
    *,
    local_rows: int | None = None,
    allow_short_tails: bool = True,
    layout: str = "contiguous",
) -> list[int]:
    """Validate global packed boundaries for FLA's contiguous CP partition (pure Python, no comm).

    Checks: boundaries well formed; T_global % cp == 0 (FLA floor-divides silently otherwise);
    ``local_rows`` == T_global / cp; every rank holds >= W-1 rows (FLA exchanges the last W-1 rows
    of a rank as the next rank's conv halo); with ``allow_short_tails=False`` also that every
    sequence continuing onto the next rank has >= W-1 rows on this rank. Returns the boundaries.
    """
    if isinstance(cu_seqlens_global, torch.Tensor):
        raise TypeError("cu_seqlens_global must be a list of Python ints, not a tensor (it would be read "
                        "back from the device). Fix: pass the CPU boundaries of the route cache.")
    cu_list = [int(c) for c in cu_seqlens_global]
    total = cu_list[-1] if cu_list else 0
    cu = _check_cu_seqlens(cu_list, total, field="cu_seqlens_global")
    if cp_size < 1:
        raise ValueError(f"cp size {cp_size} must be >= 1")
    if layout not in ("contiguous", "zigzag"):
        raise ValueError(f"layout={layout!r}: use 'contiguous' or 'zigzag'")
    parts = cp_size if layout == "contiguous" else 2 * cp_size
    if total % parts != 0:
        raise ValueError(
            f"cu_seqlens_global: T_global={total} is not divisible by {parts} "
            f"({'cp' if layout == 'contiguous' else '2*cp'}={parts}); FLA would silently drop "
            f"{total % parts} rows. Fix: pad the packed batch to a multiple of {parts} rows."
        )
    part = total // cp_size
    if local_rows is not None and local_rows != part:
        raise ValueError(
            f"this rank holds {local_rows} rows but cu_seqlens_global ends at {total}, i.e. "
            f"{part} rows per rank at cp={cp_size}. Fix: pass this rank's contiguous slice "
            f"[r*{part}, (r+1)*{part}) and the global (padded) boundaries."
        )
    W1 = conv_kernel_size - 1
    if cp_size > 1 and layout == "contiguous":
        if part < W1:
            raise ValueError(
                f"each rank holds {part} rows (T_global={total} / cp={cp_size}) but the conv halo needs "
                f"W-1={W1} rows from the previous rank. Fix: use more tokens per rank or a smaller cp."
            )
        if not allow_short_tails:
            for i in range(len(cu) - 1):
                s, e = cu[i], cu[i + 1]
                for r in range(cp_size - 1):
                    b = (r + 1) * part
                    if s < b < e and b - max(s, r * part) < W1:
                        raise ValueError(
                            f"sequence {i} (rows [{s}, {e}) of cu_seqlens_global) has only "
                            f"{b - max(s, r * part)} rows on rank {r} and continues onto rank {r + 1}; "
                            f"the conv halo needs W-1={W1}. Fix: pad or re-pack so that no sequence "
                            f"starts within the last {W1 - 1} rows of a rank, or use a FLA whose CP "
                            "context clamps the halo (pre_num_conv_tokens)."
                        )
    return cu


@dataclass
class _CPContextEntry:
    device_cu: torch.Tensor | None
    device_cu_version: int
    cu: tuple[int, ...]
    cp_size: int
    cp_rank: int
    conv_kernel_size: int
    group: Any
    layout: str
    ctx: Any


def _fla_context_clamps_halo() -> bool:
    try:
        ctx_mod = importlib.import_module("fla.ops.cp.context")
        fields = getattr(ctx_mod.FLACPContext, "__dataclass_fields__", {})
        return "pre_num_conv_tokens" in fields
    except Exception:  # noqa: BLE001
        return False


def _get_cp_context(cache: dict | None, *, cu: list[int], device_cu: torch.Tensor | None,
                    device: torch.device, group, cp_size: int, cp_rank: int, conv_kernel_size: int,
                    layout: str):
    if cache is not None:
        e = cache.get(_CACHE_KEY)
        if (isinstance(e, _CPContextEntry) and e.device_cu is device_cu
                and (device_cu is None or e.device_cu_version == device_cu._version)
                and e.cu == tuple(cu) and e.cp_size == cp_size and e.cp_rank == cp_rank
                and e.conv_kernel_size == conv_kernel_size and e.group is group and e.layout == layout):
            return e.ctx
    cu_ne, _ = _nonempty(cu)  # empty segments hold no rows; FLA's context never sees them
    if device_cu is not None and len(cu_ne) == len(cu):
        if device_cu.device != device:
            raise ValueError(f"cu_seqlens_global_device is on {device_cu.device} but qkv is on {device}; "
                             "pass the boundaries on qkv's device, or None")
        dev = device_cu
        cpu = torch.tensor(cu_ne, dtype=torch.long)
    else:
        cpu, dev = _cu_tensors(cu_ne, device)
        cpu = cpu.clone()  # FLA keys its own cache on identity; give each build a fresh CPU tensor
    ctx = _fla_api()["build_cp_context"](dev, group, **_build_cp_context_kwargs(conv_kernel_size, cpu, layout))
    if cache is not None:
        cache[_CACHE_KEY] = _CPContextEntry(
            device_cu=device_cu, device_cu_version=(device_cu._version if device_cu is not None else 0),
            cu=tuple(cu), cp_size=cp_size, cp_rank=cp_rank, conv_kernel_size=conv_kernel_size,
            group=group, layout=layout, ctx=ctx)
    return ctx


def chunkwise_core(
    qkv: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    *,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    group,
    cu_seqlens_global: Sequence[int],
    cu_seqlens_global_device: torch.Tensor | None = None,
    cache: dict | None = None,
    scale: float | None = None,
    layout: str = "contiguous",
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """Conv (SiLU) + gated delta rule on this rank's contiguous slice, with FLA's native CP.

    qkv [T_c, C] holds channels [q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)] before the conv; g, beta
    [T_c, Hv]; conv_weight [C, W]. Rank r holds global packed rows [r*T/cp, (r+1)*T/cp) (sequences
    may straddle ranks). The FLA CP context is built from the CPU boundaries (no device sync) and
    kept in ``cache`` (keyed by the device boundary tensor's identity and version, the boundaries,
    cp size/rank, W and the group). Everything is validated before the first collective.
    ``layout="zigzag"`` needs FLA's zigzag CP context (:func:`has_zigzag_layout`).
    Returns o [T_c, Hv, Dv].
    """
    for name, t in (("qkv", qkv), ("g", g), ("beta", beta), ("conv_weight", conv_weight)):
        _require_cuda(name, t)
    if qkv.dim() != 2:
        raise ValueError(f"qkv must be [T_c, C] (THD, batch folded into tokens, B == 1); got {tuple(qkv.shape)}")
    Hk, Hv, Dk, Dv = int(num_k_heads), int(num_v_heads), int(head_k_dim), int(head_v_dim)
    ratio = _group_ratio(Hk, Hv)
    _check_head_dims(Dk, Dv)
    T_c, C = qkv.shape
    if C != 2 * Hk * Dk + Hv * Dv:
        raise ValueError(
            f"qkv has {C} channels but [q|k|v] needs 2*{Hk}*{Dk} + {Hv}*{Dv} = {2 * Hk * Dk + Hv * Dv}. "
            "Fix: pass num_k_heads/num_v_heads/head dims of this (TP-local) layer."
        )
    if conv_weight.dim() != 2 or conv_weight.shape[0] != C:
        raise ValueError(f"conv_weight must be [C={C}, W]; got {tuple(conv_weight.shape)}")
    W = conv_weight.shape[1]
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (T_c, Hv):
            raise ValueError(f"{name} must be [T_c={T_c}, Hv={Hv}]; got {tuple(t.shape)}")

    cp_size = 1 if group is None else torch.distributed.get_world_size(group)
    if layout == "zigzag" and cp_size > 1 and not has_zigzag_layout():
        raise ValueError(
            f"layout='zigzag' needs FLA's zigzag CP context (FLA >= 0.6); installed FLA is {fla_version()}. "
            "Fix: upgrade flash-linear-attention, or use layout='contiguous' (route all-to-all)."
        )
    cu = check_chunkwise_layout(
        cu_seqlens_global, cp_size, W, local_rows=T_c,
        allow_short_tails=_fla_context_clamps_halo() if cp_size > 1 else True, layout=layout)

    conv_b = conv_bias
    if cp_size == 1:
        x = causal_conv1d(qkv, conv_weight, conv_b, cu_seqlens=cu, activation="silu")
        q, k, v = torch.split(x, [Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
        o, _ = chunk_gated_delta_rule(
            q.reshape(T_c, Hk, Dk), k.reshape(T_c, Hk, Dk), v.reshape(T_c, Hv, Dv), g, beta,
            cu_seqlens=cu, scale=scale, use_qk_l2norm=use_qk_l2norm)
        return o

    if not has_cp_context():
        raise RuntimeError(
            f"FLA {fla_version()} has no cp_context support (fla.ops.cp.build_cp_context). Fix: install "
            "flash-linear-attention >= 0.4.2, or use the headwise / all_gather modes."
        )
    cp_rank = torch.distributed.get_rank(group)
    ctx = _get_cp_context(cache, cu=cu, device_cu=cu_seqlens_global_device, device=qkv.device,
                          group=group, cp_size=cp_size, cp_rank=cp_rank, conv_kernel_size=W, layout=layout)
    api = _fla_api()
    x, _ = api["causal_conv1d"](
        x=qkv.unsqueeze(0), weight=conv_weight, bias=conv_b, activation="silu", cp_context=ctx)
    x = x.squeeze(0)
    q, k, v = torch.split(x, [Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
    q = _expand_kv_groups(q.reshape(T_c, Hk, Dk), ratio)
    k = _expand_kv_groups(k.reshape(T_c, Hk, Dk), ratio)
    o, _ = api["chunk_gated_delta_rule"](
        q=q.unsqueeze(0), k=k.unsqueeze(0), v=v.reshape(T_c, Hv, Dv).unsqueeze(0),
        g=g.float().unsqueeze(0), beta=beta.unsqueeze(0), scale=scale,
        use_qk_l2norm_in_kernel=use_qk_l2norm, cp_context=ctx)
    return o.squeeze(0)
