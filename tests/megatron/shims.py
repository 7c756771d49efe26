"""Test-only shims and builders for running megatron-core 0.19.2's GatedDeltaNet on a CPU.

Nothing here belongs in the library. What it does and why:

* ``torch.cuda.current_device()`` -> the CPU device (GatedDeltaNet's constructor and stock
  0.19.2's head permutation put tensors there).
* ``common.HAVE_FLA = True`` and ``common.l2norm`` = a torch l2norm (``x * rsqrt(sum x^2 + 1e-6)``,
  FLA's formula): deterministic mode uses torch conv and ``torch_chunk_gated_delta_rule`` but still
  calls FLA's l2norm, and the constructor refuses to run without FLA.
* ``torch._dynamo.config.disable = True``: ``jit_fuser`` is torch.compile (30+ s cold on 2 cores).
* Megatron's checkpoint helpers save and restore the CUDA RNG state: on the CPU they get the CPU
  generator's state instead (``_get_cuda_rng_state`` / ``_set_cuda_rng_state``).
* Without TransformerEngine, 0.19.2's ``CheckpointWithoutOutput()`` (what stock GDN's gdn_norm_out
  recompute, and gdn-cp's, call) is broken: ``self.fp8 = fp8 is not None`` is True for the default
  ``fp8=False`` and the forward then calls TE's ``FP8GlobalStateManager`` (NameError). Stand-ins
  that say "no fp8" are installed when TE is absent (the real images carry TE).
* The 0.19.2 local spec has ``in_proj=None`` for GDN (no layer-norm-fused linear without TE), so
  the submodules are built by hand: ColumnParallelLinear / the local RMSNorm / RowParallelLinear.
* Weights come from a seeded generator, identical on every rank and for every CP size
  (``perform_initialization=False`` leaves ``torch.empty`` garbage otherwise).

The ``patched_megatron`` fixture (import it into a test module) applies the pinned patch to the
installed megatron-core for the test session when it is pristine, and reverts it at the end only
if it applied it. Spawned ranks import the installed (patched) megatron.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
from functools import partial
from typing import Iterable, Optional, Sequence

import pytest
import torch
import torch.nn.functional as F

PINNED = "0.19.2"
SKIP_ENV = "GDN_CP_ALLOW_SKIP_MEGATRON"


# ------------------------------------------------------------------------------------------
# the patched installed megatron-core (parent process, session fixture)
# ------------------------------------------------------------------------------------------
def _unavailable(reason: str):
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(reason)
    pytest.fail(
        f"{reason}\nThe GatedDeltaNet tests need megatron-core=={PINNED} installed (patched by "
        f"`python3 -m gdn_cp.cli patch apply`, or pristine: the tests patch it for the session). "
        f"Set {SKIP_ENV}=1 to skip them instead.",
        pytrace=False,
    )


@pytest.fixture(scope="session")
def patched_megatron():
    """The installed megatron-core, patched for the session (reverted at the end if we patched it)."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        _unavailable("megatron-core is not importable")
    from gdn_cp.megatron import patching

    try:
        root = patching.find_megatron_root()
        version = patching.megatron_version(root)
        state = patching.overall_state(patching.check_patch(root))
    except Exception as e:  # noqa: BLE001 - any failure here is "not usable", with the reason
        _unavailable(f"cannot inspect the installed megatron-core: {type(e).__name__}: {e}")
    if version not in (None, PINNED):
        _unavailable(f"installed megatron-core is {version}, the patch is pinned to {PINNED}")
    applied = False
    if state == patching.PRISTINE:
        patching.apply_patch(root)
        applied = True
    elif state != patching.PATCHED:
        pytest.fail(
            f"installed megatron-core at {root} is {state!r} (neither pristine nor patched); "
            "run `python3 -m gdn_cp.cli patch check`",
            pytrace=False,
        )
    try:
        yield root
    finally:
        if applied:
            patching.revert_patch(root)


# ------------------------------------------------------------------------------------------
# inside a rank (or any process that builds the module)
# ------------------------------------------------------------------------------------------
_SHIMS_INSTALLED = False


def _torch_l2norm(x, dim: int = -1, eps: float = 1e-6, **_):
    return x * torch.rsqrt((x * x).sum(dim, keepdim=True) + eps)


