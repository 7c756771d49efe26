"""GPU version of the GatedDeltaNet parity suite: the patched megatron-core 0.19.2 GatedDeltaNet on
each GPU backend (``linear_cp_backend``: FLA at head dim 64, FlashQLA at head dim 128, the only one it
takes; FlashQLA's cases skip with the reason where it cannot run), deterministic_mode=False, bf16, CP=2 and CP=4 as gloo ranks on one GPU (NCCL
with one rank per GPU when there are enough GPUs), against the same module at CP=1 (SBHD: stock
0.19.2's FLA path; THD: gdn-cp's path at CP=1), every ``linear_cp_mode``, SBHD (batch 2 and 1) and THD
(cut per document and as a whole row), with the layer's submodules from Megatron's local modules and
from Megatron's own TransformerEngine spec (``get_gated_delta_net_module_spec``; skipped with the
reason where TransformerEngine is not installed); chunkwise
through both exchange paths (FLA's cp context, ``native``, and gdn-cp's own, ``generic``) at both
swap points, SBHD at batch 2 and 1 and THD cut per document and as a whole row (SBHD at batch 1 and
whole-row THD are one zigzag-cut stream: FLA >= 0.6's zigzag cp context, no all-to-all); plus stock vs
patched headwise (SBHD, CP=2).

Marked ``gpu``: skipped with a reason on CPU-only machines; run it
on the device machine with::

    python3 -m pytest tests/megatron/test_gpu_parity.py -q

Skipped with a reason without CUDA + flash-linear-attention. Nothing FLA-specific is imported at
module import. Errors are relative L2 (||a-b|| / ||b||) and are appended as JSON lines to
``$GDN_CP_GPU_RESULTS`` when set. Tolerances (bf16): outputs 2e-2, gradients 3e-2 (the CP=1 answer
is itself bf16: both sides carry bf16 rounding of activations and of the per-rank parameter
gradients that are summed over CP).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from gdn_cp_testing.megatron.parity import GPU_CFG, MODES, parity_case
from gdn_cp.ops.accuracy import rel_l2
from gdn_cp_testing.results import JsonlRecorder
from gdn_cp.ops.accuracy import MEGATRON_BF16_REL_L2 as BF16_TOL

pytestmark = [pytest.mark.gpu, pytest.mark.megatron]

def _require_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (FLA backend); the CPU suite is test_gdn_parity.py")
    if importlib.util.find_spec("fla") is None:
        pytest.skip("needs flash-linear-attention (fla) installed")


def _require_spec(spec: str) -> None:
    """``te``: Megatron's own GDN spec needs TransformerEngine (never installed on CPU machines; the GPU
    suite unpacks the slim-te pack: ``.te/`` beside the wheels)."""
    if spec == "te" and importlib.util.find_spec("transformer_engine") is None:
        pytest.skip("needs TransformerEngine (spec='te': Megatron's get_gated_delta_net_module_spec); "
                    "the GPU suite installs it from the slim-te pack in .te/")


SPECS = ("local", "te")
# (layout, SBHD batch) of the every-mode parity: SBHD at batch 2 and 1, THD cut per document and as a
# whole row (documents of odd lengths, linear_cp_thd_split='whole_row')
MODE_CASES = (("sbhd", 2), ("sbhd", 1), ("thd", 1), ("thd_whole_row", 1))


_record = JsonlRecorder.from_env("GDN_CP_GPU_RESULTS").record


@pytest.fixture(scope="module")
def gpu_pools(rank_pool):
    """``gpu_pools(world)``: the session's CUDA rank pool of that size (after the GPU check)."""
    _require_gpu()
    return lambda world: rank_pool(world, device="cuda")


# The per-rank math backends the layer parity runs on: FLA (GPU_CFG's head dims 64; what auto takes
# where FlashQLA is absent or refuses them) and FlashQLA (head dims 128, the only ones it takes).
BACKENDS = ("fla", "flashqla")


def _backend_cfg(backend: str) -> dict:
    if backend == "fla":
        return GPU_CFG
    return dict(GPU_CFG, linear_key_head_dim=128, linear_value_head_dim=128, linear_cp_backend=backend)


def _require_backend(backend: str) -> None:
    if backend == "flashqla":
        from gdn_cp.ops.flashqla.detect import flashqla_problem

        why = flashqla_problem()
        if why is not None:
            pytest.skip(f"FlashQLA backend: {why}")


