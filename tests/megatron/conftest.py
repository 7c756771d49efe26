"""The session fixture every Megatron test uses: the installed megatron-core, patched."""

from __future__ import annotations

import pytest

from tests.conftest import megatron_unavailable


@pytest.fixture(scope="session")
def patched_megatron(megatron_installed):
    """The installed megatron-core, patched for the session (reverted at the end if we patched it).
    Spawned ranks import the installed (patched) package."""
    from gdn_cp.megatron import patching

    try:
        root = patching.find_megatron_root()
        version = patching.megatron_version(root)
        state = patching.overall_state(patching.check_patch(root))
    except Exception as e:  # noqa: BLE001 - any failure here is "not usable", with the reason
        megatron_unavailable(f"cannot inspect the installed megatron-core: {type(e).__name__}: {e}")
    if version not in (None, patching.PINNED_VERSION):
        megatron_unavailable(f"installed megatron-core is {version}, the patch is pinned to {patching.PINNED_VERSION}")
    applied = False
    if state == patching.PRISTINE:
        patching.apply_patch(root)
        applied = True
    elif state != patching.PATCHED:
        pytest.fail(
            f"installed megatron-core at {root} is {state!r} (neither pristine nor patched); "
            "run `python3 -m gdn_cp.cli patch check`",
            pytrace=False,
        )
    try:
        yield root
    finally:
        if applied:
            patching.revert_patch(root)
