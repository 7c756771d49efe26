"""The patch tool's fixtures: pristine megatron-core sources (one per session) and trees laid out
from them (see :mod:`tests.patch.sources`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .sources import Layout, pristine_sources


@pytest.fixture(scope="session")
def pristine_megatron(tmp_path_factory) -> Path:
    """A folder holding a pristine megatron-core 0.19.2 ``megatron/`` package (read-only use)."""
    return pristine_sources(tmp_path_factory.mktemp("megatron-src"))


@pytest.fixture(params=["checkout", "site-packages"])
def layout(request, pristine_megatron, tmp_path) -> Layout:
    return Layout(request.param, tmp_path, pristine_megatron)


@pytest.fixture
def site(pristine_megatron, tmp_path) -> Layout:
    return Layout("site-packages", tmp_path, pristine_megatron)
