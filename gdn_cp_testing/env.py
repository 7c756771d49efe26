"""The tests' and benchmarks' ``GDN_CP_*`` environment variables, in the form of the library's table
(:mod:`gdn_cp.env`), read and checked in one place.

Each entry says who reads the variable (``tests``: the test suite and its toolkit, ``benchmarks``:
the benchmarks and ``benchmarks/gpu_suite.sh``) and how a value is checked: every setting has its
rule (a choice, a number, a list), except the free-form ones (paths, a script's arguments).

:func:`check_environment` checks both tables and refuses any ``GDN_CP_*`` name in neither: the test
session (tests/conftest.py: a usage error before any test is collected) and
``benchmarks/gpu_suite.sh`` (``python3 -m gdn_cp_testing.env --check``) run it first.
``python3 -m gdn_cp_testing.env`` prints both tables.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Callable, Mapping, Optional

from gdn_cp import env as library
from gdn_cp.env import EnvSetting, one_of

__all__ = ["ALL_SETTINGS", "SETTINGS", "SUITE_STAGES", "check_environment", "read", "side_by_side_problem"]


MIN_PG_TIMEOUT_S = 1.0
"""The shortest process-group timeout taken: below it a collective fails inside gloo before any rank could
answer (1e-9 was accepted, then failed there)."""


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= MIN_PG_TIMEOUT_S):
        raise ValueError(f"use a number of seconds > 0, at least {MIN_PG_TIMEOUT_S:g} (a collective needs that "
                         "long), e.g. 180")
    return value


def _positive_int(example: str) -> Callable[[str], int]:
    """A whole number >= 1 in ASCII digits (what bash arithmetic and ``int()`` both take)."""

    def parse(text: str) -> int:
        if not re.fullmatch(r"[0-9]+", text) or int(text) < 1:
            raise ValueError(f"use a whole number >= 1, e.g. {example}")
        return int(text)

    return parse


def _comma_list_of(*choices: str) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(v.strip() for v in text.split(","))
        if not all(v in choices for v in items):
            raise ValueError(f"use a comma-separated list of {', '.join(choices)}")
        return items

    return parse


SUITE_STAGES = ("tests", "tests_core", "tests_megatron", "flashqla_tests", "glue_tests", "glue_kernels", "args", "wgrads",
                "syncs", "layer_full", "layer_full_b", "train_mlm")
"""The stages of ``benchmarks/gpu_suite.sh`` (its ``run_stage``)."""


def _stages(text: str) -> tuple[tuple[str, ...], ...]:
    """Space-separated groups, each of stages joined by ``+`` (run side by side)."""
    groups = tuple(tuple(group.split("+")) for group in text.split())
    if not groups or any(stage not in SUITE_STAGES for group in groups for stage in group):
        raise ValueError(f"use stages of {', '.join(SUITE_STAGES)}, separated by spaces, joined by + to run side "
                         'by side, e.g. "tests+args layer_full"')
    return groups


SMALL_GPU_MIB = 100_000
"""A GPU with less memory (an 80 GB H100: 81559 MiB) runs the training benchmark apart from the test stages."""


def side_by_side_problem(stages: str, gpu_mib: int) -> Optional[str]:
    """Why ``GDN_CP_STAGES=stages`` cannot run on a GPU of ``gpu_mib`` MiB, naming the fix (None: it can). On an
    80 GB H100 the training benchmark's ranks beside the test stages ran a test out of GPU memory
    (``CUBLAS_STATUS_ALLOC_FAILED``) and took 1.8x their time alone (run 2026-12-07c); an H200 ran them together
    (runs 2026-12-03a/b)."""
    for group in _stages(stages):
        tests = [s for s in group if s.endswith("tests") or s.startswith("tests")]
        if "train_mlm" in group and tests and gpu_mib < SMALL_GPU_MIB:
            apart = " ".join(["+".join(s for s in group if s != "train_mlm"), "train_mlm"])
            return (f"GDN_CP_STAGES={stages!r} runs train_mlm beside {', '.join(tests)} on a GPU of {gpu_mib} MiB "
                    f"(< {SMALL_GPU_MIB}): on an 80 GB H100 that ran a test out of memory (run 2026-12-07c). Fix: "
                    f"run them one after another (GDN_CP_STAGES=\"{apart}\") or in separate calls")
    return None


def _json_argv(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise ValueError("use a JSON list of strings (the test sets it for its subprocess)")
    return value


_SECONDS = _positive_int("300")
_SWITCH = one_of("0", "1")

SETTINGS: dict[str, EnvSetting] = {
    s.name: s
    for s in (
        EnvSetting("GDN_CP_TEST_DIST_BACKEND", "tests", "",
                   "the torch.distributed backend of rank pools that do not name one (gdn_cp_testing.ranks; "
                   "gdn-cp run takes --dist-backend, and says so when this is set to another)",
                   one_of("gloo", "nccl")),
        EnvSetting("GDN_CP_TEST_PG_TIMEOUT", "tests", "180",
                   "seconds a rank of a rank pool waits in a collective (gdn_cp_testing.ranks)",
                   _positive_seconds),
        EnvSetting("GDN_CP_TEST_FAST_AUTOTUNE", "tests", "0",
                   "1: Triton autotuners take their first working config (tests only; timings then mean nothing)",
                   _SWITCH),
        EnvSetting("GDN_CP_ALLOW_SKIP_MEGATRON", "tests", "0", "1: skip, instead of fail, tests that need megatron-core",
                   _SWITCH),
        EnvSetting("GDN_CP_MEGATRON_SDIST", "tests", "", "path of the megatron-core sdist for the patch tests"),
        EnvSetting("GDN_CP_FUZZ_EXAMPLES", "tests", "",
                   "random examples per fuzz test (default: CI's derandomized few)", _positive_int("3000")),
        EnvSetting("GDN_CP_GPU_RESULTS", "tests", "", "JSON lines file the GPU tests append their results to"),
        EnvSetting("GDN_CP_TEST_OUTCOMES", "tests", "",
                   "JSON lines file the test session appends each test's outcome to as it finishes "
                   "(gdn_cp_testing.outcomes: the GPU suite's per-stage summary, also after a time-out)"),
        EnvSetting("GDN_CP_GPU_TP_DTYPES", "tests", "bfloat16,float32", "dtypes of the GPU TP x CP tests",
                   _comma_list_of("bfloat16", "float32")),
        EnvSetting("GDN_CP_BENCHMARKS", "tests", "",
                   "benchmarks/ folder, handed to the fake Megatron-LM scripts of tests/megatron/test_megatron_lm_launcher.py"),
        EnvSetting("GDN_CP_TMP", "tests", "",
                   "scratch folder of the fake Megatron-LM scripts of tests/megatron/test_megatron_lm_launcher.py"),
        EnvSetting("GDN_CP_README_COMMAND", "tests", "",
                   "the README's training command, handed to a subprocess by tests/megatron/test_training_args.py",
                   _json_argv),
        EnvSetting("GDN_CP_STAGES", "benchmarks", "tests", "stages of benchmarks/gpu_suite.sh", _stages),
        EnvSetting("GDN_CP_SUITE_TIMEOUT", "benchmarks", "420", "benchmarks/gpu_suite.sh: time limit of the test stage",
                   _SECONDS),
        EnvSetting("GDN_CP_SYNCS_TIMEOUT", "benchmarks", "240", "benchmarks/gpu_suite.sh: time limit of the syncs stage",
                   _SECONDS),
        EnvSetting("GDN_CP_SYNCS_ARGS", "benchmarks", "",
                   "benchmarks/gpu_suite.sh: arguments of benchmarks/syncs.py (stage syncs; e.g. --backend flashqla)"),
        EnvSetting("GDN_CP_WGRADS_ARGS", "benchmarks", "", "benchmarks/gpu_suite.sh: arguments of "
                   "gdn_cp_testing.megatron.wgrads (stage wgrads; e.g. --precision fp32)"),
        EnvSetting("GDN_CP_LAYER_FULL_ARGS", "benchmarks", "", "arguments of benchmarks/layer_full.py in the suite"),
        EnvSetting("GDN_CP_LAYER_FULL_TIMEOUT", "benchmarks", "480", "benchmarks/gpu_suite.sh: time limit of layer_full",
                   _SECONDS),
        EnvSetting("GDN_CP_CACHE_MAX_MB", "benchmarks", "56", "benchmarks/gpu_suite.sh: largest Triton cache to keep",
                   _positive_int("56")),
        EnvSetting("GDN_CP_STACK", "benchmarks", "fla042",
                   "benchmarks/gpu_suite.sh: the FLA stack, fla042 (the carried wheels) or fla060 (the slim-triton pack)",
                   one_of("fla042", "fla060")),
        EnvSetting("GDN_CP_SLIM", "benchmarks", ".slim", "benchmarks/gpu_suite.sh: folder of the slim-triton pack (fla060)"),
        EnvSetting("GDN_CP_SAVE_CACHE", "benchmarks", "1", "benchmarks/gpu_suite.sh: 0 keeps no Triton cache tarball",
                   _SWITCH),
        EnvSetting("GDN_CP_SAVE_AUTOTUNE", "benchmarks", "1", "benchmarks/gpu_suite.sh: 0 keeps no tarball of the "
                   "autotune results (Triton's *.autotune.json per GPU model: benchmarks/suite_caches.sh)", _SWITCH),
        EnvSetting("GDN_CP_TESTS_FAST_AUTOTUNE", "benchmarks", "",
                   "benchmarks/gpu_suite.sh: GDN_CP_TEST_FAST_AUTOTUNE for the test stages only (tests*, glue_tests)",
                   _SWITCH),
        EnvSetting("GDN_CP_LAYER_FULL_B_ARGS", "benchmarks", "",
                   "benchmarks/gpu_suite.sh: arguments of the second layer_full run (stage layer_full_b)"),
        EnvSetting("GDN_CP_LAYER_FULL_B_TIMEOUT", "benchmarks", "240",
                   "benchmarks/gpu_suite.sh: time limit of the second layer_full run", _SECONDS),
        EnvSetting("GDN_CP_TE", "benchmarks", ".te",
                   "benchmarks/gpu_suite.sh: folder of the slim-te pack (TransformerEngine 2.20.2), unpacked into .site-te/"),
        EnvSetting("GDN_CP_MLM", "benchmarks", ".mlm",
                   "benchmarks/gpu_suite.sh: folder holding a Megatron-LM checkout as *.tar.gz (patched for stage train_mlm)"),
        EnvSetting("GDN_CP_TRAIN_MLM_ARGS", "benchmarks", "",
                   "benchmarks/gpu_suite.sh: arguments of benchmarks/train_megatron_lm.py (stage train_mlm)"),
        EnvSetting("GDN_CP_TRAIN_MLM_TIMEOUT", "benchmarks", "420",
                   "benchmarks/gpu_suite.sh: time budget of the train_mlm stage", _SECONDS),
        EnvSetting("GDN_CP_TL", "benchmarks", ".tl",
                   "benchmarks/gpu_suite.sh: folder of the slim-tilelang pack (FlashQLA + TileLang), unpacked into .site-tl/"),
        EnvSetting("GDN_CP_GLUE_KERNELS_ARGS", "benchmarks", "",
                   "benchmarks/gpu_suite.sh: arguments of benchmarks/glue_kernels.py (stage glue_kernels)"),
        EnvSetting("GDN_CP_SAVE_TL_CACHE", "benchmarks", "1",
                   "benchmarks/gpu_suite.sh: 0 keeps no TileLang kernel cache tarball", _SWITCH),
        EnvSetting("GDN_CP_MLM_ONE_GPU", "tests", "0",
                   "set by gdn_cp_testing.megatron.lm for its rank processes: 1 when the ranks share one GPU (gloo)",
                   _SWITCH),
        EnvSetting("GDN_CP_MLM_GDN_CP_AT_CP1", "tests", "0",
                   "a run's environment for gdn_cp_testing.megatron.lm's rank processes: 1 hands every GDN call to "
                   "gdn-cp's path, CP=1 SBHD included (stock's code otherwise): a CP=1 run on gdn-cp's kernels",
                   _SWITCH),
    )
}

ALL_SETTINGS: dict[str, EnvSetting] = {**library.SETTINGS, **SETTINGS}
_LISTER = "python3 -m gdn_cp_testing.env"


def read(name: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """The checked value of the tests' or benchmarks' setting ``name`` (see :func:`gdn_cp.env.read`)."""
    return library.read(name, environ, SETTINGS)


def check_environment(environ: Optional[Mapping[str, str]] = None) -> None:
    """ValueError (one line) for the first ``GDN_CP_*`` variable set to a bad value, or in neither table."""
    library.check_environment(environ, ALL_SETTINGS, strict=True, lister=_LISTER)


def main(argv: Optional[list[str]] = None) -> int:
    """``python3 -m gdn_cp_testing.env``: print both tables, then check the environment (exit 2 and one
    line on stderr for a bad or unknown variable). ``--check``: only check (what
    benchmarks/gpu_suite.sh runs first)."""
    return library.main(argv, prog="gdn_cp_testing.env", settings=ALL_SETTINGS, check=check_environment)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
