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
  on a GPU nothing is changed (:func:`install_gpu_shims`): dynamo stays on, as in training, so that
  stock's ``jit_fuser`` functions and gdn-cp's fused glue are compiled as a user's run compiles them
  (with dynamo off, gdn-cp's glue takes the backend's conv kernel instead: seen 2026-12-03, every GPU
  layer benchmark and test had run with dynamo off);
* Megatron's checkpoint helpers save and restore the CUDA RNG state: on the CPU they get the CPU
  generator's state instead;
* ``torch.cuda.current_stream()`` -> a stream that waits for nothing (Megatron's
  DistributedDataParallel asks for it in its gradient sync, to wait on CUDA-graph events);
* the recompute of ``CheckpointWithoutOutput`` (gdn_norm_out) hands its output over by
  ``share_storage``, a C++ extension that ``torch.utils.cpp_extension.load_inline`` compiles on
  first use (10-20 CPU s of g++; its build cache under ``~/.cache/torch_extensions`` is keyed by
  the torch include path, so two virtual environments rebuild it in turn): on the CPU the same
  hand-over by a storage-level copy (every view sees the data, no version counter moves);
* without TransformerEngine, 0.19.2's ``CheckpointWithoutOutput()`` (gdn_norm_out recompute) is
  broken (``self.fp8 = fp8 is not None`` is True for the default ``fp8=False``, then TE's
  ``FP8GlobalStateManager`` is a NameError): stand-ins that say "no fp8" are installed when TE is
  absent.

The 0.19.2 local spec has ``in_proj=None`` for GDN (no layer-norm-fused linear without TE), so the
submodules are built by hand (ColumnParallelLinear / the local RMSNorm / RowParallelLinear), and
weights come from a seeded generator, identical on every rank and for every CP size. Under TP
(``build_gdn(..., tp_group=...)``) each rank gets its part of the same full weights
(:mod:`gdn_cp_testing.megatron.tp`). Under sequence parallelism Megatron's local norm refuses to
build ("sequence parallel not supported by torch LayerNorm"), so ``out_norm`` is then
:class:`SequenceParallelRMSNorm`: torch's RMSNorm with its weight tagged ``sequence_parallel``,
as TransformerEngine's and Apex's norms tag theirs.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from gdn_cp.ops.accuracy import max_rel

__all__ = [
    "DIMS",
    "SequenceParallelRMSNorm",
    "assert_patched",
    "SPECS",
    "build_gdn",
    "gdn_cp_forward",
    "install_cpu_shims",
    "install_gpu_shims",
    "make_config",
    "pg_collection",
    "rank_groups",
    "run_layer",
    "set_params",
    "stock_forward",
    "stock_vs_patched",
    "te_submodules",
    "thd_params",
]

# Default GDN shape: heads divisible by 4 so headwise is legal at CP=2 and CP=4.
DIMS = dict(hidden_size=32, linear_num_key_heads=4, linear_num_value_heads=8,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4)

_CPU_SHIMS_INSTALLED = False


def _torch_l2norm(x, dim: int = -1, eps: float = 1e-6, **_):
    return x * torch.rsqrt((x * x).sum(dim, keepdim=True) + eps)


def _share_storage_by_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Megatron's ``share_storage(dst, src)`` without its compiled extension: ``dst``'s storage
    (released to 0 bytes before the recompute) resized back and filled with ``src``'s bytes."""
    storage = dst.untyped_storage()
    storage.resize_(src.untyped_storage().nbytes())
    storage.copy_(src.untyped_storage())


