"""GPU version of test_tp.py: the patched GatedDeltaNet with the FLA backend (deterministic_mode=
False) under TP, sequence parallelism and CP, NCCL with one rank per GPU, against TP=1 CP=1 on the
same full weights; every ``linear_cp_mode``, SBHD and THD, bf16 and fp32:

* 2 GPUs: TP=2 x CP=1 (SP off and on) and TP=1 x CP=2;
* 4 GPUs: TP=2 x CP=2 (SP off and on); skipped with the reason on fewer GPUs.

Marked ``gpu`` (run by ``benchmarks/gpu_suite.sh``'s tests stage); skipped with the reason without
CUDA, FLA or enough GPUs. The head shape is the one test_gpu_parity.py uses (FLA compiles its
kernels per shape). Errors are relative L2; every row is appended to ``$GDN_CP_GPU_RESULTS`` when
set. ``GDN_CP_GPU_TP_DTYPES`` (default ``bfloat16,float32``) narrows the dtypes: fp32 compiles
FLA's kernels once more. ``test_gpu_tp_code_runs_on_cpu`` runs the same case function and checks on
CPU gloo ranks (reference backend, small shape) in the CPU suite, so this file cannot rot unseen.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from gdn_cp_testing.megatron.parity import GPU_CFG, MODES, tp_grid_case
from gdn_cp.ops.accuracy import max_rel, rel_l2
from gdn_cp_testing.results import JsonlRecorder
from gdn_cp.ops.accuracy import CP_VS_CP1_MAX_REL, MEGATRON_BF16_REL_L2, MEGATRON_FP32_REL_L2

pytestmark = pytest.mark.megatron

GRID_2 = [(2, 1, False), (2, 1, True), (1, 2, False)]
GRID_4 = [(2, 2, False), (2, 2, True)]
_TOL = {"torch.bfloat16": MEGATRON_BF16_REL_L2, "torch.float32": MEGATRON_FP32_REL_L2}
_record = JsonlRecorder.from_env("GDN_CP_GPU_RESULTS").record


def _dtypes():
    names = os.environ.get("GDN_CP_GPU_TP_DTYPES", "bfloat16,float32").split(",")
    bad = [n for n in names if n not in ("bfloat16", "float32")]
    if bad:
        raise ValueError(f"GDN_CP_GPU_TP_DTYPES={os.environ['GDN_CP_GPU_TP_DTYPES']!r}: use bfloat16 and/or float32")
    return tuple(getattr(torch, n) for n in names)


def _require_gpus(n: int):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA GPUs (FLA backend); the CPU suite is test_tp.py")
    if importlib.util.find_spec("fla") is None:
        pytest.skip("needs flash-linear-attention (fla) installed")
    if not torch.distributed.is_nccl_available():
        pytest.skip("needs NCCL (one rank per GPU)")
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs (NCCL, one rank per GPU); this machine has {torch.cuda.device_count()}")


def _cases(ctx, grid, dtypes, cfg, metric):
    """The grid on this rank (``ctx.device``), plus the backend the gdn-cp path chose."""
    from gdn_cp.ops.registry import resolve_backend

    name, _ = resolve_backend(cfg.get("linear_cp_backend", "auto"), ctx.device.type,
                              deterministic=cfg.get("deterministic_mode", False),
                              head_dims=(cfg.get("linear_key_head_dim"), cfg.get("linear_value_head_dim")))
    return {"backend": name,
            "cases": tp_grid_case(grid, dtypes, MODES, cfg=cfg, device=ctx.device, metric=metric, bias=False,
                                  conv_bias=False)}


def _check(results, world, tol_of, record=True) -> list[str]:
    bad = []
    for rank, res in enumerate(results):
        for (tp, cp, sp, layout, dtype), per_mode in res["cases"].items():
            for mode, errs in per_mode.items():
                if record:
                    _record("megatron_gdn_tp_parity", world=world, rank=rank, tp=tp, cp=cp, sequence_parallel=sp,
                            layout=layout, dtype=dtype, mode=mode, errors=errs)
                for k, v in errs.items():
                    tol = tol_of(dtype, k)
                    if not v <= tol:
                        bad.append(f"rank {rank} tp={tp} cp={cp} sp={sp} {layout} {dtype} {mode} {k}: {v:.3e} > {tol}")
    return bad


def _gpu_tol(dtype: str, quantity: str) -> float:
    return _TOL[dtype]["out" if quantity == "out" else "grad"]


@pytest.mark.gpu
@pytest.mark.parametrize("world,grid", [(2, GRID_2), (4, GRID_4)], ids=["2gpus", "4gpus"])
def test_gpu_tp_cp_sp_parity(rank_pool, patched_megatron, world, grid):
    _require_gpus(world)
    results = rank_pool(world, device="cuda").run(_cases, grid, _dtypes(), GPU_CFG, rel_l2, timeout_s=600)
    assert results[0]["backend"].endswith("fla"), results[0]["backend"]
    assert len(results[0]["cases"]) == len(grid) * 2 * len(_dtypes())
    bad = _check(results, world, _gpu_tol)
    assert not bad, "\n".join(bad)


def test_gpu_tp_code_runs_on_cpu(rank_pool, patched_megatron):
    """The GPU test's case function and checks, on 2 CPU gloo ranks with the reference backend
    (deterministic mode) and the small CPU shape, fp32 (max_rel <= 1e-5): a dry run of the code the
    device machine will run."""
    results = rank_pool(2).run(_cases, GRID_2, (torch.float32,), {"deterministic_mode": True}, max_rel)
    assert results[0]["backend"].endswith("reference"), results[0]["backend"]
    assert len(results[0]["cases"]) == len(GRID_2) * 2
    bad = _check(results, 2, lambda dtype, quantity: CP_VS_CP1_MAX_REL[torch.float32], record=False)
    assert not bad, "\n".join(bad)
