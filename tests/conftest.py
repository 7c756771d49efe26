"""Session fixtures: one spawned rank pool per (world size, device), the megatron-core policy, and
benchmark smoke runs started in the background when the session starts."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch

from gdn_cp_testing import lazy_compile
from gdn_cp_testing.ranks import RankPool

if not torch.cuda.is_available():
    # megatron-core's import in this process without TorchInductor's, as in the CPU rank pools (~1.5 CPU s): the
    # tests here run megatron's modules with dynamo off (install_cpu_shims). A GPU session compiles for real.
    lazy_compile.install()

SKIP_MEGATRON_ENV = "GDN_CP_ALLOW_SKIP_MEGATRON"
ROOT = Path(__file__).resolve().parent.parent

_POOLS: dict[tuple[int, str], RankPool] = {}
OUTCOMES_FILE = os.environ.get("GDN_CP_TEST_OUTCOMES") or None  # gdn_cp_testing.outcomes: each test as it ends


def pytest_runtest_logreport(report):
    """One line per test when its outcome is known: the call's, or a setup that failed or skipped."""
    if not OUTCOMES_FILE or not (report.when == "call" or (report.when == "setup" and not report.passed)):
        return
    from gdn_cp_testing.outcomes import record

    outcome = "error" if report.when == "setup" and report.failed else report.outcome
    record(OUTCOMES_FILE, test=report.nodeid, outcome=outcome, seconds=round(report.duration, 2))


@pytest.fixture(scope="session")
def rank_pool():
    """``rank_pool(world, device="cpu")`` -> a running :class:`RankPool` of that many ranks, shared by
    the whole session (spawning costs seconds). A pool broken by a failed case is replaced."""

    def get(world: int, device: str = "cpu") -> RankPool:
        key = (world, device)
        pool = _POOLS.get(key)
        if pool is None or pool.broken:
            if pool is not None:
                pool.kill()
            pool = _POOLS[key] = RankPool(world, device=device, timeout_s=300.0)
        return pool

    yield get
    try:
        leaks = _thread_leaks(_POOLS.values())
    finally:
        for pool in _POOLS.values():
            pool.close()
        _POOLS.clear()
    if leaks:
        pytest.fail("\n".join(leaks), pytrace=False)


MAX_RANK_THREADS = 64
"""The most threads a pool rank may hold at the end of the session. A fresh 4-rank CPU pool's rank
holds 13 (its 3 gloo groups at 3 threads each, Python's and torch's own) and 16 after the whole
suite; every gloo process group a case creates and never destroys adds 3 for the rest of the
session (Megatron's ``initialize_model_parallel`` made about 25 per call: 1,168 threads per rank, a
load of 180-290 on 2 cores). Cases get their groups from ``gdn_cp_testing.ranks.process_group``
(one per rank set; Megatron's through ``gdn_cp_testing.megatron.training.megatron_parallel_state``)."""


def _thread_leaks(pools) -> list[str]:
    """One line per pool rank holding more than :data:`MAX_RANK_THREADS` threads, with its
    threads by name (pools that are closed or broken are not asked)."""
    lines = []
    for pool in pools:
        if pool.broken:
            continue
        for rank, census in enumerate(pool.thread_census()):
            if census is not None and census[0] > MAX_RANK_THREADS:
                count, names = census
                lines.append(f"rank {rank} of the {pool.world_size}-rank {pool.device} pool holds {count} threads "
                             f"(at most {MAX_RANK_THREADS}): {names}; a case created process groups it never "
                             "destroyed (create them once per topology and reuse them, or destroy them)")
    return lines


def megatron_unavailable(reason: str):
    """Fail (the default: CI installs megatron-core) or skip (``GDN_CP_ALLOW_SKIP_MEGATRON=1``)."""
    from gdn_cp.pins import PINNED_VERSION

    if os.environ.get(SKIP_MEGATRON_ENV) == "1":
        pytest.skip(reason)
    pytest.fail(
        f"{reason}\nThe GatedDeltaNet tests need megatron-core=={PINNED_VERSION} installed (patched by "
        f"`python3 -m gdn_cp.cli patch apply`, or pristine: the tests patch it for the session). "
        f"Set {SKIP_MEGATRON_ENV}=1 to skip them instead.",
        pytrace=False,
    )


