"""benchmarks/suite_caches.sh, run here with bash: the autotune results travel between device calls alone, per GPU
model and family of stages, and come back where the next call's suite restores them."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CACHES = ROOT / "benchmarks" / "suite_caches.sh"
H100 = "NVIDIA_H100_80GB_HBM3"
TIMED = f"{H100}.timed.tar.gz"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("tar") is None,
                                reason="needs bash and tar (the device machine's suite is a bash script)")


def _bash(script: str, cwd: Path, gpu: str | None, **env: str) -> subprocess.CompletedProcess:
    """``script`` after sourcing suite_caches.sh in ``cwd``, with an ``nvidia-smi`` that names ``gpu`` (None: none
    on PATH)."""
    bin_dir = cwd / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.unlink(missing_ok=True)
    if gpu is not None:
        smi.write_text(f"#!/bin/sh\necho '{gpu}'\n")
        smi.chmod(0o755)
    path = f"{bin_dir}:/usr/bin:/bin"
    full = {"PATH": path, "OUT": str(cwd / "out"), "STACK": "fla042", "TRITON_CACHE_DIR": str(cwd / "triton"),
            "TILELANG_CACHE_DIR": str(cwd / "tl"), "GDN_CP_SAVE_CACHE": "0", "GDN_CP_SAVE_TL_CACHE": "0", **env}
    for folder in ("out", "triton", "tl"):
        (cwd / folder).mkdir(exist_ok=True)
    return subprocess.run(["bash", "-c", f". {CACHES}\n{script}"], cwd=cwd, env=full, capture_output=True, text=True,
                          timeout=60)


def _fill(cache: Path) -> None:
    """A Triton cache as a GPU run leaves it: two autotune results beside a compiled kernel."""
    for key, name in (("aa11", "chunk_fwd_kernel_o"), ("bb22", "gdn_cp_glue_conv_bwd_scan")):
        (cache / key).mkdir(parents=True)
        (cache / key / f"{name}.autotune.json").write_text('{"key": [128], "configs_timings": []}')
    (cache / "cc33").mkdir()
    (cache / "cc33" / "chunk_fwd_kernel_o.cubin").write_bytes(b"\0" * 64)


def test_the_autotune_results_travel_alone_per_gpu_model(tmp_path):
    sent, received = tmp_path / "call1", tmp_path / "call2"
    sent.mkdir()
    received.mkdir()
    _fill(sent / "triton")
    r = _bash('save_caches "$(gpu_model)" timed', sent, "NVIDIA H100 80GB HBM3")
    assert r.returncode == 0 and f"autotune results saved: 2 in autotune/{TIMED}" in r.stdout, r
    saved = sent / "out" / "autotune" / TIMED
    with tarfile.open(saved) as tar:
        names = sorted(os.path.normpath(n) for n in tar.getnames() if n.endswith(".json") or n.endswith(".cubin"))
    assert names == ["aa11/chunk_fwd_kernel_o.autotune.json", "bb22/gdn_cp_glue_conv_bwd_scan.autotune.json"]
    assert not list((sent / "out").glob("cache.tar.gz.part*"))  # GDN_CP_SAVE_CACHE=0 keeps the rest home

    (received / ".triton_cache" / "autotune").mkdir(parents=True)
    shutil.copy(saved, received / ".triton_cache" / "autotune" / saved.name)  # what the developer carries back
    r = _bash('restore_autotune "$(gpu_model)" timed', received, "NVIDIA H100 80GB HBM3")
    assert r.returncode == 0 and r.stdout.strip() == f"autotune results restored for {H100} (timed): 2", r
    assert (received / "triton" / "bb22" / "gdn_cp_glue_conv_bwd_scan.autotune.json").is_file()

    for gpu, family in (("NVIDIA H200", "timed"), ("NVIDIA H100 80GB HBM3", "runs"), ("NVIDIA H100 80GB HBM3", "")):
        other = tmp_path / f"call_{gpu[-4:].strip()}_{family}"
        (other / ".triton_cache" / "autotune").mkdir(parents=True)
        shutil.copy(saved, other / ".triton_cache" / "autotune" / saved.name)
        r = _bash(f'restore_autotune "$(gpu_model)" "{family}"; echo "rc=$?"', other, gpu)
        # no H100 picks on an H200; no timed picks for ranks side by side, nor for a call of both kinds
        assert r.stdout.strip() == "rc=0" and not list((other / "triton").iterdir()), (gpu, family, r)


@pytest.mark.parametrize("stages,family", [
    ("layer_full", "timed"), ("layer_full layer_full_b", "timed"), ("glue_kernels", "timed"),
    ("train_mlm", "runs"), ("tests_core+tests_megatron", "runs"), ("wgrads", "runs"), ("glue_tests", "runs"),
    ("layer_full train_mlm", ""), ("layer_full+glue_kernels", ""), ("glue_kernels+tests_core", ""),
])
def test_a_timed_benchmark_only_shares_picks_made_with_the_gpu_to_itself(tmp_path, stages, family):
    r = _bash(f'echo "[$(autotune_family "{stages}")]"', tmp_path, None)
    assert r.stdout.strip() == f"[{family}]", r


def test_the_whole_triton_cache_leaves_the_picks_to_their_own_tarball(tmp_path):
    """GDN_CP_SAVE_CACHE=1: the compiled kernels travel in cache.tar.gz.part*, restored into every call; the picks
    only by model and family, so a mixed call's picks never reach a timed row through the whole cache."""
    _fill(tmp_path / "triton")
    r = _bash('save_caches "$(gpu_model)" ""', tmp_path, "NVIDIA H100 80GB HBM3", GDN_CP_SAVE_CACHE="1")
    assert r.returncode == 0 and "triton cache saved" in r.stdout, r
    parts = sorted((tmp_path / "out").glob("cache.tar.gz.part*"))
    whole = tmp_path / "whole.tar.gz"
    whole.write_bytes(b"".join(part.read_bytes() for part in parts))
    with tarfile.open(whole) as tar:
        names = sorted(os.path.normpath(n) for n in tar.getnames() if "." in os.path.basename(n))
    assert names == ["cc33/chunk_fwd_kernel_o.cubin"], names
    assert not (tmp_path / "out" / "autotune").exists()  # a mixed call keeps no picks at all
    r = _bash('save_caches "$(gpu_model)" ""', tmp_path, "NVIDIA H100 80GB HBM3", GDN_CP_SAVE_CACHE="1",
              GDN_CP_CACHE_MAX_MB="0")
    assert r.returncode == 0 and "over GDN_CP_CACHE_MAX_MB: not kept" in r.stdout, r


