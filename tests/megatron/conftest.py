"""The session fixture every Megatron test uses: the installed megatron-core, patched."""

from __future__ import annotations

import pytest

from tests.conftest import megatron_unavailable


@pytest.fixture(scope="session")
def patched_megatron(megatron_installed):
    """The installed megatron-core, patched for the session (reverted at the end if we patched it).
    Spawned ranks import the installed (patched) package."""
    from gdn_cp.patch import MegatronNotFound, PatchError, ensure_patched, revert_patch

    try:
        tree = ensure_patched()
    except MegatronNotFound as e:
        megatron_unavailable(f"cannot find the installed megatron-core: {e}")
    except PatchError as e:
        pytest.fail(f"installed megatron-core: {e}", pytrace=False)
    try:
        yield tree.root
    finally:
        if tree.applied:
            revert_patch(tree.root)