@pytest.fixture(scope="session")
def megatron_installed():
    """megatron-core is importable (else fail or skip, see :func:`megatron_unavailable`)."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        megatron_unavailable("megatron-core is not importable")


@pytest.fixture(scope="session")
def benchmark_module():
    """``benchmark_module("syncs")`` -> ``benchmarks.syncs`` imported in this process (its
    ``main(["--help"])`` costs milliseconds here, a torch import in a subprocess)."""
    return lambda name: importlib.import_module(f"benchmarks.{name}")


# ------------------------------------------------------------------------------------------
# benchmark smoke runs, overlapped with the rest of the session
# ------------------------------------------------------------------------------------------
class SmokeRun:
    """``python3 -m benchmarks.<script> <args> --out <json>`` in a subprocess (from the repository root; a
    ``script`` with a dot is a module path of its own, e.g. ``gdn_cp_testing.triton_interpret``; ``"-c"`` runs
    the program text ``args[0]`` as ``python3 -c`` does, with ``--out <json>`` in its ``sys.argv``; ``env``
    adds variables to the subprocess's environment). A smoke run is mostly
    process start-up and imports, so the session runs them one after the other in a background
    thread while the in-process tests run (2 cores: one for each); a test that needs a run that
    has not started yet starts it at once."""

    def __init__(self, key: str, script: str, args: list[str], workdir: Path, env: dict | None = None):
        self.key = key
        name = key.replace(":", ".")
        self.out = workdir / f"{name}.json"
        self._log_path = workdir / f"{name}.log"
        module = ["-c"] if script == "-c" else ["-m", script if "." in script else f"benchmarks.{script}"]
        self.argv = [sys.executable, *module, *args, "--out", str(self.out)]
        self.env = dict(os.environ, **env) if env else None
        self.proc: subprocess.Popen | None = None
        self._stopped = False
        self._lock = threading.Lock()

    def start(self) -> subprocess.Popen | None:
        """The process, started now if it was not yet (None once the session has ended)."""
        with self._lock:
            if self.proc is None and not self._stopped:
                with open(self._log_path, "w") as log:
                    self.proc = subprocess.Popen(self.argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                                 stdin=subprocess.DEVNULL, env=self.env)
            return self.proc

    def result(self, timeout_s: float = 600.0) -> tuple[int, str, Path]:
        """``(exit code, everything it printed, the JSON path)`` once it has finished."""
        proc = self.start()
        if proc is None:
            pytest.fail(f"{self.key}: the session has ended", pytrace=False)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail(f"{' '.join(self.argv)} ran past {timeout_s:g}s and was killed", pytrace=False)
        return code, self._log_path.read_text(), self.out

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            proc = self.proc
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


_SMOKE: dict[str, SmokeRun] = {}
_SMOKE_DIR: list[Path] = []


def _smoke_run(module, fixture: str) -> SmokeRun:
    key = f"{module.__name__}:{fixture}"
    if key not in _SMOKE:
        if not _SMOKE_DIR:
            _SMOKE_DIR.append(Path(tempfile.mkdtemp(prefix="gdn_cp_smoke_")))
        spec = module.SMOKE_RUNS[fixture]
        script, args, *env = spec() if callable(spec) else spec
        _SMOKE[key] = SmokeRun(key, script, list(args), _SMOKE_DIR[0], *env)
    return _SMOKE[key]


def start_smoke_run(module, fixture: str) -> SmokeRun:
    """The run behind ``fixture`` of a test module that declares ``SMOKE_RUNS = {fixture: (script,
    [args])}`` (or ``(script, [args], {env})``, or a function that returns one: called once, when the run is
    queued; an error there is the fixture's), started now unless the session already started it."""
    run = _smoke_run(module, fixture)
    run.start()
    return run


def _run_in_turn(runs: list[SmokeRun]) -> None:
    for run in runs:
        proc = run.start()
        if proc is None:  # the session ended
            return
        proc.wait()


def _megatron_may_change() -> bool:
    """True when the installed megatron-core is not (verifiably) patched: the ``patched_megatron``
    fixture may then rewrite it during the session, so runs that import it start only when their
    test asks (after that), never in the background."""
    try:
        from gdn_cp.patch import PATCHED, check_patch, overall_state

        return overall_state(check_patch()) != PATCHED
    except Exception:  # noqa: BLE001 - not installed or not readable: the tests say so themselves
        return True


def pytest_configure(config):  # noqa: ARG001
    """A bad or unknown GDN_CP_* variable (the library's table or the tests' and benchmarks') stops the
    session before anything is collected, with the one line a gdn-cp command prints (docs/errors.md),
    not as collection errors of the modules that read it.

    TileLang's compile warnings show in the session and its rank pools (``GDN_CP_NATIVE_WARNINGS=show``): pytest
    captures fd 2 itself, and the filter's pipe in its place would write behind pytest's back.
    ``tests/ops/test_native_warnings.py`` runs the filter in processes of its own."""
    from gdn_cp_testing import env

    try:
        env.check_environment()
    except ValueError as err:
        raise pytest.UsageError(str(err)) from None
    os.environ["GDN_CP_NATIVE_WARNINGS"] = "show"


def pytest_collection_finish(session):
    """Record what was collected (``GDN_CP_TEST_OUTCOMES``), and queue every smoke run that a selected test
    will wait for (see :class:`SmokeRun`)."""
    if OUTCOMES_FILE:
        from gdn_cp_testing.outcomes import record

        record(OUTCOMES_FILE, collected=[item.nodeid for item in session.items])
    wanted = []
    for item in session.items:
        module = getattr(item, "module", None)
        runs = getattr(module, "SMOKE_RUNS", None) or {}
        wanted += [(module, f) for f in sorted(set(runs) & set(getattr(item, "fixturenames", ())))]
    if any(getattr(m, "SMOKE_IMPORTS_MEGATRON", False) for m, _ in wanted) and _megatron_may_change():
        wanted = [(m, f) for m, f in wanted if not getattr(m, "SMOKE_IMPORTS_MEGATRON", False)]
    runs = []
    for m, f in wanted:
        try:
            runs.append(_smoke_run(m, f))
        except Exception:  # noqa: BLE001 - raised again where the fixture asks for the run
            pass
    queue = list({id(r): r for r in runs}.values())
    if queue:
        threading.Thread(target=_run_in_turn, args=(queue,), name="gdn-cp-smoke-runs", daemon=True).start()


def pytest_sessionfinish(session, exitstatus):  # noqa: ARG001
    for run in _SMOKE.values():
        run.stop()
    _SMOKE.clear()
    for path in _SMOKE_DIR:
        shutil.rmtree(path, ignore_errors=True)
    _SMOKE_DIR.clear()