def test_without_a_gpu_model_or_a_result_nothing_is_saved(tmp_path):
    _fill(tmp_path / "triton")
    r = _bash('save_caches "$(gpu_model)" runs', tmp_path, None)
    assert r.returncode == 0 and not (tmp_path / "out" / "autotune").exists(), r
    r = _bash('save_caches "$(gpu_model)" ""', tmp_path, "NVIDIA H200")
    assert r.returncode == 0 and not (tmp_path / "out" / "autotune").exists(), r
    empty = tmp_path / "empty"
    empty.mkdir()
    r = _bash('save_caches "$(gpu_model)" runs', empty, "NVIDIA H200")
    assert r.returncode == 0 and not (empty / "out" / "autotune").exists(), r
    r = _bash('save_caches "$(gpu_model)" runs', tmp_path, "NVIDIA H200", GDN_CP_SAVE_AUTOTUNE="0")
    assert r.returncode == 0 and not (tmp_path / "out" / "autotune").exists(), r


def test_the_suite_restores_before_its_stages_and_saves_after_each_group():
    text = (ROOT / "benchmarks" / "gpu_suite.sh").read_text()
    assert ". benchmarks/suite_caches.sh" in text
    restore = text.index('restore_autotune "$GPU_MODEL" "$AUTOTUNE_FAMILY"')
    assert restore < text.index("run_stage() {") and text.index("GPU_MODEL=$(gpu_model)") < restore
    assert text.index('AUTOTUNE_FAMILY=$(autotune_family "${GDN_CP_STAGES:-tests}")') < restore
    assert text.index('exec > >(tee -a "$OUT/run.log")') < restore  # the raw record says what was restored
    assert 'save_caches "$GPU_MODEL" "$AUTOTUNE_FAMILY"' in text[text.index("RC=0"):]
