"""Rank side of ``layer_full.py``: runs inside each spawned rank of a pool (one rank per GPU with NCCL; gloo ranks
on the CPU). Module-level functions, pickled by name.

One pool serves one megatron-core tree (a pristine copy for the stock cases, a patched copy for gdn-cp's):
:func:`rank_setup` puts it first on ``sys.path``, checks what was imported, and builds per spec ``layer`` (on the
pool's CP group; the case's mode set on its config) and ``layer1`` (the same weights at CP=1: ``cp1_slice`` and the
reference of the check). Weights come from a seeded generator by parameter name, inputs from a seeded generator on
the device: the same on every rank, in both pools, for every case. :func:`rank_case` runs one case in one phase:
``compile`` (one fwd+bwd, the check against CP=1 or, at ``--cp 1``, against stock on the same module and rows, one
core call) or ``time`` (warm-up, CUDA-event iterations after a device synchronize and a host-side gloo barrier, peak
memory, the profiled iterations, the core alone).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, schedule

from gdn_cp import patch
from gdn_cp.layout import RouteCache, plan_for_sbhd
from gdn_cp.megatron.layer import layer_state, reset_settings
from gdn_cp.modes import CallContext, GDNShape, gdn_core, prepare_mode
from gdn_cp.modes.local import kv_repeat
from gdn_cp.ops import get_backend
from gdn_cp.ops.accuracy import rel_l2, worst
from gdn_cp.ops.installed import dist_version
from gdn_cp.ops.fla.detect import fla_available, fla_version, gdn_kernel_backends
from gdn_cp.ops.fused import glue, glue_path, split
from gdn_cp_testing.megatron.layer import (build_gdn, install_cpu_shims, install_gpu_shims, make_config, run_layer,
                                            stock_vs_patched, thd_params)
from gdn_cp_testing.megatron.model import sum_grads
from gdn_cp_testing.megatron.parity import compare
from gdn_cp_testing.packings import zigzag_rows

from .layer_full_math import GLUE_LEVERS, SLICE_CASES, STOCK_CASES, GDNDims, contiguous_slice
from .measure import GIB, idle_causes, kernel_classes, spans_from_trace, split_busy_time, timed_steps

TOP_KERNELS = 40  # CUDA kernels by total time kept per profiled rank (40: every elementwise kernel of a layer shows)
_STATE: dict = {}


# ---- setup ----

def _select_megatron(root: str | None) -> dict:
    """Import megatron-core from ``root`` (first on sys.path), or the installed one (None)."""
    if root is not None:
        if any(m == "megatron" or m.startswith("megatron.") for m in sys.modules):
            raise RuntimeError("megatron was imported in this rank before its tree was chosen")
        sys.path.insert(0, str(root))
    with warnings.catch_warnings():  # "TransformerEngine / Apex not installed", once per module
        warnings.simplefilter("ignore", UserWarning)
        import megatron.core
        import megatron.core.ssm.gated_delta_net.gdn  # noqa: F401

    where = Path(megatron.core.__file__).resolve().parent.parent.parent
    if root is not None and where != Path(root).resolve():
        raise RuntimeError(f"megatron.core was imported from {where}, not from the chosen tree {root}")
    return {"root": str(where), "state": patch.overall_state(patch.check_patch(where)),
            "version": patch.megatron_version(where)}


def _cpu_stock_kernels() -> None:
    """CPU dry run only: stock 0.19.2's non-deterministic path calls FLA's Triton kernels
    (``causal_conv1d`` and ``chunk_gated_delta_rule`` on ``[B, S, ...]`` with optional
    ``cu_seqlens``). Point those names at gdn-cp's plain-torch reference kernels so the stock
    code runs on the CPU, packed THD included (its deterministic path refuses THD). Same math;
    on a GPU nothing is replaced."""
    import megatron.core.ssm.gated_delta_net.gdn as gdn_module

    ref = get_backend("reference")

    def boundaries(b, s, cu_seqlens):
        return [i * s for i in range(b + 1)] if cu_seqlens is None else [int(c) for c in cu_seqlens.tolist()]

    def causal_conv1d(x, weight, bias=None, activation=None, initial_state=None, output_final_state=False,
                      cu_seqlens=None, **_):
        b, s, d = x.shape
        act = "silu" if activation in ("silu", "swish") else activation
        y = ref.causal_conv1d(x.reshape(b * s, d), weight, bias, cu_seqlens=boundaries(b, s, cu_seqlens),
                              activation=act)
        return y.reshape(b, s, d), None

    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, **_):
        b, s = q.shape[:2]
        flat = lambda t: t.reshape(b * s, *t.shape[2:])  # noqa: E731
        o, _ = ref.chunk_gated_delta_rule(flat(q), flat(k), flat(v), flat(g), flat(beta),
                                          cu_seqlens=boundaries(b, s, cu_seqlens), scale=scale,
                                          use_qk_l2norm=use_qk_l2norm_in_kernel)
        return o.reshape(b, s, *o.shape[1:]), None

    gdn_module.causal_conv1d = causal_conv1d
    gdn_module.chunk_gated_delta_rule = chunk_gated_delta_rule


def gdn_config(cp: int, dims: GDNDims, dtype: torch.dtype, patched: bool, spec: str = "local", backend: str = "auto"):
    """TransformerConfig of one GDN layer (``make_config`` at ``dims``). Stock megatron has no ``linear_cp_*``
    fields; the patched layer is built chunkwise (legal for any head count; set per case), its THD rows cut per
    document (``zigzag_rows``), on gdn-cp's ``backend``. The te spec's modules are built on the GPU, as in
    training (and as the GPU parity tests build them); the weights are set afterwards either way."""
    gdn_cp = dict(linear_cp_thd_split="per_document", linear_cp_backend=backend) if patched else {}
    return make_config(cp, "chunkwise" if patched else None, dtype, deterministic_mode=False, hidden_size=dims.hidden,
                       num_attention_heads=dims.num_k_heads, linear_num_key_heads=dims.num_k_heads,
                       linear_num_value_heads=dims.num_v_heads, linear_key_head_dim=dims.head_k_dim,
                       linear_value_head_dim=dims.head_v_dim, linear_conv_kernel_dim=dims.conv_width,
                       use_cpu_initialization=spec != "te", **gdn_cp)


def _timing_group(ctx):
    """A gloo group over the pool for host-side barriers (no kernel on the GPU timeline)."""
    if ctx.backend == "gloo":
        return ctx.group(ctx.world_size)
    return dist.new_group(list(range(ctx.world_size)), backend="gloo")


def rank_setup(ctx, spec: dict) -> dict:
    """Choose the megatron tree, build the layers, report versions. First task of every pool."""
    mega = _select_megatron(spec["megatron_root"])
    want = spec["expect_state"]
    if mega["state"] != want:
        raise RuntimeError(f"megatron-core at {mega['root']} is {mega['state']}, this pool needs it {want}")
    device = ctx.device
    if device.type == "cpu":
        install_cpu_shims()
        _cpu_stock_kernels()
    else:
        install_gpu_shims()
    dims = GDNDims(**spec["dims"])
    dtype = getattr(torch, spec["dtype"])
    patched = want == "patched"
    cp = ctx.world_size
    build = dict(seed=spec["seed"], bias=False, conv_bias=False, device=device)
    _STATE.clear()
    layers, spec_errors = {}, {}
    for name in spec.get("specs", ["local"]):
        # a spec that cannot be built here (te without TransformerEngine) fails its own rows, not the pool
        try:
            backend = spec.get("linear_cp_backend", "auto")
            layer1 = build_gdn(gdn_config(1, dims, dtype, patched, name, backend), ctx.group(1), spec=name, **build)
            layer = layer1 if cp == 1 else build_gdn(gdn_config(cp, dims, dtype, patched, name, backend), ctx.group(cp),
                                                     spec=name, **build)
            layers[name] = {"layer": layer, "layer1": layer1}
        except Exception as err:  # noqa: BLE001 - reported per spec
            spec_errors[name] = f"building the layer failed: {type(err).__name__}: {err}"
    _STATE.update(
        ctx=ctx, device=device, dims=dims, dtype=dtype, cp=cp, patched=patched, barrier_group=_timing_group(ctx),
        layers=layers, reference=None,
    )
    if patched:
        _count_fused_norm_calls()
    info = {"rank": ctx.rank, "dist_backend": ctx.backend, "device": str(device), "megatron": mega,
            "torch": torch.__version__, "torch_cuda": torch.version.cuda, "pid": os.getpid(),
            "spec_errors": spec_errors, "transformer_engine": dist_version("transformer-engine")}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / GIB, 1),
                    capability=list(torch.cuda.get_device_capability(device)))
    info.update(fla=fla_version(), fla_available=fla_available(), triton=dist_version("triton"),
                fast_autotune=os.environ.get("GDN_CP_TEST_FAST_AUTOTUNE") == "1")
    return info


# ---- levers: what ran, and the benchmark-side switch ----

_FUSED_NORM_CALLS = [0]


def _count_fused_norm_calls() -> None:
    """Count calls of gdn-cp's fused gated norm (``gdn_cp.ops.fla.norm.gated_rms_norm``, what the FLA
    backend's ``fused_gated_rms_norm()`` hands the glue), so each row says which norm path its step
    really took. Installed before any layer runs (the glue keeps the function it was given)."""
    try:
        import gdn_cp.ops.fla.norm as norm
    except Exception:  # noqa: BLE001 - without it every row says "unknown"
        return
    inner = norm.gated_rms_norm
    if getattr(inner, "_layer_full_counted", False):
        return

    def counted(*args, **kwargs):
        _FUSED_NORM_CALLS[0] += 1
        return inner(*args, **kwargs)

    counted._layer_full_counted = True
    norm.gated_rms_norm = counted


@contextlib.contextmanager
def _switched(modules, patches, forget):
    """Run with ``patches`` (``unittest.mock`` patchers, undone on exit) in force; ``forget(module)`` on entry and
    on exit drops what each layer decided under the other setting, so the rows before and after decide afresh."""
    with contextlib.ExitStack() as stack:
        for m in modules:
            forget(m)
        stack.callback(lambda: [forget(m) for m in modules])  # after the patches are undone
        for patcher in patches:
            stack.enter_context(patcher)
        yield


def fused_norm_off(modules):
    """Benchmark-only switch (never a library flag): the Megatron glue takes the layer's own
    ``out_norm * act(z)`` instead of the fused gated RMSNorm, because its release adapter's
    ``plain_rms_gated_norm`` reports the norm as not plain (the layers' choice, ``LayerState.gated_norms``,
    forgotten around it)."""
    off = lambda self: (None, None, "switched off by layer_full.py --levers fused_norm")  # noqa: E731
    return _switched(modules, [mock.patch.object(cls, "plain_rms_gated_norm", off)
                               for cls in {type(layer_state(m).adapter) for m in modules}],
                     lambda m: layer_state(m).gated_norms.clear())


LEVER_SWITCHES = {
    "fused_norm": fused_norm_off,
    # the glue path ``path`` (GDN_CP_GLUE, gdn_cp.ops.fused) instead of the default; the layers read their settings again
    **{lever: lambda modules, path=path: _switched(modules, [mock.patch.dict(os.environ, GDN_CP_GLUE=path)],
                                                    reset_settings)
       for lever, path in GLUE_LEVERS.items()},
    "split_cat": lambda modules: _switched(modules, [mock.patch.object(split, "GRAD_INTO_CONSUMER_BUFFER", False)],
                                           lambda m: None),
    "key_heads_by_backend": lambda modules: _switched(
        modules, [mock.patch.object(glue, "REPEAT_KEY_HEADS_IN_CONV", False)], lambda m: None),
    "narrow_copy": lambda modules: _switched(modules, [mock.patch.object(split, "WIDE_COLUMN_COPY", False)],
                                             lambda m: None),
    **{lever: lambda modules, on=on: _switched(modules, [mock.patch(f"gdn_cp.ops.fused.triton_conv.{f}", True) for f in on], lambda m: None)
       for lever, on in (("halo_apart", ("HALO_ROWS_APART", "SCAN_HALO_TAIL")), ("scan_branch", ("SCAN_BRANCH_MASKS",)),
                         ("scan_branch_ftz", ("SCAN_BRANCH_MASKS", "FTZ_SIGMOID")))},
}
"""A lever row runs with its switch: what each one switches is said once, at ``layer_full_math.LEVERS``."""


def _modules_of(module) -> dict:
    """The classes of the layer's submodules, ``module.qualname``."""
    return {name: f"{type(getattr(module, name)).__module__}.{type(getattr(module, name)).__qualname__}"
            for name in ("in_proj", "out_norm", "out_proj") if getattr(module, name, None) is not None}


