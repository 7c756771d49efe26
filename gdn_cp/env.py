"""Every ``GDN_CP_*`` environment variable, in one table, read and checked in one place.

Torch-free and imports nothing of gdn_cp, so every layer may read its settings here. Each entry
says who reads the variable (``gdn_cp``: the library and the ``gdn-cp`` command; ``tests`` /
``benchmarks``: those scripts only) and, for the ones gdn_cp reads, how a value is checked.

* :func:`read` returns the checked value of one setting (its default when unset or empty);
  a bad value is a ValueError that names the variable, the value and what it accepts.
* :func:`check_environment` checks every ``GDN_CP_*`` variable that is set: a bad value, or a
  name that is not in the table (a typo would otherwise be ignored). Every ``gdn-cp`` command
  calls it before doing anything else (one line on stderr, exit status 2), so a bad setting
  never surfaces later inside spawned ranks.

``tests/test_env.py`` fails when a ``GDN_CP_*`` name used anywhere in the repository is missing
from :data:`SETTINGS`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

__all__ = ["CHUNKWISE_PATHS", "PREFIX", "SETTINGS", "EnvSetting", "check_environment", "read"]

PREFIX = "GDN_CP_"
CHUNKWISE_PATHS = ("auto", "native", "generic")
"""The values of ``GDN_CP_CHUNKWISE_PATH`` (and of ``gdn_cp.modes.set_chunkwise_path``)."""


def _one_of(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"use one of {', '.join(choices)}")
        return text

    return parse


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError("use a number of seconds > 0, e.g. 180")
    return value


@dataclass(frozen=True)
class EnvSetting:
    """One ``GDN_CP_*`` variable. ``parse`` (for the ones gdn_cp reads) turns the text into the
    value or raises ValueError saying what is accepted; None: the reader checks it itself."""

    name: str
    read_by: str
    default: str
    help: str
    parse: Optional[Callable[[str], Any]] = None


SETTINGS: dict[str, EnvSetting] = {
    s.name: s
    for s in (
        EnvSetting("GDN_CP_CHUNKWISE_PATH", "gdn_cp", "auto",
                   "how chunkwise exchanges halos and state summaries: auto, native (FLA's cp context) or "
                   "generic (gdn-cp's own); see gdn_cp.modes.set_chunkwise_path",
                   _one_of(*CHUNKWISE_PATHS)),
        EnvSetting("GDN_CP_TEST_DIST_BACKEND", "gdn_cp", "",
                   "the torch.distributed backend of rank pools that do not name one (gdn_cp.testing.ranks)",
                   _one_of("gloo", "nccl")),
        EnvSetting("GDN_CP_TEST_PG_TIMEOUT", "gdn_cp", "180",
                   "seconds a rank of a rank pool waits in a collective (gdn_cp.testing.ranks)",
                   _positive_seconds),
        EnvSetting("GDN_CP_TEST_FAST_AUTOTUNE", "gdn_cp", "0",
                   "1: Triton autotuners take their first working config (tests only; timings then mean nothing)",
                   _one_of("0", "1")),
        EnvSetting("GDN_CP_ALLOW_SKIP_MEGATRON", "tests", "", "1: skip, instead of fail, tests that need megatron-core"),
        EnvSetting("GDN_CP_MEGATRON_SDIST", "tests", "", "path of the megatron-core sdist for the patch tests"),
        EnvSetting("GDN_CP_FUZZ_EXAMPLES", "tests", "", "random examples per fuzz test (default: CI's derandomized few)"),
        EnvSetting("GDN_CP_GPU_RESULTS", "tests", "", "JSON lines file the GPU tests append their results to"),
        EnvSetting("GDN_CP_GPU_TP_DTYPES", "tests", "bfloat16,float32", "dtypes of the GPU TP x CP tests"),
        EnvSetting("GDN_CP_BENCHMARKS", "tests", "",
                   "benchmarks/ folder, handed to the fake Megatron-LM scripts of tests/megatron/test_megatron_lm_launcher.py"),
        EnvSetting("GDN_CP_TMP", "tests", "",
                   "scratch folder of the fake Megatron-LM scripts of tests/megatron/test_megatron_lm_launcher.py"),
        EnvSetting("GDN_CP_README_COMMAND", "tests", "",
                   "the README's training command, handed to a subprocess by tests/megatron/test_training_args.py"),
        EnvSetting("GDN_CP_STAGES", "benchmarks", "", "stages of benchmarks/gpu_suite.sh"),
        EnvSetting("GDN_CP_SUITE_TIMEOUT", "benchmarks", "", "benchmarks/gpu_suite.sh: time limit of the test stage"),
        EnvSetting("GDN_CP_WARM_ARGS", "benchmarks", "", "benchmarks/gpu_suite.sh: arguments of the warm stage"),
        EnvSetting("GDN_CP_WARM_TIMEOUT", "benchmarks", "", "benchmarks/gpu_suite.sh: time limit of the warm stage"),
        EnvSetting("GDN_CP_SYNCS_TIMEOUT", "benchmarks", "", "benchmarks/gpu_suite.sh: time limit of the syncs stage"),
        EnvSetting("GDN_CP_LAYER_FULL_ARGS", "benchmarks", "", "arguments of benchmarks/layer_full.py in the suite"),
        EnvSetting("GDN_CP_LAYER_FULL_TIMEOUT", "benchmarks", "", "benchmarks/gpu_suite.sh: time limit of layer_full"),
        EnvSetting("GDN_CP_CACHE_MAX_MB", "benchmarks", "", "benchmarks/gpu_suite.sh: largest Triton cache to keep"),
        EnvSetting("GDN_CP_STACK", "benchmarks", "fla042",
                   "benchmarks/gpu_suite.sh: the FLA stack, fla042 (the carried wheels) or fla060 (the slim-triton pack)"),
        EnvSetting("GDN_CP_SLIM", "benchmarks", ".slim", "benchmarks/gpu_suite.sh: folder of the slim-triton pack (fla060)"),
        EnvSetting("GDN_CP_SAVE_CACHE", "benchmarks", "1", "benchmarks/gpu_suite.sh: 0 keeps no Triton cache tarball"),
        EnvSetting("GDN_CP_TESTS_FAST_AUTOTUNE", "benchmarks", "",
                   "benchmarks/gpu_suite.sh: GDN_CP_TEST_FAST_AUTOTUNE for the tests stage only"),
        EnvSetting("GDN_CP_SELFTEST_TIMEOUT", "benchmarks", "", "benchmarks/gpu_suite.sh: time limit of the selftest stage"),
        EnvSetting("GDN_CP_LEVERS_ARGS", "benchmarks", "", "benchmarks/gpu_suite.sh: arguments of fla_levers.py"),
        EnvSetting("GDN_CP_LEVERS_TIMEOUT", "benchmarks", "", "benchmarks/gpu_suite.sh: time limit of the levers stage"),
        EnvSetting("GDN_CP_LAYER_FULL_B_ARGS", "benchmarks", "",
                   "benchmarks/gpu_suite.sh: arguments of the second layer_full run (stage layer_full_b)"),
        EnvSetting("GDN_CP_LAYER_FULL_B_TIMEOUT", "benchmarks", "",
                   "benchmarks/gpu_suite.sh: time limit of the second layer_full run"),
        EnvSetting("GDN_CP_TE", "benchmarks", ".te",
                   "benchmarks/gpu_suite.sh: folder of the slim-te pack (TransformerEngine 2.20.2), unpacked into .site-te/"),
        EnvSetting("GDN_CP_MLM", "benchmarks", ".mlm",
                   "benchmarks/gpu_suite.sh: folder holding a Megatron-LM checkout as *.tar.gz (patched for stage train_mlm)"),
        EnvSetting("GDN_CP_TRAIN_MLM_ARGS", "benchmarks", "",
                   "benchmarks/gpu_suite.sh: arguments of benchmarks/train_megatron_lm.py (stage train_mlm)"),
        EnvSetting("GDN_CP_TRAIN_MLM_TIMEOUT", "benchmarks", "",
                   "benchmarks/gpu_suite.sh: time budget of the train_mlm stage"),
        EnvSetting("GDN_CP_MLM_ONE_GPU", "gdn_cp", "0",
                   "set by gdn_cp.testing.megatron_lm for its rank processes: 1 when the ranks share one GPU (gloo)",
                   _one_of("0", "1")),
    )
}


def _bad_value(setting: EnvSetting, text: str, why: str) -> ValueError:
    return ValueError(f"environment variable {setting.name}={text!r}: {why} (or unset it: default "
                      f"{setting.default or 'none'}); it sets {setting.help}")


def read(name: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """The checked value of setting ``name`` (an empty or unset variable gives the default)."""
    setting = SETTINGS[name]
    env = os.environ if environ is None else environ
    text = env.get(name, "") or setting.default
    if setting.parse is None or text == "":
        return text
    try:
        return setting.parse(text)
    except ValueError as err:
        raise _bad_value(setting, text, str(err)) from None


def check_environment(environ: Optional[Mapping[str, str]] = None) -> None:
    """ValueError (one line) for the first ``GDN_CP_*`` variable that is set to a bad value or is
    not a gdn-cp setting at all; None when every one is fine."""
    env = os.environ if environ is None else environ
    for name in sorted(n for n in env if n.startswith(PREFIX)):
        if name not in SETTINGS:
            raise ValueError(
                f"environment variable {name} is not a gdn-cp setting (a typo?); unset it, or use one of "
                f"{', '.join(sorted(SETTINGS))}"
            )
        read(name, env)
