"""Build and run megatron-core's real (patched) GatedDeltaNet on the CPU or a GPU, for tests and
benchmarks. Megatron is imported lazily, inside the functions: importing this module is cheap.

On the CPU megatron-core 0.19.2 needs stand-ins (:func:`install_cpu_shims`, called by
:func:`build_gdn` for a CPU device; they patch megatron and torch.cuda in THIS process, so they
belong in test and benchmark processes only, never in a training job):

* ``torch.cuda.current_device()`` -> the CPU (the constructor and stock 0.19.2's head permutation
  put tensors there);
* ``common.HAVE_FLA = True`` and ``common.l2norm`` = a torch l2norm (``x * rsqrt(sum x^2 + 1e-6)``,
  FLA's formula): deterministic mode uses torch conv and ``torch_chunk_gated_delta_rule`` but still
  calls FLA's l2norm, and the constructor refuses to run without FLA;
* ``torch._dynamo.config.disable = True``: ``jit_fuser`` is torch.compile (30+ s cold on 2 cores);
  on a GPU this is the only change (:func:`install_gpu_shims`);
* Megatron's checkpoint helpers save and restore the CUDA RNG state: on the CPU they get the CPU
  generator's state instead;
* without TransformerEngine, 0.19.2's ``CheckpointWithoutOutput()`` (gdn_norm_out recompute) is
  broken (``self.fp8 = fp8 is not None`` is True for the default ``fp8=False``, then TE's
  ``FP8GlobalStateManager`` is a NameError): stand-ins that say "no fp8" are installed when TE is
  absent.

The 0.19.2 local spec has ``in_proj=None`` for GDN (no layer-norm-fused linear without TE), so the
submodules are built by hand (ColumnParallelLinear / the local RMSNorm / RowParallelLinear), and
weights come from a seeded generator, identical on every rank and for every CP size.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .metrics import max_rel

__all__ = [
    "DIMS",
    "assert_patched",
    "build_gdn",
    "install_cpu_shims",
    "install_gpu_shims",
    "make_config",
    "pg_collection",
    "rank_groups",
    "run_layer",
    "set_params",
    "stock_forward",
    "stock_vs_patched",
    "thd_params",
]

# Default GDN shape: heads divisible by 4 so headwise is legal at CP=2 and CP=4.
DIMS = dict(hidden_size=32, linear_num_key_heads=4, linear_num_value_heads=8,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4)

_CPU_SHIMS_INSTALLED = False


def _torch_l2norm(x, dim: int = -1, eps: float = 1e-6, **_):
    return x * torch.rsqrt((x * x).sum(dim, keepdim=True) + eps)


def install_cpu_shims() -> None:
    """Idempotent. Call in every process that builds or runs a GatedDeltaNet on the CPU."""
    global _CPU_SHIMS_INSTALLED
    if _CPU_SHIMS_INSTALLED:
        return
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch._dynamo.config.disable = True
    import megatron.core.ssm.gated_delta_net.common as common
    import megatron.core.tensor_parallel.random as mrandom

    common.HAVE_FLA = True
    common.l2norm = _torch_l2norm
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    if not mrandom.HAVE_TE:
        class _NoFP8:
            is_fp8_enabled = staticmethod(lambda: False)
            get_fp8_recipe = staticmethod(lambda: None)

        mrandom.FP8GlobalStateManager = _NoFP8
        mrandom.activation_recompute_forward = lambda **kw: contextlib.nullcontext()
        mrandom.fp8_autocast = lambda **kw: contextlib.nullcontext()
    _CPU_SHIMS_INSTALLED = True


def install_gpu_shims() -> None:
    """On a GPU only dynamo is turned off (jit_fuser compiles otherwise: slow, and not under test)."""
    torch._dynamo.config.disable = True


def assert_patched() -> None:
    """RuntimeError when this process imported a pristine megatron-core (patch it first)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if "linear_cp_mode" not in TransformerConfig.__dataclass_fields__:
        raise RuntimeError("this process imported a pristine megatron-core: apply the gdn-cp patch first "
                           "(`gdn-cp patch apply`)")


_GROUPS: dict = {}


