"""The shape sweep through Megatron's GatedDeltaNet (issue 46; :mod:`gdn_cp_testing.megatron.shape_sweep`):
every ``linear_cp_mode`` (``auto`` too) x CP 2 / 4 x layer heads (1, 2, 3, 4, 6 key heads per rank, GVA ratios
1-3; headwise also on head counts CP does not divide) x head dim 64 / 128 x micro-batch 1 / 2 x SBHD / THD (cut
per document, and as a whole row), each case equal to CP=1 on the same weights and inputs or refused before any
collective, exactly where gdn-cp's own rules (the mode's head rule, the backend's layer rule) refuse it.

* CPU (CI): the reference backend in fp64, 46 cases of the covering set (every mode x CP x key heads, the other
  dimensions in turn) in the session's 4-rank pool, outputs and every gradient within 1e-10 (max_rel);
* GPU (``-m gpu``, gloo ranks sharing cuda:0): the FLA and FlashQLA backends, named (so FlashQLA's head-dim rule
  refuses head dim 64 when the config is built), bf16, the 139 cases of the covering set with every GVA ratio
  (the shapes users reported crashing among them),
  relative L2 within Megatron's bf16 tolerances; one test per backend and mode, each skipped with the reason
  where its backend cannot run. The device machine runs it through the suite's tests stage (``-k shape_sweep``).

The table in docs/megatron.md ("What runs: shapes through the layer") is :func:`sweep_table`, held here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from gdn_cp.ops.accuracy import CP_VS_CP1_MAX_REL, MEGATRON_BF16_REL_L2
from gdn_cp_testing.megatron.shape_sweep import MODES, covering_cases, expected_refusal, sweep_on_rank, sweep_table

pytestmark = pytest.mark.megatron

WORLD = 4
GPU_WORLD = max(WORLD, min(16, (os.cpu_count() or WORLD) // WORLD * WORLD))
"""The GPU sweep's ranks, all on cuda:0 (16 on the device machine's 16 cores: 8 groups at CP=2, 4 at CP=4). Each
case's kernels compile on first use, one set per head count and head dim (FLA's Triton, FlashQLA's TileLang; one
kernel at a time in a process), so the groups compile side by side; a 4-rank pool did not finish the first FLA
test's compiles in 376 s (run 2026-12-05c)."""
CPU_CASES = covering_cases(every_ratio=False)
GPU_CASES = covering_cases(every_ratio=True)
DOC = Path(__file__).resolve().parents[2] / "docs" / "megatron.md"


def _judge(results: list, cases: list, backend: str, device_type: str, dtype: str, tol) -> tuple[list, dict]:
    """``(problems, counts)``: every case ran on every rank of its group and equals CP=1 within ``tol`` (a
    function of the quantity), or was refused on every rank before any collective, exactly where
    :func:`expected_refusal` refuses it."""
    bad, counts = [], {"ran": 0, "refused": 0}
    for case in cases:
        got = [r[case] for r in results if case in r]
        if len(got) != case.cp:
            bad.append(f"{case.label()}: answered by {len(got)} ranks, not its group's {case.cp}")
            continue
        why = expected_refusal(case, backend, device_type, dtype)
        kinds = {g[0] for g in got}
        if why is not None:
            if kinds != {"refused"}:
                bad.append(f"{case.label()}: ran, but gdn-cp's rules refuse it ({why})")
            elif any(g[3] for g in got):
                bad.append(f"{case.label()}: refused after {max(g[3] for g in got)} collectives ({got[0][1]})")
            else:
                counts["refused"] += 1
            continue
        if kinds != {"ran"}:
            refusal = next(g for g in got if g[0] == "refused")
            bad.append(f"{case.label()}: refused ({refusal[1]}: {refusal[2][:300]}), but gdn-cp's rules accept it")
            continue
        over = {q: e for g in got for q, e in g[1].items() if not e <= tol(q)}
        if over:
            bad.append(f"{case.label()}: " + ", ".join(f"{q} {e:.3g}" for q, e in sorted(over.items())))
        else:
            counts["ran"] += 1
    return bad, counts


