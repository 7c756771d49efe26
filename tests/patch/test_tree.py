"""Finding megatron-core, and what its target files are (by sha256, whatever version it reports)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gdn_cp.patch import PatchError, apply_patch, describe_tree, detect_pin, find_megatron_root

from .sources import GDN, REPO, VERSION


def test_find_megatron_root_rejects_other_folders(tmp_path):
    with pytest.raises(PatchError, match="no megatron/core inside"):
        find_megatron_root(tmp_path)
    with pytest.raises(PatchError, match="does not exist"):
        find_megatron_root(tmp_path / "nope")


@pytest.mark.megatron
def test_find_megatron_root_forms(layout):
    r = layout.root
    assert find_megatron_root(r) == r.resolve()
    assert find_megatron_root(r / "megatron") == r.resolve()
    assert find_megatron_root(r / "megatron" / "core") == r.resolve()
    assert find_megatron_root(str(r)) == r.resolve()


@pytest.mark.megatron
def test_find_megatron_root_default_is_importable_one_without_importing_it(site):
    code = (
        "import sys; from gdn_cp.patch import find_megatron_root; "
        "print(find_megatron_root()); "
        "assert 'megatron.core' not in sys.modules, 'imported megatron.core'"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site.root), str(REPO)]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=site.root)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(site.root.resolve())


@pytest.mark.megatron
def test_detect_pin_and_describe_tree(layout):
    assert detect_pin(layout.root).version == VERSION
    apply_patch(layout.root)
    assert detect_pin(layout.root).version == VERSION
    layout.path(GDN).write_bytes(b"# another release\n")
    assert detect_pin(layout.root) is None
    assert f"its target files (by sha256) are not the megatron-core {VERSION} release's, patched or not" in describe_tree(
        layout.root)