def rank_groups() -> dict:
    """This rank's process groups by role: ``self`` (size 1: the TP group, and the CP group of CP=1
    baselines), ``world`` and ``pair`` (ranks {2i, 2i+1}: dynamic-CP sub-groups; even worlds only).

    In a :class:`gdn_cp.testing.ranks.RankPool` rank these are the pool's groups; elsewhere they
    are created on first call (every rank must call it, in the same order)."""
    import torch.distributed as dist

    from .ranks import current_rank

    if _GROUPS:
        return _GROUPS
    ctx = current_rank()
    world, rank = dist.get_world_size(), dist.get_rank()
    if ctx is not None:
        _GROUPS["self"] = ctx.group(1)
        _GROUPS["world"] = ctx.group(world)
        if world % 2 == 0:
            _GROUPS["pair"] = ctx.group(2)
        return _GROUPS
    selfs = [dist.new_group([r]) for r in range(world)]
    _GROUPS["self"] = selfs[rank]
    _GROUPS["world"] = dist.group.WORLD
    if world % 2 == 0 and world > 2:
        pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
        _GROUPS["pair"] = pairs[rank // 2]
    elif world == 2:
        _GROUPS["pair"] = dist.group.WORLD
    return _GROUPS


def pg_collection(cp_group):
    """A ProcessGroupCollection with TP = this rank alone and the given CP group."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    pg = ProcessGroupCollection()
    pg.tp = rank_groups()["self"]
    pg.cp = cp_group
    return pg


def make_config(cp: int, mode: str = "headwise", dtype=torch.float32, **overrides):
    """A TransformerConfig for one GDN layer (deterministic mode, i.e. the reference backend,
    unless overridden) with :data:`DIMS`."""
    from megatron.core.transformer import TransformerConfig

    kw = dict(
        num_layers=2, num_attention_heads=4, perform_initialization=False, use_cpu_initialization=True,
        deterministic_mode=True, activation_func=F.silu, normalization="RMSNorm",
        experimental_attention_variant="gated_delta_net", linear_attention_freq=2,
        context_parallel_size=cp, params_dtype=dtype, linear_cp_mode=mode, add_bias_linear=False,
    )
    kw.update(DIMS)
    kw.update(overrides)
    return TransformerConfig(**kw)


def _submodules():
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    return GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear,
        out_norm=LocalSpecProvider().layer_norm(rms_norm=True, for_qk=False),
        out_proj=RowParallelLinear,
    )


def build_gdn(config, cp_group, *, seed: int = 0, layer_number: int = 1, bias: bool = False,
              conv_bias: bool = False, device="cpu"):
    """A GatedDeltaNet with the given CP group and seeded weights (same on every rank and CP size).

    The module is cast to ``config.params_dtype`` as a whole (the local RMSNorm makes an fp32
    weight whatever params_dtype says).
    """
    if torch.device(device).type == "cpu":
        install_cpu_shims()
    else:
        install_gpu_shims()
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    module = GatedDeltaNet(config, _submodules(), layer_number=layer_number, bias=bias,
                           conv_bias=conv_bias, pg_collection=pg_collection(cp_group))
    module.to(device=device, dtype=config.params_dtype)
    set_params(module, seed)
    return module


def set_params(module, seed: int) -> None:
    """Every parameter from a generator seeded by ``seed`` and the parameter's name.

    Scales keep the recurrence alive over many tokens (decay ~exp(-0.1) per token) so that the
    state carried between ranks matters.
    """
    hidden = module.config.hidden_size
    for name, p in module.named_parameters():
        gen = torch.Generator().manual_seed(seed * 1_000_003 + sum(ord(c) * (i + 1) for i, c in enumerate(name)))
        n = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        if name == "A_log":
            v = torch.log(0.3 + 0.5 * torch.rand(p.shape, generator=gen, dtype=torch.float64))
        elif name == "dt_bias":
            v = -2.0 + 0.5 * n
        elif name == "out_norm.weight":
            v = 1.0 + 0.2 * n
        elif name == "in_proj.weight":
            v = n / math.sqrt(hidden)
        elif name == "out_proj.weight":
            v = n / math.sqrt(p.shape[1])
        elif name == "conv1d.weight":
            v = 0.5 * n
        else:  # biases and anything a future version adds: never left uninitialized
            v = 0.1 * n
        with torch.no_grad():
            p.copy_(v.to(p.dtype))


def thd_params(cu_padded: Sequence[int], cu_actual: Optional[Sequence[int]] = None, *, cp_group=None,
               local_cp_size=None, device="cpu"):
    """PackedSeqParams for THD with GLOBAL boundaries (padded and actual)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_actual = cu_padded if cu_actual is None else cu_actual
    pad = torch.tensor(cu_padded, dtype=torch.int32, device=device)
    act = torch.tensor(cu_actual, dtype=torch.int32, device=device)
    lens = [b - a for a, b in zip(cu_padded[:-1], cu_padded[1:])]
    kw = {}
    if cp_group is not None:
        kw["cp_group"] = cp_group
    if local_cp_size is not None:
        kw["local_cp_size"] = local_cp_size
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=act, cu_seqlens_kv=act.clone(), cu_seqlens_q_padded=pad,
        cu_seqlens_kv_padded=pad.clone(), max_seqlen_q=max(lens), max_seqlen_kv=max(lens), **kw,
    )


@contextlib.contextmanager
def stock_forward():
    """Run GatedDeltaNet.forward's untouched stock 0.19.2 code: the patch's hand-over never fires."""
    import gdn_cp.megatron.gdn as glue

    saved = glue.should_dispatch
    glue.should_dispatch = lambda module, packed_seq_params: False
    try:
        yield
    finally:
        glue.should_dispatch = saved


def run_layer(module, x, dout, packed_seq_params=None, forward=None):
    """Forward + backward of one layer call. Returns ``(out [+ bias], x.grad, {param: grad})``."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    fwd = forward or module
    out, bias = fwd(x, None, packed_seq_params=packed_seq_params)
    y = out if bias is None else out + bias
    y.backward(dout)
    grads = {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in module.named_parameters()}
    return y.detach(), x.grad.detach(), grads


def stock_vs_patched(module, x, dout, group, metric=max_rel) -> dict:
    """``metric`` of the patched forward against stock 0.19.2's on the same module and rows:
    output, input gradient and every parameter gradient. Per-rank parameter gradients differ by
    design (stock slices A_log / dt_bias / conv per head; gdn-cp uses every head on its own
    tokens), so they are compared summed over the CP ``group``."""
    import torch.distributed as dist

    patched = run_layer(module, x, dout)
    with stock_forward():
        stock = run_layer(module, x, dout)
    errs = {"out": metric(patched[0], stock[0]), "grad:hidden_states": metric(patched[1], stock[1])}
    for name in stock[2]:
        a, b = patched[2][name], stock[2][name]
        if a is not None and b is not None:
            dist.all_reduce(a, group=group)
            dist.all_reduce(b, group=group)
        errs[f"grad:{name}"] = metric(a, b)
    return errs