def install_cpu_shims() -> None:
    """Idempotent. Call in every process that builds or runs a GatedDeltaNet on the CPU."""
    global _SHIMS_INSTALLED
    if _SHIMS_INSTALLED:
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
    _SHIMS_INSTALLED = True


def install_gpu_shims() -> None:
    """On a GPU only dynamo is turned off (jit_fuser compiles otherwise: slow, and not under test)."""
    torch._dynamo.config.disable = True


def assert_patched() -> None:
    """Fail loudly when this process imported a pristine megatron (the fixture did not run first)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if "linear_cp_mode" not in TransformerConfig.__dataclass_fields__:
        raise RuntimeError("this process imported a pristine megatron-core: the patch was not applied first")


_GROUPS: dict = {}


def rank_groups():
    """Process groups of this rank, created once per rank process (every rank creates every group,
    in the same order): ``self`` (size 1: the TP group, and the CP group of CP=1 baselines),
    ``world`` and ``pair`` (ranks {2i, 2i+1}; dynamic CP sub-groups)."""
    import torch.distributed as dist

    if not _GROUPS:
        world, rank = dist.get_world_size(), dist.get_rank()
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
    from megatron.core.process_groups_config import ProcessGroupCollection

    pg = ProcessGroupCollection()
    pg.tp = rank_groups()["self"]
    pg.cp = cp_group
    return pg


# Default GDN shape: heads divisible by 4 so headwise is legal at CP=2 and CP=4.
DIMS = dict(hidden_size=32, linear_num_key_heads=4, linear_num_value_heads=8,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4)


def make_config(cp: int, mode: str = "headwise", dtype=torch.float32, **overrides):
    """A TransformerConfig for one GDN layer on the CPU (deterministic mode: reference backend)."""
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


def submodules():
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

    module = GatedDeltaNet(config, submodules(), layer_number=layer_number, bias=bias,
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


def zigzag_rows(cu: Sequence[int], cp: int, rank: int) -> torch.Tensor:
    """Global rows of ``rank`` under Megatron's load-balanced CP split (written out independently
    of gdn_cp.layout): every sequence of cu is cut in 2*cp parts, rank r holds parts r and
    2*cp-1-r, sequence after sequence."""
    rows = []
    for a, b in zip(cu[:-1], cu[1:]):
        part = (b - a) // (2 * cp)
        assert part * 2 * cp == b - a, f"length {b - a} not divisible by 2*cp={2 * cp}"
        for j in (rank, 2 * cp - 1 - rank):
            rows.extend(range(a + j * part, a + (j + 1) * part))
    return torch.tensor(rows, dtype=torch.long)


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


def cumsum0(lengths: Iterable[int]) -> list[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def thd_case(cp: int):
    """(padded, actual) global boundaries of a packed micro-batch at CP=cp: sequences that straddle
    the contiguous rank boundaries, an empty padding slot, actual lengths shorter than padded."""
    u = 2 * cp
    padded = [5 * u, 0, 11 * u, 2 * u, 6 * u]  # 24 u tokens; slot 1 is an empty padding slot
    actual = [5 * u - 3, 0, 11 * u, 2 * u - 1, 6 * u - 2]
    return cumsum0(padded), cumsum0(actual)


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


def stock_vs_patched(module, x, dout, group, metric) -> dict:
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


def run_layer(module, x, dout, packed_seq_params=None, forward=None):
    """Forward + backward of one layer call. Returns (out [+ bias], x.grad, {param: grad})."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    fwd = forward or module
    out, bias = fwd(x, None, packed_seq_params=packed_seq_params)
    y = out if bias is None else out + bias
    y.backward(dout)
    grads = {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in module.named_parameters()}
    return y.detach(), x.grad.detach(), grads


def rel_err(got, want) -> float:
    """max |got - want| / max |want| (inf when a gradient is missing or has the wrong shape)."""
    if got is None or want is None or tuple(got.shape) != tuple(want.shape):
        return math.inf
    scale = want.double().abs().max().clamp_min(1e-30)
    return float((got.double() - want.double()).abs().max() / scale)


# ------------------------------------------------------------------------------------------
# parity cases (shared by the CPU tests; run inside a rank)
# ------------------------------------------------------------------------------------------
MODES = ("headwise", "chunkwise", "all_gather")
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
SBHD_BATCH = 2
HIDDEN = DIMS["hidden_size"]