def _chosen(ctx, cfg: dict) -> str:
    """The backend the layers' forward runs (the registry's answer for the config's request)."""
    from gdn_cp.ops.registry import resolve_backend

    return resolve_backend(cfg.get("linear_cp_backend", "auto"), ctx.device.type,
                           head_dims=(cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]), dtype="bfloat16")[0]


def _gpu_cases(ctx, spec: str, backend: str = "fla"):
    out = {"cases": {}}
    base = _backend_cfg(backend)
    for layout, batch in MODE_CASES:
        cfg = dict(base, linear_cp_thd_split="whole_row") if layout == "thd_whole_row" else base
        name = f"{layout}{batch if layout == 'sbhd' else ''}"
        out["cases"][name] = parity_case(ctx.rank, ctx.world_size, layout, torch.bfloat16, MODES, cfg=cfg,
                                         device=ctx.device, metric=rel_l2, bias=False, conv_bias=False,
                                         sbhd_batch=batch, spec=spec)
    out["backend"] = _chosen(ctx, base)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("world", [2, 4])
def test_gpu_parity_bf16(gpu_pools, patched_megatron, world, spec, backend):
    _require_spec(spec)
    _require_backend(backend)
    results = gpu_pools(world).run(_gpu_cases, spec, backend)
    assert results[0]["backend"] == backend, results[0]["backend"]
    bad = []
    for rank, res in enumerate(results):
        for layout, per_mode in res["cases"].items():
            for mode, errs in per_mode.items():
                _record("megatron_gdn_parity", world=world, rank=rank, layout=layout, mode=mode, spec=spec,
                        backend=backend, errors=errs)
                for k, v in errs.items():
                    tol = BF16_TOL["out"] if k == "out" else BF16_TOL["grad"]
                    if not v <= tol:
                        bad.append(f"rank {rank} {layout} {mode} {k}: {v:.3e} > {tol}")
    assert not bad, "\n".join(bad)


def _stock_vs_patched(ctx):
    from gdn_cp_testing.inputs import hidden_inputs
    from gdn_cp_testing.megatron.layer import build_gdn, make_config, rank_groups, stock_vs_patched
    from gdn_cp_testing.megatron.parity import sbhd_len
    from gdn_cp_testing.packings import zigzag_rows

    group = rank_groups()["world"]
    s = sbhd_len(ctx.world_size)
    x, dout = hidden_inputs(s, 2, torch.bfloat16, 13, GPU_CFG["hidden_size"], ctx.device)
    rows = zigzag_rows([0, s], ctx.world_size, ctx.rank).to(ctx.device)
    x, dout = x[rows], dout[rows]
    cfg = make_config(ctx.world_size, "headwise", torch.bfloat16, **GPU_CFG)
    module = build_gdn(cfg, group, seed=4, device=ctx.device)
    return stock_vs_patched(module, x, dout, group, rel_l2)


def test_gpu_stock_vs_patched_headwise(gpu_pools, patched_megatron):
    results = gpu_pools(2).run(_stock_vs_patched)
    bad = []
    for rank, errs in enumerate(results):
        _record("megatron_gdn_stock_vs_patched", world=2, rank=rank, errors=errs)
        for k, v in errs.items():
            tol = BF16_TOL["out"] if k == "out" else BF16_TOL["grad"]
            if not v <= tol:
                bad.append(f"rank {rank} {k}: {v:.3e} > {tol}")
    assert not bad, "\n".join(bad)


# (layout, SBHD batch): SBHD at batch 1 and THD cut as a whole row (documents of odd lengths,
# linear_cp_thd_split='whole_row') are one zigzag-cut stream per rank, which FLA >= 0.6's zigzag cp
# context takes with no layout all-to-all on the native path; the others are routed.
PATH_CASES = (("sbhd", 2), ("sbhd", 1), ("thd", 1), ("thd_whole_row", 1))
ONE_STREAM = ("sbhd1", "thd_whole_row")


