"""The modes' two entries: :func:`prepare_mode` (the class of the settings' mode, :data:`MODE_CLASSES`,
prepared for a call) and :func:`gdn_core`, the public call of the GDN core alone: every check of its
arguments, a :class:`~gdn_cp.modes.context.CallContext`, then the core of the mode prepared for it."""

from __future__ import annotations

from typing import Optional

import torch

from ..comm import all_ranks_true, group_size, is_process_group
from ..layout.plan import CPPlan
from ..ops.contract import Backend, check_backend
from ..ops.gates import check_log_decay, log_decay_ok
from ..ops.shape import GDNShape
from .all_gather import AllGather
from .chunkwise import Chunkwise
from .local import Local
from .context import CallContext, Mode
from .headwise import Headwise
from .settings import Settings
from .spec import ModeSpec, get_mode, heads_error

__all__ = ["MODE_CLASSES", "check_core_inputs", "gdn_core", "prepare_mode"]

MODE_CLASSES: dict[ModeSpec, type[Mode]] = {cls.spec: cls for cls in (Headwise, Chunkwise, AllGather)}
"""Each registry entry's class (the class names its entry)."""
LOCAL = Local()


def prepare_mode(ctx: CallContext) -> Mode:
    """The mode that runs ``ctx``: :class:`~gdn_cp.modes.local.Local` without CP, else the settings'
    mode's class, prepared for this call (host-side; ValueError where a setting cannot be honoured)."""
    if ctx.group is None:
        return LOCAL
    return MODE_CLASSES[get_mode(ctx.settings.mode)].prepare(ctx)


def _check_tensor(name: str, t, device: torch.device | None = None) -> None:
    """A floating-point tensor with values (not meta), on ``device`` when given."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if t.is_meta:
        raise ValueError(f"{name} is on the meta device, which holds no values; pass tensors on the CPU or a GPU")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but qkv is on {device}; put every input on one device")


def check_core_inputs(qkv, g, beta, conv_weight, conv_bias, shape: GDNShape, plan: CPPlan, group_world: int) -> None:
    """Raise before any collective when tensors, plan and group do not fit together."""
    if not isinstance(shape, GDNShape):
        raise TypeError(f"shape must be a GDNShape, got {type(shape).__name__}")
    if not isinstance(plan, CPPlan):
        raise TypeError(
            f"plan must be a CPPlan (RouteCache().plan(cu_seqlens, cp, rank) or plan_for_sbhd), got {type(plan).__name__}"
        )
    if plan.cp_size != group_world:
        raise ValueError(
            f"the plan was built for cp={plan.cp_size} but the process group has {group_world} ranks; "
            f"build the plan with the group's size (dynamic CP: PackedSeqParams.local_cp_size)"
        )
    t_local = plan.t_local
    _check_tensor("qkv", qkv)
    device = qkv.device
    expect = {
        "qkv": (qkv, (t_local, shape.conv_dim)),
        "g": (g, (t_local, shape.num_v_heads)),
        "beta": (beta, (t_local, shape.num_v_heads)),
    }
    for name, (tensor, want) in expect.items():
        _check_tensor(name, tensor, device)
        if tuple(tensor.shape) != want:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, expected {want} "
                f"(T_local = T_global/cp = {plan.t_global}/{plan.cp_size} of the plan; heads from GDNShape)"
            )
    _check_tensor("conv_weight", conv_weight, device)
    if conv_weight.dim() != 2 or conv_weight.shape[0] != shape.conv_dim or conv_weight.shape[1] < 1:
        raise ValueError(
            f"conv_weight has shape {tuple(conv_weight.shape)}, expected [{shape.conv_dim}, W] with W >= 1 "
            f"(reshape Megatron's [C, 1, W] weight to [C, W])"
        )
    if conv_bias is not None:
        _check_tensor("conv_bias", conv_bias, device)
        if tuple(conv_bias.shape) != (shape.conv_dim,):
            raise ValueError(f"conv_bias has shape {tuple(conv_bias.shape)}, expected ({shape.conv_dim},)")
    if g.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"g (log decay) must be float32 or float64, got {g.dtype}")
    if g.device.type == "cpu" and group_world == 1:  # host values: free to read; no collective follows
        check_log_decay(g)


def _check_heads(spec: ModeSpec, shape: GDNShape, cp: int) -> None:
    """The registry's head rule (:func:`gdn_cp.modes.spec.heads_error`) for this CP group (``shape`` is one TP
    rank's: TP is divided out)."""
    error = heads_error(spec.name, num_key_heads=shape.num_k_heads, num_value_heads=shape.num_v_heads, tp=1, cp=cp,
                        fields=("shape.num_k_heads", "shape.num_v_heads"),
                        sizes=f"a CP group of {cp} ranks (the GDNShape's heads are one TP rank's, so TP=1 here)")
    if error is not None:
        raise error


def _check_log_decay_on_every_rank(g: torch.Tensor, group) -> None:
    """Refuse a bad log decay on every rank of the group together, before any data moves.

    ``g`` holds this rank's rows, so one rank may see a bad value the others do not; if it raised
    alone, the others would wait in the first collective. The ranks agree first (one int
    all-reduce). Only for host (CPU) values: reading a device ``g`` would synchronize, and the
    core never does (see :mod:`gdn_cp.ops.gates`).
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
    chunkwise_path: Optional[str] = None,
) -> torch.Tensor:
    """GDN core (conv + SiLU + gated delta rule) under context parallelism.

    qkv ``[T_local, C]`` pre-conv, g ``[T_local, Hv]`` fp32 log decay, beta ``[T_local, Hv]``,
    all rank-local rows in zigzag layout for ``plan`` (THD; SBHD via :func:`sbhd_to_thd`).
    conv_weight ``[C, W]``. Returns ``o [T_local, Hv, Dv]`` in the same rows. ``group``: the CP
    process group, or None without CP. ``chunkwise_path``: how chunkwise exchanges halos and
    states (``auto``, ``native``, ``generic``; None: ``GDN_CP_CHUNKWISE_PATH``). Every check runs
    before the first collective; there is no fallback to another mode.
    """
    spec = get_mode(mode)
    settings = Settings.from_environment(mode=spec.name, **({} if chunkwise_path is None else
                                                            {"chunkwise_path": chunkwise_path}))
    check_backend(backend)
    if group is not None and not is_process_group(group):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None (no CP), got {type(group).__name__}")
    world = 1 if group is None else group_size(group)
    check_core_inputs(qkv, g, beta, conv_weight, conv_bias, shape, plan, world)
    backend.check_shape(shape, qkv.dtype)  # the kernels' own limits (head dims, dtypes)
    if world > 1:
        _check_heads(spec, shape, world)
    ctx = CallContext(settings=settings, shape=shape, plan=plan, group=group if world > 1 else None, backend=backend)
    run = prepare_mode(ctx)  # host-side: a setting the backend cannot honour for this group fails here
    if world > 1:
        _check_log_decay_on_every_rank(g, group)
    return run.core(ctx, qkv, g, beta, conv_weight, conv_bias)