def sbhd_len(cp: int) -> int:
    return 24 * cp  # 2*cp zigzag parts of 12 rows each


def make_inputs(t: int, batch: int, dtype, seed: int, hidden: int = HIDDEN, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, batch, hidden, generator=gen, dtype=torch.float64)
    dout = torch.randn(t, batch, hidden, generator=gen, dtype=torch.float64)
    return x.to(device=device, dtype=dtype), dout.to(device=device, dtype=dtype)


def rel_l2(got, want) -> float:
    """||got - want|| / ||want|| (normalized RMS; the GPU/bf16 metric). inf when missing."""
    if got is None or want is None or tuple(got.shape) != tuple(want.shape):
        return math.inf
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def compare(got, want, rows, metric=None) -> dict:
    """Relative errors of one CP rank's (out, x.grad, param grads summed over CP) vs CP=1."""
    metric = metric or rel_err
    y, gx, grads = got
    ry, rgx, rgrads = want
    errs = {"out": metric(y, ry[rows]), "grad:hidden_states": metric(gx, rgx[rows])}
    assert set(grads) == set(rgrads), (sorted(grads), sorted(rgrads))
    for name in rgrads:
        errs[f"grad:{name}"] = metric(grads[name], rgrads[name])
    return errs


def parity_case(rank, world, layout, dtype, modes, *, cfg=None, cp_group=None, dynamic=False, seed=1,
                data_seed=0, bias=True, conv_bias=True, device="cpu", metric=None):
    """One layout/dtype on this rank: the CP=1 answer, then each mode under CP. Returns
    {mode: {quantity: rel err}} (a missing gradient is inf).

    ``cp_group`` (default: WORLD) is the group this micro-batch is split over; every rank of it
    calls with the same arguments. ``dynamic=False``: the modules are built with it as their static
    CP group (config context_parallel_size = its size). ``dynamic=True``: the modules keep the
    static WORLD group (context_parallel_size = world) and the micro-batch's PackedSeqParams carries
    ``cp_group`` and ``local_cp_size`` (dynamic CP). ``cfg`` overrides TransformerConfig fields.
    ``device`` / ``metric``: the GPU suite passes "cuda" and :func:`rel_l2`.
    """
    import torch.distributed as dist
    from megatron.core.packed_seq_params import PackedSeqParams

    from gdn_cp.megatron.gdn import gated_delta_net_forward

    groups = rank_groups()
    cp_group = groups["world"] if cp_group is None else cp_group
    cp, cp_rank = cp_group.size(), cp_group.rank()
    static_group = groups["world"] if dynamic else cp_group
    cfg = cfg or {}
    build = partial(build_gdn, seed=seed, bias=bias, conv_bias=conv_bias, device=device)
    hidden = cfg.get("hidden_size", DIMS["hidden_size"])
    extra = dict(cp_group=cp_group, local_cp_size=cp) if dynamic else {}

    if layout == "sbhd":
        s = sbhd_len(cp)
        x, dout = make_inputs(s, SBHD_BATCH, dtype, 100 + cp + 1000 * data_seed, hidden, device)
        rows = zigzag_rows([0, s], cp, cp_rank).to(device)
        psp = lambda **kw: PackedSeqParams(qkv_format="sbhd", **kw) if kw else None  # noqa: E731
    else:
        cu_pad, cu_act = thd_case(cp)
        x, dout = make_inputs(cu_pad[-1], 1, dtype, 200 + cp + 1000 * data_seed, hidden, device)
        rows = zigzag_rows(cu_pad, cp, cp_rank).to(device)
        psp = lambda **kw: thd_params(cu_pad, cu_act, device=device, **kw)  # noqa: E731

    base = build(make_config(1, "headwise", dtype, **cfg), groups["self"])
    forward = None
    if layout == "sbhd" and dtype == torch.float64:  # stock computes its core in fp32
        forward = partial(gated_delta_net_forward, base)
    want = run_layer(base, x, dout, psp(), forward=forward)

    out = {}
    for mode in modes:
        module = build(make_config(static_group.size(), mode, dtype, **cfg), static_group)
        y, gx, grads = run_layer(module, x[rows], dout[rows], psp(**extra))
        for g in grads.values():
            if g is not None:
                dist.all_reduce(g, group=cp_group)
        out[mode] = compare((y, gx, grads), want, rows, metric)
    return out
