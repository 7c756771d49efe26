"""The patch tool's fixtures: pristine megatron-core sources (one per session) and trees laid out
from them (see :mod:`tests.patch.sources`)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from .sources import Layout, pristine_sources, start_download

_DOWNLOAD: dict = {}  # "base": its folder, "proc": pip download into it, started at collection


def pytest_collection_finish(session):
    """Start the sdist download (:func:`start_download`, ~4 s) in the background when a selected test needs the
    sources: it is done long before the patch tests run."""
    if any("pristine_megatron" in getattr(item, "fixturenames", ()) for item in session.items):
        _DOWNLOAD["base"] = Path(tempfile.mkdtemp(prefix="gdn_cp_megatron_src_"))
        _DOWNLOAD["proc"] = start_download(_DOWNLOAD["base"])


def pytest_sessionfinish(session, exitstatus):  # noqa: ARG001
    if "proc" in _DOWNLOAD:
        _DOWNLOAD["proc"].kill()
        _DOWNLOAD["proc"].communicate()
        shutil.rmtree(_DOWNLOAD["base"], ignore_errors=True)
    _DOWNLOAD.clear()


@pytest.fixture(scope="session")
def pristine_megatron(tmp_path_factory) -> Path:
    """A folder holding a pristine megatron-core 0.19.2 ``megatron/`` package (read-only use)."""
    if "proc" in _DOWNLOAD:
        return pristine_sources(_DOWNLOAD["base"], _DOWNLOAD["proc"])
    return pristine_sources(tmp_path_factory.mktemp("megatron-src"))


@pytest.fixture(params=["checkout", "site-packages"])
def layout(request, pristine_megatron, tmp_path) -> Layout:
    return Layout(request.param, tmp_path, pristine_megatron)


@pytest.fixture
def site(pristine_megatron, tmp_path) -> Layout:
    return Layout("site-packages", tmp_path, pristine_megatron)
