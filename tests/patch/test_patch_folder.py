"""The vendored patch folder: its manifest and diffs agree, it ships in a wheel, GNU patch reads it, and
the patch-building function makes it byte for byte."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gdn_cp.patch import PATCH_NAME, PATCHED, apply_patch, build_patch_files, check_patch, load_manifest, patch_dir

from .sources import IGNORE, REPO, TARGETS, VERSION, Layout


def test_manifest_and_patch_files_are_consistent():
    m = load_manifest()
    assert m.megatron_core_version == VERSION
    assert [t.target for t in m.files] == list(TARGETS)
    d = patch_dir()
    for t in m.files:
        text = (d / t.patch).read_text(encoding="utf-8")
        assert f"--- a/{t.target}\n" in text and f"+++ b/{t.target}\n" in text
        assert len(t.sha256_pristine) == 64 and len(t.sha256_patched) == 64
    # the patch stays thin: two config fields + the validation call, the forward hand-over, the
    # splitter's record of its THD split and the training arguments' hook (the logic is in gdn_cp)
    added = sum(
        1
        for t in m.files
        for line in (d / t.patch).read_text().splitlines()
        if line.startswith("+") and not line.startswith("+++")
    )
    assert added < 100, added


def test_pyproject_lists_every_package():
    tomllib = pytest.importorskip("tomllib")
    from setuptools import find_namespace_packages

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        p
        for p in find_namespace_packages(where=str(REPO), include=["gdn_cp", "gdn_cp.*"])
        if "__pycache__" not in p.split(".")
    }
    missing = found - listed
    assert not missing, f"add these to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"
    assert "gdn_cp._patches" in listed


def test_patch_folder_ships_in_a_real_wheel_install(tmp_path):
    """`pip install --no-deps --target` (non-editable) carries patches/ as gdn_cp._patches."""
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(REPO / "pyproject.toml", src)
    readme = REPO / "README.md"
    (src / "README.md").write_text(readme.read_text() if readme.exists() else "gdn-cp\n")
    shutil.copytree(REPO / "gdn_cp", src / "gdn_cp", ignore=IGNORE)
    shutil.copytree(REPO / "patches", src / "patches", ignore=IGNORE)
    target = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(target), str(src)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    shipped = target / "gdn_cp" / "_patches" / PATCH_NAME
    names = sorted(p.name for p in shipped.iterdir())
    assert names == sorted(["manifest.json"] + [t.patch for t in load_manifest().files])
    code = (
        "import gdn_cp.patch as p; d = p.patch_dir(); "
        "assert p.load_manifest().files; print(d)"
    )
    env = dict(os.environ, PYTHONPATH=str(target))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert str(shipped) in r.stdout


@pytest.mark.megatron
def test_gnu_patch_agrees(pristine_megatron, tmp_path):
    """The stored diffs are ordinary unified diffs: `patch -p1` gives the same files."""
    exe = shutil.which("patch")
    if exe is None:
        pytest.skip("GNU patch is not installed (the pure-python applier is tested above)")
    lay = Layout("checkout", tmp_path, pristine_megatron)
    for t in load_manifest().files:
        r = subprocess.run(
            [exe, "-p1", "--forward", "--silent", "-i", str(patch_dir() / t.patch)],
            cwd=lay.root, capture_output=True, text=True,
        )  # fmt: skip
        assert r.returncode == 0, r.stdout + r.stderr
    assert check_patch(lay.root) == dict.fromkeys(TARGETS, PATCHED)


@pytest.mark.megatron
def test_shipped_patch_folder_is_what_build_patch_files_makes(pristine_megatron, tmp_path):
    """The vendored diffs and manifest are regenerated, byte for byte, from pristine + patched trees."""
    patched = Layout("site-packages", tmp_path, pristine_megatron)
    apply_patch(patched.root)
    out = build_patch_files(pristine_megatron, patched.root, list(TARGETS), out_dir=tmp_path / "rebuilt")
    shipped = patch_dir()
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(p.name for p in Path(str(shipped)).iterdir() if p.is_file())
    for name in names:
        assert (out / name).read_bytes() == (shipped / name).read_bytes(), name
