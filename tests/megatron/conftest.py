"""The session fixture every Megatron test uses: the installed megatron-core, patched."""

from tests.megatron.shims import patched_megatron  # noqa: F401  (pytest collects the fixture here)