def test_cpu_cases_cover_every_mode_cp_and_heads_per_rank():
    """The CPU set meets, in every (mode, CP size), every head dim, micro-batch, layout and GVA ratio, and every
    per-rank head count the sweep names; the GPU set every (key heads, ratio) of every (mode, CP size)."""
    from gdn_cp_testing.megatron.shape_sweep import (CP_SIZES, GVA_RATIOS, HEAD_DIMS, HEADS_PER_RANK, LAYOUTS,
                                                     MICRO_BATCHES, MODES, layer_key_heads, rank_heads)

    for mode in MODES:
        for cp in CP_SIZES:
            mine = [c for c in CPU_CASES if (c.mode, c.cp) == (mode, cp)]
            assert {c.head_dim for c in mine} == set(HEAD_DIMS) and {c.mbs for c in mine} == set(MICRO_BATCHES)
            assert {c.layout for c in mine} == set(LAYOUTS) and {c.ratio for c in mine} == set(GVA_RATIOS)
            assert {c.key_heads for c in mine} == set(layer_key_heads(mode, cp))
            ran = {rank_heads(c)[0] for c in mine if expected_refusal(c, "reference", "cpu", "float64") is None}
            assert ran == set(HEADS_PER_RANK), (mode, cp, ran)
            gpu = {(c.key_heads, c.ratio) for c in GPU_CASES if (c.mode, c.cp) == (mode, cp)}
            assert gpu == {(k, r) for k in layer_key_heads(mode, cp) for r in GVA_RATIOS}, (mode, cp)


def test_gpu_cases_hold_the_reported_crash_shapes():
    """Issue 46's crash 1 (FlashQLA, headwise CP=2, 2 key / 6 value heads of 128: 1 / 3 per rank) is a GPU case as
    it was reported, and FlashQLA's rules accept it (so the GPU test must run it, not see it refused)."""
    from gdn_cp_testing.megatron.shape_sweep import REPORTED, rank_heads

    crash = REPORTED[0]
    assert crash in GPU_CASES and (crash.head_dim, crash.layout, crash.mbs) == (128, "sbhd", 2)
    assert rank_heads(crash) == (1, 3)
    assert expected_refusal(crash, "flashqla", "cuda", "bfloat16") is None


def _sweep_recording(ctx, path: str, *args):
    """:func:`sweep_on_rank` with ``GDN_CP_GPU_RESULTS`` set to ``path`` in this rank (as the GPU suite sets it)."""
    os.environ["GDN_CP_GPU_RESULTS"] = path
    try:
        return sweep_on_rank(ctx, *args)
    finally:
        del os.environ["GDN_CP_GPU_RESULTS"]


def test_shape_sweep_cpu(patched_megatron, rank_pool, tmp_path):
    path = tmp_path / "gpu_results.jsonl"
    results = rank_pool(WORLD).run(_sweep_recording, str(path), CPU_CASES, "reference", "float64", timeout_s=300)
    kinds = [json.loads(line)["kind"] for line in path.read_text().splitlines()]
    # one context row for the pool, first (not one per rank that records), the CP=1 answers', every case's
    assert kinds[0] == "context" and kinds.count("context") == 1 and kinds.count("shape_sweep_cp1") == 1, kinds
    assert kinds.count("shape_sweep_case") == len(CPU_CASES), kinds
    bad, counts = _judge(results, CPU_CASES, "reference", "cpu", "float64", lambda q: CP_VS_CP1_MAX_REL[torch.float64])
    assert not bad, "\n".join(bad)
    assert counts["refused"] > 0 and counts["ran"] > counts["refused"], counts
    print(f"shape sweep, reference backend, fp64: {counts['ran']} cases equal CP=1, {counts['refused']} refused")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", ["fla", "flashqla"])
def test_shape_sweep_gpu(patched_megatron, rank_pool, backend, mode):
    """One test per backend and mode (each compiles its kernels for its own head counts on first use: a time
    limit then still leaves the others' results)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (the CPU half is test_shape_sweep_cpu)")
    from gdn_cp.ops.registry import backend_spec

    why = backend_spec(backend).problem()
    if why is not None:
        pytest.skip(f"{backend} backend: {why}")
    cases = [c for c in GPU_CASES if c.mode == mode]
    results = rank_pool(GPU_WORLD, device="cuda").run(sweep_on_rank, cases, backend, "bfloat16", "rel_l2", timeout_s=900)
    tol = lambda q: MEGATRON_BF16_REL_L2["out" if q == "out" else "grad"]  # noqa: E731
    bad, counts = _judge(results, cases, backend, "cuda", "bfloat16", tol)
    assert not bad, "\n".join(bad)
    print(f"shape sweep, {backend} backend, {mode}, bf16: {counts['ran']} cases equal CP=1, {counts['refused']} refused")


def test_docs_table_is_the_rules():
    """docs/megatron.md's table of what runs is the one the rules give (regenerate it with
    ``python3 -c 'from gdn_cp_testing.megatron.shape_sweep import sweep_table; print(sweep_table())'``)."""
    text = DOC.read_text(encoding="utf-8")
    assert sweep_table() in text, "docs/megatron.md's shape table differs from sweep_table(); paste its output"