def fla_gdn_backend() -> str:
    """Which implementation FLA dispatches ``chunk_gated_delta_rule`` to for a call without a cp
    context: FLA >= 0.6 registers backends (FlashQLA on TileLang, enabled by default when
    ``flash_qla`` imports; ``FLA_FLASH_QLA=0`` turns it off); otherwise FLA's Triton kernels."""
    active = [b["name"] for b in gdn_kernel_backends() if b["available"] and b["enabled"]]
    return active[0] if active else "triton"


# ---- one case ----

def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier() -> None:
    dist.barrier(group=_STATE["barrier_group"])


def _randn(shape, seed: int, dtype, device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def _layer_inputs(t: int, seed: int, rows=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's input (requiring grad) and output gradient: the same ``t`` rows on every rank and in both pools,
    then ``rows`` of them (all when None)."""
    st = _STATE
    x, dout = (_randn((t, 1, st["dims"].hidden), seed + k, st["dtype"], st["device"]) for k in (1, 2))
    if rows is not None:
        x, dout = x.index_select(0, rows), dout.index_select(0, rows)
    return x.requires_grad_(True), dout


def _rows(case: str, layout: str, cu, cp: int, rank: int, device) -> torch.Tensor:
    """Global rows this rank feeds the layer: its zigzag rows, or its contiguous slice (cp1_slice;
    ``*_slice`` pass the slice's CP size and rank as ``cp`` and ``rank``), or all rows (``*_cp1``)."""
    t_local = cu[-1] // cp
    if case == "cp1_slice" or case in SLICE_CASES:
        return torch.arange(rank * t_local, (rank + 1) * t_local, device=device)
    if case in ("stock_cp1", "patched_cp1"):
        return torch.arange(cu[-1], device=device)
    return zigzag_rows(cu if layout == "thd" else [0, cu[-1]], cp, rank).to(device)


def _set_mode(case: str, layers: dict) -> None:
    """The patched layer's mode for ``case`` (config field), swap point and chunkwise path
    (``chunkwise_generic``: gdn-cp's own exchange; every other case: ``auto``), in this rank process's
    environment; the layers read them again on their next call (``reset_settings``)."""
    mode = {"headwise": "headwise", "all_gather": "all_gather"}.get(case, "chunkwise")
    layers["layer"].config.linear_cp_mode = mode
    layers["layer1"].config.linear_cp_mode = mode
    os.environ["GDN_CP_CHUNKWISE_SWAP"] = {"chunkwise_hidden": "hidden", "chunkwise_core": "core",
                                           "chunkwise_generic": "hidden"}.get(case, "auto")
    os.environ["GDN_CP_CHUNKWISE_PATH"] = "generic" if case == "chunkwise_generic" else "auto"
    for layer in (layers["layer"], layers["layer1"]):
        reset_settings(layer)


class _Case:
    """What one rank runs for one case: the layer's inputs and step, and the core's."""

    def __init__(self, spec: dict):
        st = _STATE
        ctx, device = st["ctx"], st["device"]
        self.case, self.layout, self.cu = spec["case"], spec["layout"], list(spec["cu"])
        cp, rank = st["cp"], ctx.rank
        self.sliced = self.case == "cp1_slice" or self.case in SLICE_CASES  # CP=1 on a contiguous slice
        if self.case in SLICE_CASES:  # --cp 1: one rank plays rank slice_rank of a CP=slice_of_cp run
            cp, rank = spec["slice_of_cp"], spec["slice_rank"]
        t = self.cu[-1]
        self.spec = spec.get("spec") or "local"
        if self.spec not in st["layers"]:
            raise RuntimeError(f"spec {self.spec} was not built in this pool (built: {sorted(st['layers'])})")
        layers = st["layers"][self.spec]
        self.lever_off = spec.get("lever_off")
        if (self.case in STOCK_CASES) == st["patched"] or (self.lever_off and self.case in STOCK_CASES):
            raise RuntimeError(f"case {self.case} (lever off: {self.lever_off}) cannot run in this pool "
                               f"({'patched' if st['patched'] else 'pristine'} megatron-core; a lever is gdn-cp's)")
        if self.case not in STOCK_CASES:
            _set_mode(self.case, layers)
        self.layer1 = layers["layer1"]
        self.module = layers["layer1"] if self.sliced else layers["layer"]
        self.rows = _rows(self.case, self.layout, self.cu, cp, rank, device)
        self.x, self.dout = _layer_inputs(t, spec["seed"], self.rows)
        if self.sliced:
            self.local_cu = contiguous_slice(self.cu, cp, rank)
            self.psp = thd_params(self.local_cu, device=device)  # the slice's pieces, THD at CP=1
        else:
            self.local_cu = None
            self.psp = thd_params(self.cu, device=device) if self.layout == "thd" else None
        self.group = None if self.sliced or st["cp"] == 1 else ctx.group(cp)

    def step(self):
        """One forward + backward of the layer, as a training step runs it (gradients reset)."""
        self.module.zero_grad(set_to_none=True)
        self.x.grad = None
        out, bias = self.module(self.x, None, packed_seq_params=self.psp)
        y = out if bias is None else out + bias
        y.backward(self.dout)
        return y

    def chunkwise_path(self) -> str | None:
        if not self.case.startswith("chunkwise"):
            return None
        if self.group is None:  # no CP: no exchange
            return "generic"

        state = layer_state(self.module)
        call = CallContext(settings=state.settings, shape=state.shape, plan=RouteCache().plan([0, 2 * self.group.size()],
                           self.group.size(), self.group.rank()), group=self.group,
                           backend=state.backend)
        if not prepare_mode(call).path.startswith("native"):
            return "generic"
        return call.backend.name  # whose exchange runs: "fla" or "flashqla"

    # -- the core alone ------------------------------------------------------------------------
    def core_step(self, seed: int):
        """``step`` for the core alone (``gdn_cp.modes.gdn_core``: conv + gated delta rule under
        the case's mode, with its layout changes and exchanges), on random q|k|v and gates and
        the layer's own conv weight. None for stock (its core is inline in its forward)."""
        if self.case in STOCK_CASES:
            return None

        st = _STATE
        m, device, dtype, cp, rank = self.module, st["device"], st["dtype"], st["cp"], st["ctx"].rank
        shape = GDNShape(m.num_k_heads_local_tp, m.num_v_heads_local_tp, m.key_head_dim, m.value_head_dim,
                         qk_l2norm=m.use_qk_l2norm)
        group = self.group  # None: CP=1 on a slice or (--cp 1) on the whole packing
        if group is not None and self.layout == "sbhd":
            plan = plan_for_sbhd(self.cu[-1], 1, cp, rank)
        elif group is not None:
            plan = RouteCache().plan(torch.tensor(self.cu), cp, rank)
        else:
            cu = self.local_cu or (self.cu if self.layout == "thd" else [0, self.cu[-1]])
            plan = RouteCache().plan(torch.tensor(cu), 1, 0)
        settings = layer_state(m).settings
        # chunkwise with its swap at hidden_states: its core takes rows already contiguous
        contiguous = self.case in ("chunkwise_hidden", "chunkwise_generic") and group is not None
        n = plan.t_local
        qkv = _randn((n, shape.conv_dim), seed + 11, dtype, device).requires_grad_(True)
        g = (-F.softplus(_randn((n, shape.num_v_heads), seed + 12, torch.float32, device)) * 0.3).requires_grad_(True)
        beta = torch.sigmoid(_randn((n, shape.num_v_heads), seed + 13, torch.float32, device)).to(dtype)
        beta.requires_grad_(True)
        do = _randn((n, shape.num_v_heads, shape.head_v_dim), seed + 14, dtype, device)
        weight = m.conv1d.weight
        bias = m.conv1d.bias if m.conv_bias else None
        backend = layer_state(m).backend
        call = CallContext(settings=settings, shape=shape, plan=plan, group=group, backend=backend)
        way = prepare_mode(call)

        def step():
            m.zero_grad(set_to_none=True)
            for t in (qkv, g, beta):
                t.grad = None
            w = weight.reshape(weight.shape[0], -1)
            if contiguous:
                o = way.contiguous_core(call, qkv, g, beta, w, bias)
            else:
                o = gdn_core(qkv, g, beta, w, bias, shape=shape, mode=settings.mode, plan=plan, group=group,
                             backend=backend, chunkwise_path=settings.chunkwise_path)
            o.backward(do)

        return step


def _free() -> None:
    """Between cases on a GPU: drop reference cycles and cached blocks, so that one case's
    memory does not count in the next one's peak (on the CPU there is no peak to protect)."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def rank_case(ctx, spec: dict) -> dict:
    """One case, one phase (``compile`` or ``time``) on this rank. A ValueError of the first call
    (raised before any collective, on every rank alike) is returned as ``refused``."""
    st = _STATE
    if spec["phase"] == "time":
        st["reference"] = None  # free the CP=1 reference: it must not count in peak memory
    _free()
    case = _Case(spec)
    switch = LEVER_SWITCHES[case.lever_off]([case.module, case.layer1]) if case.lever_off else contextlib.nullcontext()
    with switch:
        try:
            return _run_case(ctx, case, spec)
        finally:
            _free()


def _run_case(ctx, case: "_Case", spec: dict) -> dict:
    st = _STATE
    device = st["device"]
    out = {"rank": ctx.rank, "t_local": int(case.rows.numel()), "chunkwise_path": case.chunkwise_path()}
    if spec["phase"] == "compile":
        _sync(device)
        _barrier()
        _FUSED_NORM_CALLS[0] = 0
        t0 = time.perf_counter()
        try:
            y = case.step()
        except ValueError as err:
            return {**out, "refused": f"{type(err).__name__}: {err}"}
        _sync(device)
        out["compile_s"] = time.perf_counter() - t0
        out["modules"] = _modules_of(case.module)
        if case.case in STOCK_CASES:
            out["norm_path"] = "stock: out_norm(o) * act(z) (_apply_gated_norm)"
        else:
            out["norm_path"] = ("fused: FLA rms_norm_gated" if _FUSED_NORM_CALLS[0] else
                                "unfused: the layer's out_norm(o) * act(z)")
            # what ran: the glue path (GDN_CP_GLUE, resolved), the backend, whether the conv repeated q and k for it
            state, dims = layer_state(case.module), st["dims"]
            out["glue"], out["gdn_cp_backend"] = glue_path(state.settings.glue, y), state.backend.name
            out["key_heads_in_glue"] = kv_repeat(out["glue"], state.backend, dims.num_k_heads, dims.num_v_heads) > 1
            out["wide_column_copy"] = split.WIDE_COLUMN_COPY
            conv = sys.modules.get("gdn_cp.ops.fused.triton_conv")  # imported where the Triton glue ran
            out.update({flag.lower(): getattr(conv, flag) if conv is not None else None
                        for flag in ("HALO_ROWS_APART", "SCAN_BRANCH_MASKS", "FTZ_SIGMOID")})
        if device.type == "cuda":
            try:
                out["fla_gdn_backend"] = fla_gdn_backend()
            except Exception as err:  # noqa: BLE001
                out["fla_gdn_backend"] = f"unknown ({type(err).__name__}: {err})"
        if st["cp"] == 1 and case.case not in STOCK_CASES:  # every case is checked
            out["check"] = _check_vs_stock(case)
        elif case.case != "cp1_slice" and st["cp"] > 1:
            out["check"] = _check(case, y, spec)
        del y
        core = case.core_step(spec["seed"]) if spec["core"] else None
        if core is not None:
            t0 = time.perf_counter()
            core()
            _sync(device)
            out["core_compile_s"] = time.perf_counter() - t0
        return out

    out.update(_timed(case.step, spec["warmup"], spec["iters"], device))
    if device.type == "cuda":
        out["memory"] = _memory_split(case, device)
    # The profile and the core explain the timing above; a failure there (the same on every rank:
    # both start from a barrier) is recorded and must not lose it.
    if spec["profile_iters"] > 0 and device.type == "cuda":
        try:
            out["profile"] = _profiled(case.step, spec["profile_iters"], device)
        except Exception as err:  # noqa: BLE001
            out["profile"] = {"error": f"{type(err).__name__}: {err}"}
    core = case.core_step(spec["seed"]) if spec["core"] else None
    if core is not None:
        try:
            timed = _timed(core, spec["warmup"], spec["iters"], device)
            out["core"] = {"iter_ms": timed["iter_ms"], "peak_gib": timed.get("peak_gib")}
        except Exception as err:  # noqa: BLE001
            out["core_error"] = f"{type(err).__name__}: {err}"
    return out


def _memory_split(case: "_Case", device) -> dict:
    """One more fwd+bwd, GiB above what was allocated before it: what the forward keeps for the
    backward (allocated after the forward, the output included) and the high-water marks of the
    forward alone and of the whole step. Says where the peak is and what holds it."""
    case.module.zero_grad(set_to_none=True)
    case.x.grad = None
    _sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out, bias = case.module(case.x, None, packed_seq_params=case.psp)
    y = out if bias is None else out + bias
    _sync(device)
    saved = torch.cuda.memory_allocated(device) - base
    peak_fwd = torch.cuda.max_memory_allocated(device) - base
    y.backward(case.dout)
    del out, bias, y
    _sync(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    return {"base_gib": base / GIB, "saved_after_forward_gib": saved / GIB, "peak_in_forward_gib": peak_fwd / GIB,
            "peak_gib": peak / GIB, "peak_in": "forward" if peak_fwd >= peak else "backward"}


def _timed(step, warmup: int, iters: int, device) -> dict:
    """``warmup`` untimed then ``iters`` timed calls of ``step`` (:func:`benchmarks.measure.timed_steps`),
    each after a device synchronize and a host barrier; on CUDA, the peaks over the timed ones (GiB)."""
    def before():
        _sync(device)
        _barrier()

    timed_steps(step, warmup, 0, device, before)
    _sync(device)
    out = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        out["allocated_before_gib"] = torch.cuda.memory_allocated(device) / GIB
    out["iter_ms"] = timed_steps(step, 0, iters, device, before)
    if device.type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
    return out


# ---- profile ----

def _profiled(step, n: int, device) -> dict:
    """``n`` iterations under torch.profiler (1 wait, 1 warm-up, ``n`` active; CUDA activity): from their kernels and
    CUDA-event walls, per iteration, compute + nccl + memcpy + idle = wall; idle by cause (:func:`idle_causes`; ``start``:
    the rest, the host reaching an iteration's first kernel: a layer timed alone, not in a model's run)."""
    trace: dict = {}

    def on_ready(prof):
        with tempfile.TemporaryDirectory(prefix="layer_full_trace_") as folder:
            prof.export_chrome_trace(f"{folder}/trace.json")
            trace["data"] = json.loads(Path(folder, "trace.json").read_text())

    with profile(activities=[ProfilerActivity.CUDA], schedule=schedule(wait=1, warmup=1, active=n, repeat=1),
                 on_trace_ready=on_ready) as prof:
        calls = [0]

        def before():  # the profiler steps after every call: ahead of each call but the first, and at the end
            if calls[0]:
                prof.step()
            calls[0] += 1
            _sync(device)
            _barrier()

        walls = timed_steps(step, 0, n + 2, device, before)[2:]
        prof.step()
    if "data" not in trace:
        return {"error": "the profiler produced no trace"}
    spans, by_name = spans_from_trace(trace["data"])
    split = split_busy_time(spans, sum(walls) * 1e3)  # us over the n iterations
    per_iter = {k: v / 1e3 / n for k, v in split.items()}  # ms per iteration
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]
    causes = idle_causes(trace["data"], n)
    causes["start"] = max(0.0, per_iter["idle"] - sum(v for k, v in causes.items() if k != "late"))
    return {"iters": n, "wall_ms_iters": walls, **{f"{k}_ms": v for k, v in per_iter.items()},
            "kernels": {c: len(s) // n for c, s in spans.items()}, "top_kernels_ms": [[k, us / 1e3 / n] for k, us in top],
            "classes_ms": kernel_classes(by_name, split["idle"], n), "idle_causes_ms": causes}


# ---- correctness: the case against CP=1 on the same weights and inputs ----

def _errors(errs: dict, **extra) -> dict:
    """A parity check's ``{"out", "grad:hidden_states", "grad:<param>"}`` (relative L2) as a row's: the output, the
    input gradient and the parameter gradient furthest from the reference (:func:`gdn_cp.ops.accuracy.worst`)."""
    name, err = worst({k[5:]: v for k, v in errs.items() if k.startswith("grad:") and k != "grad:hidden_states"})
    return {"out": errs["out"], "grad_x": errs["grad:hidden_states"], "grad_params": err, "worst_param": name, **extra}


def _check_vs_stock(case: _Case) -> dict:
    """``--cp 1``: the patched case against stock megatron-core's code (``stock_vs_patched``: gdn-cp's hand-over
    off) on the same module and rows."""
    errs = stock_vs_patched(case.module, case.x, case.dout, None, metric=rel_l2, packed_seq_params=case.psp)
    return _errors(errs, against="stock megatron-core, same module and rows")


def _reference(spec: dict) -> dict:
    """CP=1 on the whole micro-batch (``layer1``: this pool's megatron at CP=1), kept until the time phase:
    ``(out, x.grad, grads)``."""
    key = (spec["layout"], tuple(spec["cu"]), spec["seed"], spec.get("spec") or "local")
    ref = _STATE.get("reference")
    if ref is not None and ref[0] == key:
        return ref[1]
    _STATE["reference"] = None
    _free()
    module = _STATE["layers"][spec.get("spec") or "local"]["layer1"]
    x, dout = _layer_inputs(spec["cu"][-1], spec["seed"])
    psp = thd_params(spec["cu"], device=_STATE["device"]) if spec["layout"] == "thd" else None
    _STATE["reference"] = (key, run_layer(module, x, dout, psp))
    module.zero_grad(set_to_none=True)
    return _STATE["reference"][1]


def _check(case: _Case, y, spec: dict) -> dict:
    """This rank's output rows and input-gradient rows, and every parameter gradient summed over the CP group,
    against CP=1 (relative L2). Run right after the case's first step."""
    grads = {n: p.grad for n, p in case.module.named_parameters()}  # summed in place: the next step resets them
    got = (y.detach(), case.x.grad.detach(), sum_grads(grads, case.group))
    return _errors(compare(got, _reference(spec), case.rows, metric=rel_l2))
