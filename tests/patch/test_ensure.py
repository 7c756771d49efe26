"""ensure_patched: what the tests and benchmarks call to get a patched megatron-core."""

from __future__ import annotations

import pytest

from gdn_cp.patch import (
    BACKUP_SUFFIX,
    PATCHED,
    PRISTINE,
    MegatronNotFound,
    PatchError,
    apply_patch,
    check_patch,
    ensure_patched,
    overall_state,
)

from .sources import GDN


@pytest.mark.megatron
def test_a_pristine_tree_is_patched_in_place_once(site):
    first = ensure_patched(site.root)
    assert (first.root, first.source, first.applied, first.copied) == (site.root.resolve(), site.root.resolve(), True, False)
    assert overall_state(check_patch(site.root)) == PATCHED
    again = ensure_patched(site.root / "megatron")
    assert again.root == site.root.resolve() and not again.applied


@pytest.mark.megatron
def test_copy_to_patches_a_copy_and_leaves_the_source(site, tmp_path):
    done = ensure_patched(site.root, copy_to=tmp_path / "copy")
    assert done.copied and done.applied and done.root == (tmp_path / "copy").resolve()
    assert overall_state(check_patch(done.root)) == PATCHED
    assert site.digest() == site.pristine
    apply_patch(site.root)  # a patched source is used as it is: nothing copied
    done = ensure_patched(site.root, copy_to=tmp_path / "unused")
    assert done.root == site.root.resolve() and not done.copied and not (tmp_path / "unused").exists()


@pytest.mark.megatron
def test_other_trees_are_refused_with_the_fix(site):
    site.path(GDN).write_bytes(site.path(GDN).read_bytes() + b"# a local change\n")
    before = site.digest()
    with pytest.raises(PatchError, match=f"cannot apply the patch in .*{GDN} is modified.*Fix: reinstall"):
        ensure_patched(site.root)
    assert site.digest() == before
    site.path(GDN).unlink()
    with pytest.raises(PatchError, match=f"{GDN} is missing"):
        ensure_patched(site.root)


@pytest.mark.megatron
def test_a_partially_patched_tree_is_refused(site):
    apply_patch(site.root)
    site.path(GDN).write_bytes(site.path(GDN + BACKUP_SUFFIX).read_bytes())
    assert check_patch(site.root)[GDN] == PRISTINE
    with pytest.raises(PatchError, match="partially patched.*gdn-cp patch revert"):
        ensure_patched(site.root)


def test_no_megatron_there(tmp_path):
    with pytest.raises(MegatronNotFound, match="no megatron/core inside"):
        ensure_patched(tmp_path)
