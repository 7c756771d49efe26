""":func:`gdn_core`, the one entry point of the modes: checks, then the core the mode chose for the call."""

from __future__ import annotations

import torch

from ..comm import all_ranks_true, group_size
from ..layout import ZIGZAG
from ..layout.plan import CPPlan
from ..ops.contract import Backend, check_backend
from ..ops.gates import check_log_decay, log_decay_ok
from ..ops.shape import GDNShape
from .call import ModeCall
from .common import check_inputs, local_core
from .spec import MODES, ModeSpec, get_mode

__all__ = ["gdn_core"]


def _check_layout(spec: ModeSpec, layout: str) -> None:
    if layout not in spec.layouts:
        takers = " or ".join(s.name for s in MODES.values() if layout in s.layouts) or "no mode"
        raise ValueError(
            f"layout={layout!r} with mode={spec.name!r}: only {takers} takes {layout} rows; pass zigzag rows"
        )


def _check_heads(spec: ModeSpec, shape: GDNShape, cp: int) -> None:
    """The registry's head rule for this CP group (``shape`` is one TP rank's: TP is divided out)."""
    divisor = spec.head_divisor(1, cp)
    for name, heads in (("num_k_heads", shape.num_k_heads), ("num_v_heads", shape.num_v_heads)):
        if heads % divisor:
            others = " or ".join(repr(s.name) for s in MODES.values() if not s.divides_by_cp)
            raise ValueError(
                f"linear_cp_mode={spec.name!r} needs {name} divisible by cp, got {name}={heads}, cp={cp}; "
                f"use linear_cp_mode={others} (they need heads divisible by TP only)"
            )


def _check_log_decay_on_every_rank(g: torch.Tensor, group) -> None:
    """Refuse a bad log decay on every rank of the group together, before any data moves.

    ``g`` holds this rank's rows, so one rank may see a bad value the others do not; if it raised
    alone, the others would wait in the first collective. The ranks agree first (one int
    all-reduce). Only for host (CPU) values: reading a device ``g`` would synchronize, and the
    layer never does (see :mod:`gdn_cp.ops.gates`).
    """
    if g.device.type != "cpu":
        return
    ok = log_decay_ok(g)
    if all_ranks_true(ok, group):
        return
    if not ok:
        check_log_decay(g)  # this rank's own message, naming the entry
    raise ValueError(
        "g (log decay) of another rank of this CP group is not finite and <= 0 (that rank names the entry); "
        "every rank stops before any collective"
    )


def gdn_core(
    qkv: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    *,
    shape: GDNShape,
    mode: str,
    plan: CPPlan,
    group,
    backend: Backend,
    layout: str = ZIGZAG,
    call: ModeCall | None = None,
) -> torch.Tensor:
    """GDN core (conv + SiLU + gated delta rule) under context parallelism.

    qkv ``[T_local, C]`` pre-conv, g ``[T_local, Hv]`` fp32 log decay, beta ``[T_local, Hv]``,
    all rank-local rows in zigzag layout for ``plan`` (THD; SBHD via :func:`sbhd_to_thd`).
    conv_weight ``[C, W]``. Returns ``o [T_local, Hv, Dv]`` in the same rows. Every check
    runs before the first collective; there is no fallback to another mode.

    ``layout``: the rows' layout, one of the mode's ``ModeSpec.layouts``; another than zigzag
    (chunkwise's ``contiguous``) when the caller moved the rows itself (its ``call.swap_layout``),
    and the output stays there. ``call``: the mode's decision for this call
    (``get_mode(mode).prepare(backend, group, plan)``), made here when not given.
    """
    spec = get_mode(mode)
    if not isinstance(layout, str):
        raise TypeError(f"layout must be a str, one of {spec.layouts}, got {type(layout).__name__}")
    _check_layout(spec, layout)
    check_backend(backend)
    if group is not None and not isinstance(group, torch.distributed.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None (no CP), got {type(group).__name__}")
    world = 1 if group is None else group_size(group)
    check_inputs(qkv, g, beta, conv_weight, conv_bias, shape, plan, world)
    check_core = getattr(backend, "check_core", None)  # the kernels' own limits, before any collective
    if check_core is not None:
        check_core(shape, qkv.dtype)
    if world == 1:
        return local_core(qkv, g, beta, conv_weight, conv_bias, shape=shape, cu_seqlens=plan.cu, backend=backend)
    _check_heads(spec, shape, world)
    if call is None:  # host-side: a setting the backend cannot honour for this group fails here
        call = spec.prepare(backend, group, plan)
    core = call.core(layout)
    _check_log_decay_on_every_rank(g, group)
    return core(qkv, g, beta, conv_weight, conv_bias, shape=shape, plan=plan, group=group, backend=backend)
