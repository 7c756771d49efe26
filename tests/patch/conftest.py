"""The patch tool's fixtures: pristine megatron-core sources (one per session) and trees laid out
from them (see :mod:`tests.patch.sources`)."""

from __future__ import annotations

import shutil
import tempfile
import threading
from pathlib import Path

import pytest

from .sources import Layout, pristine_sources, start_download

_DOWNLOAD: dict = {}  # "base": its folder, "proc": pip download into it, started at collection; "root": the sources
_SOURCES = threading.Lock()  # the fixture and the background start of test_patched_megatron's runs share them


def pytest_collection_finish(session):
    """Start the sdist download (:func:`start_download`, ~4 s) in the background when a selected test needs the
    sources: it is done long before the patch tests run. Where ``test_patched_megatron``'s ``runs`` is selected,
    its Python (~5 s of torch and megatron imports) starts in the background too, once the sources are there."""
    if any("pristine_megatron" in getattr(item, "fixturenames", ()) for item in session.items):
        _DOWNLOAD["base"] = Path(tempfile.mkdtemp(prefix="gdn_cp_megatron_src_"))
        _DOWNLOAD["proc"] = start_download(_DOWNLOAD["base"])
        module = next((item.module for item in session.items if "runs" in getattr(item, "fixturenames", ())
                       and hasattr(getattr(item, "module", None), "start_runs")), None)
        if module is not None:
            _DOWNLOAD["thread"] = threading.Thread(target=_start_runs, args=(module.start_runs,),
                                                   name="gdn-cp-patched-megatron-runs", daemon=True)
            _DOWNLOAD["thread"].start()


def _sources() -> Path:
    """:func:`pristine_sources` once for both of its callers (its failure, a pytest outcome, raised to each)."""
    with _SOURCES:
        if "root" not in _DOWNLOAD:
            try:
                _DOWNLOAD["root"] = pristine_sources(_DOWNLOAD["base"], _DOWNLOAD["proc"])
            except BaseException as err:  # noqa: BLE001 - pytest.fail / skip: the fixture raises it again
                _DOWNLOAD["root"] = err
        root = _DOWNLOAD["root"]
    if isinstance(root, BaseException):
        raise root
    return root


def _start_runs(start_runs) -> None:
    try:
        base = Path(tempfile.mkdtemp(prefix="runs_", dir=_DOWNLOAD["base"]))
        _DOWNLOAD["runs"] = start_runs(_sources(), base, nice=10)  # the foreground's tests first
    except BaseException:  # noqa: BLE001 - no sources, say: the fixture starts the runs itself and says what fails
        pass


def started_runs():
    """``start_runs``'s ``(names, process)`` started in the background at collection, or None."""
    if "thread" in _DOWNLOAD:
        _DOWNLOAD["thread"].join()
    return _DOWNLOAD.pop("runs", None)


def pytest_sessionfinish(session, exitstatus):  # noqa: ARG001
    if "thread" in _DOWNLOAD:
        _DOWNLOAD["thread"].join()
    for key in ("proc", "runs"):
        proc = _DOWNLOAD.get(key)
        proc = proc[1] if isinstance(proc, tuple) else proc
        if proc is not None:
            proc.kill()
            proc.communicate()
    if "base" in _DOWNLOAD:
        shutil.rmtree(_DOWNLOAD["base"], ignore_errors=True)
    _DOWNLOAD.clear()


@pytest.fixture(scope="session")
def pristine_megatron(tmp_path_factory) -> Path:
    """A folder holding a pristine megatron-core 0.19.2 ``megatron/`` package (read-only use)."""
    if "proc" in _DOWNLOAD:
        return _sources()
    return pristine_sources(tmp_path_factory.mktemp("megatron-src"))


@pytest.fixture(params=["checkout", "site-packages"])
def layout(request, pristine_megatron, tmp_path) -> Layout:
    return Layout(request.param, tmp_path, pristine_megatron)


@pytest.fixture
def site(pristine_megatron, tmp_path) -> Layout:
    return Layout("site-packages", tmp_path, pristine_megatron)