class _CpuStream:
    """Stands in for ``torch.cuda.current_stream()`` on the CPU: work is done when issued."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self, event=None) -> "_CpuStream":  # an event that has happened (synchronize: nothing to wait)
        return self

    def synchronize(self) -> None:
        pass


def install_cpu_shims() -> None:
    """Idempotent. Call in every process that builds or runs a GatedDeltaNet on the CPU."""
    global _CPU_SHIMS_INSTALLED
    if _CPU_SHIMS_INSTALLED:
        return
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.current_stream = lambda *a, **k: _CpuStream()
    torch.cuda.Stream = lambda *a, **k: _CpuStream()  # MoE's alltoall dispatcher copies its splits on a side stream
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch._dynamo.config.disable = True
    import megatron.core.ssm.gated_delta_net.common as common
    import megatron.core.tensor_parallel.random as mrandom

    common.HAVE_FLA = True
    common.l2norm = _torch_l2norm
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    mrandom._get_share_storage = lambda: _share_storage_by_copy
    if not mrandom.HAVE_TE:
        class _NoFP8:
            is_fp8_enabled = staticmethod(lambda: False)
            get_fp8_recipe = staticmethod(lambda: None)

        mrandom.FP8GlobalStateManager = _NoFP8
        mrandom.activation_recompute_forward = lambda **kw: contextlib.nullcontext()
        mrandom.fp8_autocast = lambda **kw: contextlib.nullcontext()
    _CPU_SHIMS_INSTALLED = True


def install_gpu_shims() -> None:
    """On a GPU nothing needs a stand-in, and dynamo stays on: the fused glue and Megatron's ``jit_fuser``
    compile as in training (the module docstring says why this is not the CPU's choice)."""


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

    In a :class:`gdn_cp_testing.ranks.RankPool` rank these are the pool's groups; elsewhere they
    are created on first call (every rank must call it, in the same order)."""
    import torch.distributed as dist

    from gdn_cp_testing.ranks import current_rank, process_group

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
    selfs = [process_group([r]) for r in range(world)]
    _GROUPS["self"] = selfs[rank]
    _GROUPS["world"] = dist.group.WORLD
    if world % 2 == 0 and world > 2:
        pairs = [process_group([r, r + 1]) for r in range(0, world, 2)]
        _GROUPS["pair"] = pairs[rank // 2]
    elif world == 2:
        _GROUPS["pair"] = dist.group.WORLD
    return _GROUPS


def pg_collection(cp_group, tp_group=None):
    """A ProcessGroupCollection with the given CP group and TP group (default: this rank alone)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    pg = ProcessGroupCollection()
    pg.tp = rank_groups()["self"] if tp_group is None else tp_group
    pg.cp = cp_group
    return pg


def make_config(cp: int, mode: str = "headwise", dtype=torch.float32, **overrides):
    """A TransformerConfig for one GDN layer (deterministic mode, i.e. the reference backend,
    unless overridden) with :data:`DIMS`; ``mode=None``: no ``linear_cp_mode`` (stock megatron-core's config)."""
    from megatron.core.transformer import TransformerConfig

    kw = dict(
        num_layers=2, num_attention_heads=4, perform_initialization=False, use_cpu_initialization=True,
        deterministic_mode=True, activation_func=F.silu, normalization="RMSNorm",
        experimental_attention_variant="gated_delta_net", linear_attention_freq=2,
        context_parallel_size=cp, params_dtype=dtype, add_bias_linear=False,
    )
    if mode is not None:
        kw["linear_cp_mode"] = mode
    kw.update(DIMS)
    kw.update(overrides)
    return TransformerConfig(**kw)


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """``out_norm`` for sequence-parallel tests: torch's RMSNorm over the last dim, its weight tagged
    ``sequence_parallel = config.sequence_parallel`` as TransformerEngine's and Apex's norms tag
    theirs (so ``finalize_model_grads`` treats it as it treats theirs). Megatron's local norm
    refuses sequence parallelism, and TransformerEngine cannot be installed on the test machines."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization != "RMSNorm":
            raise ValueError(f"SequenceParallelRMSNorm needs normalization='RMSNorm', got {config.normalization!r}")
        super().__init__(hidden_size, eps=eps)
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)


def _submodules(sequence_parallel: bool = False):
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    norm = SequenceParallelRMSNorm if sequence_parallel else LocalSpecProvider().layer_norm(rms_norm=True, for_qk=False)
    return GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=norm, out_proj=RowParallelLinear)


SPECS = ("local", "te")
"""Where a test layer's submodules come from: ``local`` (Megatron's local modules, by hand: the
0.19.2 local spec has no GDN in_proj) or ``te`` (``get_gated_delta_net_module_spec``: Megatron's own
GDN spec, TransformerEngine's LayerNorm-fused in_proj, TENorm out_norm, row-parallel out_proj)."""


def te_submodules(config):
    """The GatedDeltaNet submodules Megatron's own spec function builds for ``config`` (needs
    TransformerEngine; ``config.transformer_impl='transformer_engine'``, the default)."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_gated_delta_net_module_spec,
    )

    return get_gated_delta_net_module_spec(config).submodules


def build_gdn(config, cp_group, *, tp_group=None, seed: int = 0, layer_number: int = 1, bias: bool = False,
              conv_bias: bool = False, device="cpu", spec: str = "local"):
    """A GatedDeltaNet with the given CP (and TP) group and seeded weights: the same full weights on
    every rank and for every CP and TP size; under TP each rank holds its part of them.

    ``spec``: one of :data:`SPECS`. The module is cast to ``config.params_dtype`` as a whole (the
    local RMSNorm makes an fp32 weight whatever params_dtype says).
    """
    if spec not in SPECS:
        raise ValueError(f"spec={spec!r}: use one of {SPECS}")
    if torch.device(device).type == "cpu":
        install_cpu_shims()
    else:
        install_gpu_shims()
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    tp = 1 if tp_group is None else tp_group.size()
    if config.sequence_parallel:
        _ensure_global_memory_buffer()
    if tp != config.tensor_model_parallel_size:
        raise ValueError(f"tp_group has {tp} ranks but config.tensor_model_parallel_size="
                         f"{config.tensor_model_parallel_size}; pass the TP group of that size")
    submodules = _submodules(config.sequence_parallel) if spec == "local" else te_submodules(config)
    module = GatedDeltaNet(config, submodules, layer_number=layer_number, bias=bias,
                           conv_bias=conv_bias, pg_collection=pg_collection(cp_group, tp_group))
    module.to(device=device, dtype=config.params_dtype)
    if tp == 1:
        set_params(module, seed)
    else:
        _load_tp_part(module, config, tp_group.rank(), seed=seed, layer_number=layer_number, bias=bias,
                      conv_bias=conv_bias, device=device, spec=spec)
    return module


def _ensure_global_memory_buffer() -> None:
    """Megatron's sequence-parallel linears gather into ``parallel_state``'s global memory buffer,
    which ``initialize_model_parallel`` creates; tests that pass their own groups create it here."""
    from megatron.core import parallel_state

    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()


def _load_tp_part(module, config, tp_rank: int, **build):
    """Copy this TP rank's part of the full weights (those of the same layer at TP=1) into ``module``."""
    import dataclasses

    from gdn_cp_testing.megatron.tp import shard_for_tp, tp_splits

    full_config = dataclasses.replace(config, tensor_model_parallel_size=1, sequence_parallel=False,
                                      context_parallel_size=1)
    group = rank_groups()["self"]
    full = dict(build_gdn(full_config, group, **build).named_parameters())
    tp = config.tensor_model_parallel_size
    splits = tp_splits(module)
    with torch.no_grad():
        for name, p in module.named_parameters():
            split = splits[name]
            p.copy_(full[name] if split is None else shard_for_tp(full[name], split, tp_rank, tp))


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
        elif name in ("out_norm.weight", "in_proj.layer_norm_weight"):  # TE's in_proj fuses the input norm
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
    """Run GatedDeltaNet.forward's untouched stock 0.19.2 code: the patch's hand-over (which looks
    ``gated_delta_net_forward`` up in gdn-cp's hooks on every call) returns None before gdn-cp does anything."""
    import gdn_cp.megatron.hooks as glue

    saved = glue.gated_delta_net_forward
    glue.gated_delta_net_forward = lambda *args, **kwargs: None
    try:
        yield
    finally:
        glue.gated_delta_net_forward = saved


def dispatch_every_call(glue) -> None:
    """``gdn_cp.megatron.gdn`` (``glue``) hands every GatedDeltaNet call to gdn-cp's forward, CP=1 SBHD included
    (where stock's code runs otherwise)."""
    glue.should_dispatch = lambda layer, group, packed_seq_params: True


@contextlib.contextmanager
def gdn_cp_forward():
    """Hand every GatedDeltaNet call to gdn-cp's forward, CP=1 SBHD included (stock 0.19.2 computes
    its deterministic core in fp32: fp64 comparisons at CP=1 SBHD need gdn-cp's path). What the
    forward sees to before it decides (the activation check, the TP gradient sum) runs as always."""
    import gdn_cp.megatron.gdn as glue

    saved = glue.should_dispatch
    dispatch_every_call(glue)
    try:
        yield
    finally:
        glue.should_dispatch = saved


def run_layer(module, x, dout, packed_seq_params=None, forward=None, after_backward=None):
    """Forward + backward of one layer call. Returns ``(out [+ bias], x.grad, {param: grad})``;
    ``after_backward(module)`` runs before the gradients are read (e.g. a finalize step)."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    fwd = forward or module
    out, bias = fwd(x, None, packed_seq_params=packed_seq_params)
    y = out if bias is None else out + bias
    y.backward(dout)
    if after_backward is not None:
        after_backward(module)
    grads = {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in module.named_parameters()}
    return y.detach(), x.grad.detach(), grads


def stock_vs_patched(module, x, dout, group, metric=max_rel, packed_seq_params=None) -> dict:
    """``metric`` of the patched forward against stock 0.19.2's on the same module and rows:
    output, input gradient and every parameter gradient. Per-rank parameter gradients differ by
    design (stock slices A_log / dt_bias / conv per head; gdn-cp uses every head on its own
    tokens), so they are compared summed over the CP ``group`` (None: one rank, as they are)."""
    import torch.distributed as dist

    patched = run_layer(module, x, dout, packed_seq_params)
    with stock_forward():
        stock = run_layer(module, x, dout, packed_seq_params)
    errs = {"out": metric(patched[0], stock[0]), "grad:hidden_states": metric(patched[1], stock[1])}
    for name in stock[2]:
        a, b = patched[2][name], stock[2][name]
        if a is not None and b is not None and group is not None:
            dist.all_reduce(a, group=group)
            dist.all_reduce(b, group=group)
        errs[f"grad:{name}"] = metric(a, b)
    return errs