def _gpu_path_cases(ctx, path: str, spec: str = "local", backend: str = "fla"):
    """chunkwise with the exchange path forced (``native``: FLA's cp context, which on gloo ranks of
    one GPU runs through the rank pool's collective adapter; ``generic``: gdn-cp's own exchange,
    asynchronous and overlapped with the scans on NCCL), at both swap points, SBHD and THD."""
    import torch.distributed as dist

    from gdn_cp.layout import plan_for_sbhd
    from gdn_cp.modes import CallContext, GDNShape, Settings, prepare_mode
    from gdn_cp.ops import get_backend
    from gdn_cp_testing.megatron.layer import rank_groups
    from gdn_cp_testing.megatron.parity import sbhd_len
    from gdn_cp_testing.probes import env_setting

    out = {}
    base = _backend_cfg(backend)
    out["backend"] = _chosen(ctx, base)
    kernels = get_backend(out["backend"])
    settings = Settings(mode="chunkwise", chunkwise_path=path)
    shape = GDNShape(num_k_heads=base["linear_num_key_heads"], num_v_heads=base["linear_num_value_heads"],
                     head_k_dim=base["linear_key_head_dim"], head_v_dim=base["linear_value_head_dim"])
    world = rank_groups()["world"]

    def way(batch):  # the chunkwise way the forward takes for SBHD at this batch (host-side, no collective)
        plan = plan_for_sbhd(sbhd_len(ctx.world_size), batch, ctx.world_size, ctx.rank)
        return prepare_mode(CallContext(settings=settings, shape=shape, plan=plan, group=world, backend=kernels)).path

    out["path"] = way(2)  # documents cut on their own: "native" or "generic"
    out["zigzag_for_sbhd1"] = way(1) == "native-zigzag"
    out["dist_backend"] = dist.get_backend()
    with env_setting("GDN_CP_CHUNKWISE_PATH", path):
        for swap in ("hidden", "core"):
            with env_setting("GDN_CP_CHUNKWISE_SWAP", swap):
                for layout, batch in PATH_CASES:
                    a2a = ctx.collectives.get("all_to_all_single", 0)
                    cfg = dict(base, linear_cp_thd_split="whole_row") if layout == "thd_whole_row" else base
                    errs = parity_case(
                        ctx.rank, ctx.world_size, layout, torch.bfloat16, ("chunkwise",), cfg=cfg,
                        device=ctx.device, metric=rel_l2, bias=False, conv_bias=False, sbhd_batch=batch,
                        spec=spec)["chunkwise"]
                    out[f"{layout}{batch if layout == 'sbhd' else ''}/{swap}"] = {
                        "errors": errs, "all_to_alls": ctx.collectives.get("all_to_all_single", 0) - a2a}
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("path", ["native", "generic"])
def test_gpu_parity_chunkwise_paths(gpu_pools, patched_megatron, path, world, spec, backend):
    from gdn_cp.ops.fla.detect import has_zigzag_layout

    _require_spec(spec)
    _require_backend(backend)
    if backend == "flashqla" and path == "native":
        from gdn_cp.ops.flashqla.native_cp import native_cp_problem

        if native_cp_problem() is not None:
            pytest.skip(f"FlashQLA's native chunkwise core: {native_cp_problem()}")
    results = gpu_pools(world).run(_gpu_path_cases, path, spec, backend)
    bad = []
    for rank, res in enumerate(results):
        assert res["path"] == path and res["backend"] == backend, (res["path"], res["backend"])
        zigzag = path == "native" and backend == "fla" and has_zigzag_layout()  # FlashQLA has no zigzag layout
        assert res["zigzag_for_sbhd1"] == zigzag, res
        for case, got in res.items():
            if not isinstance(got, dict):
                continue
            errs = got["errors"]
            _record("megatron_gdn_parity_path", world=world, rank=rank, path=path, case=case, spec=spec, backend=backend,
                    zigzag=zigzag and case.startswith(ONE_STREAM), dist=res["dist_backend"], errors=errs,
                    all_to_alls=got["all_to_alls"])
            for k, v in errs.items():
                tol = BF16_TOL["out"] if k == "out" else BF16_TOL["grad"]
                if not v <= tol:
                    bad.append(f"rank {rank} {path} {case} {k}: {v:.3e} > {tol}")
            if zigzag and case.startswith(ONE_STREAM):
                # only FLA's zigzag core ran (the CP=1 answer needs none): no all-to-all at all
                if got["all_to_alls"]:
                    bad.append(f"rank {rank} {case}: {got['all_to_alls']} all-to-alls on the zigzag path")
    assert not bad, "\n".join(bad)
