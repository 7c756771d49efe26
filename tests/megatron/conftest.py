"""The session fixture every Megatron test uses: the installed megatron-core, patched."""

from __future__ import annotations

import pytest

from tests.conftest import megatron_unavailable


@pytest.fixture(scope="session")
def patched_megatron(megatron_installed):
    """The installed megatron-core, patched for the session (reverted at the end if we patched it).
    Spawned ranks import the installed (patched) package. Another release installed counts as no
    megatron-core (fail, or skip with GDN_CP_ALLOW_SKIP_MEGATRON=1); local edits of the pinned
    one fail with the fix."""
    from gdn_cp.patch import PINNED_VERSION, MegatronNotFound, PatchError, ensure_patched, revert_patch
    from gdn_cp.patch import find_megatron_root, megatron_version

    try:
        tree = ensure_patched()
    except MegatronNotFound as e:
        megatron_unavailable(f"cannot find the installed megatron-core: {e}")
    except PatchError as e:
        version = megatron_version(find_megatron_root())
        if version not in (None, PINNED_VERSION):
            megatron_unavailable(f"installed megatron-core is {version}, the patch is pinned to {PINNED_VERSION}")
        pytest.fail(f"installed megatron-core: {e}", pytrace=False)
    try:
        yield tree.root
    finally:
        if tree.applied:
            revert_patch(tree.root)
