"""Every ``GDN_CP_*`` environment variable, in one table, read and checked in one place.

Torch-free and imports nothing of gdn_cp, so every layer may read its settings here. Each entry
says who reads the variable (``gdn_cp``: the library and the ``gdn-cp`` command; ``tests`` /
``benchmarks``: those scripts only) and how a value is checked: every setting has its rule (a
choice, a number, a list), except the free-form ones (paths, a script's arguments), which are
passed on as they are and whose reader says when one does not work.

* :func:`read` returns the checked value of one setting (its default when unset or empty);
  a bad value is a ValueError that names the variable, the value and what it accepts.
* :func:`check_environment` checks every ``GDN_CP_*`` variable that is set: a bad value, or a
  name that is not in the table (a typo would otherwise be ignored). Every ``gdn-cp`` command
  calls it before doing anything else (one line on stderr, exit status 2), so a bad setting
  never surfaces later inside spawned ranks; so do the test session (tests/conftest.py: a
  usage error before any test is collected) and ``benchmarks/gpu_suite.sh``
  (``python3 -m gdn_cp.env --check``). ``python3 -m gdn_cp.env`` prints the table.

``tests/test_env.py`` fails when a ``GDN_CP_*`` name used anywhere in the repository is missing
from :data:`SETTINGS`.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

__all__ = ["CHUNKWISE_PATHS", "CHUNKWISE_PATH_ENV", "CHUNKWISE_SWAP_ENV", "PREFIX", "SETTINGS", "SUITE_STAGES",
           "SWAP_POINTS", "EnvSetting", "check_environment", "read", "table", "unknown_name_message"]

PREFIX = "GDN_CP_"
CHUNKWISE_PATH_ENV = "GDN_CP_CHUNKWISE_PATH"
CHUNKWISE_SWAP_ENV = "GDN_CP_CHUNKWISE_SWAP"
CHUNKWISE_PATHS = ("auto", "native", "generic")
"""The values of ``GDN_CP_CHUNKWISE_PATH`` (``Settings.chunkwise_path``, ``gdn_core(chunkwise_path=...)``)."""
SWAP_POINTS = ("auto", "hidden", "core")
"""The values of ``GDN_CP_CHUNKWISE_SWAP`` (``Settings.chunkwise_swap``): where chunkwise moves a layer's rows."""


def _one_of(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"use one of {', '.join(choices)}")
        return text

    return parse


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


SUITE_STAGES = ("tests", "args", "warm", "syncs", "selftest", "levers", "layer_full", "layer_full_b", "flashqla",
                "flashqla_tests", "flashqla_warm", "train_mlm")
"""The stages of ``benchmarks/gpu_suite.sh`` (its ``run_stage``)."""


def _stages(text: str) -> tuple[tuple[str, ...], ...]:
    """Space-separated groups, each of stages joined by ``+`` (run side by side)."""
    groups = tuple(tuple(group.split("+")) for group in text.split())
    if not groups or any(stage not in SUITE_STAGES for group in groups for stage in group):
        raise ValueError(f"use stages of {', '.join(SUITE_STAGES)}, separated by spaces, joined by + to run side "
                         'by side, e.g. "warm+tests layer_full"')
    return groups


def _json_argv(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise ValueError("use a JSON list of strings (the test sets it for its subprocess)")
    return value


def _any_text(text: str) -> str:
    """Free-form (a path, arguments of a script): taken as it is; its reader says when it does not work."""
    return text


@dataclass(frozen=True)
class EnvSetting:
    """One ``GDN_CP_*`` variable. ``parse`` turns the text into the value or raises ValueError
    saying what is accepted (:func:`_any_text` for free-form values: paths, argument strings)."""

    name: str
    read_by: str
    default: str
    help: str
    parse: Callable[[str], Any] = _any_text


_SECONDS = _positive_int("300")
_SWITCH = _one_of("0", "1")

SETTINGS: dict[str, EnvSetting] = {
    s.name: s
    for s in (
        EnvSetting(CHUNKWISE_PATH_ENV, "gdn_cp", "auto",
                   "how chunkwise exchanges halos and state summaries: auto, native (FLA's cp context) or "
                   "generic (gdn-cp's own); see gdn_cp.modes.chunkwise",
                   _one_of(*CHUNKWISE_PATHS)),
        EnvSetting(CHUNKWISE_SWAP_ENV, "gdn_cp", "auto",
                   "where chunkwise moves a Megatron layer's rows between layouts: auto (the fewer bytes), hidden "
                   "(hidden_states before in_proj) or core (q|k|v and the gates); see gdn_cp.modes.swap",
                   _one_of(*SWAP_POINTS)),
        EnvSetting("GDN_CP_FLASHQLA_AUTO_CP", "gdn_cp", "1",
                   "the FlashQLA backend's auto_cp (FlashQLA's own split of long sequences inside one GPU): 1 on "
                   "(FlashQLA's default), 0 off; see gdn_cp.ops.flashqla.auto_cp_setting", _SWITCH),
        EnvSetting("GDN_CP_TEST_DIST_BACKEND", "gdn_cp", "",
                   "the torch.distributed backend of rank pools that do not name one (gdn_cp.testing.ranks; "
                   "gdn-cp run takes --dist-backend, and says so when this is set to another)",
                   _one_of("gloo", "nccl")),
        EnvSetting("GDN_CP_TEST_PG_TIMEOUT", "gdn_cp", "180",
                   "seconds a rank of a rank pool waits in a collective (gdn_cp.testing.ranks)",
                   _positive_seconds),
        EnvSetting("GDN_CP_TEST_FAST_AUTOTUNE", "gdn_cp", "0",
                   "1: Triton autotuners take their first working config (tests only; timings then mean nothing)",
                   _SWITCH),
        EnvSetting("GDN_CP_ALLOW_SKIP_MEGATRON", "tests", "0", "1: skip, instead of fail, tests that need megatron-core",
                   _SWITCH),
        EnvSetting("GDN_CP_MEGATRON_SDIST", "tests", "", "path of the megatron-core sdist for the patch tests"),
        EnvSetting("GDN_CP_FUZZ_EXAMPLES", "tests", "",
                   "random examples per fuzz test (default: CI's derandomized few)", _positive_int("3000")),
        EnvSetting("GDN_CP_GPU_RESULTS", "tests", "", "JSON lines file the GPU tests append their results to"),
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
        EnvSetting("GDN_CP_WARM_ARGS", "benchmarks", "--cp 2", "benchmarks/gpu_suite.sh: arguments of the warm stage"),
        EnvSetting("GDN_CP_WARM_TIMEOUT", "benchmarks", "360", "benchmarks/gpu_suite.sh: time limit of the warm stage",
                   _SECONDS),
        EnvSetting("GDN_CP_SYNCS_TIMEOUT", "benchmarks", "240", "benchmarks/gpu_suite.sh: time limit of the syncs stage",
                   _SECONDS),
        EnvSetting("GDN_CP_LAYER_FULL_ARGS", "benchmarks", "", "arguments of benchmarks/layer_full.py in the suite"),
        EnvSetting("GDN_CP_LAYER_FULL_TIMEOUT", "benchmarks", "480", "benchmarks/gpu_suite.sh: time limit of layer_full",
                   _SECONDS),
        EnvSetting("GDN_CP_CACHE_MAX_MB", "benchmarks", "56", "benchmarks/gpu_suite.sh: largest Triton cache to keep",
                   _positive_int("56")),
        EnvSetting("GDN_CP_STACK", "benchmarks", "fla042",
                   "benchmarks/gpu_suite.sh: the FLA stack, fla042 (the carried wheels) or fla060 (the slim-triton pack)",
                   _one_of("fla042", "fla060")),
        EnvSetting("GDN_CP_SLIM", "benchmarks", ".slim", "benchmarks/gpu_suite.sh: folder of the slim-triton pack (fla060)"),
        EnvSetting("GDN_CP_SAVE_CACHE", "benchmarks", "1", "benchmarks/gpu_suite.sh: 0 keeps no Triton cache tarball",
                   _SWITCH),
        EnvSetting("GDN_CP_TESTS_FAST_AUTOTUNE", "benchmarks", "",
                   "benchmarks/gpu_suite.sh: GDN_CP_TEST_FAST_AUTOTUNE for the tests stage only", _SWITCH),
        EnvSetting("GDN_CP_SELFTEST_TIMEOUT", "benchmarks", "300",
                   "benchmarks/gpu_suite.sh: time limit of the selftest stage", _SECONDS),
        EnvSetting("GDN_CP_LEVERS_ARGS", "benchmarks", "", "benchmarks/gpu_suite.sh: arguments of fla_levers.py"),
        EnvSetting("GDN_CP_LEVERS_TIMEOUT", "benchmarks", "360", "benchmarks/gpu_suite.sh: time limit of the levers stage",
                   _SECONDS),
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
        EnvSetting("GDN_CP_FLASHQLA_ARGS", "benchmarks", "",
                   "benchmarks/gpu_suite.sh: arguments of benchmarks/flashqla_probe.py (stage flashqla)"),
        EnvSetting("GDN_CP_FLASHQLA_TIMEOUT", "benchmarks", "540",
                   "benchmarks/gpu_suite.sh: time limit of the flashqla stage (the probe's --time-limit)", _SECONDS),
        EnvSetting("GDN_CP_SAVE_TL_CACHE", "benchmarks", "1",
                   "benchmarks/gpu_suite.sh: 0 keeps no TileLang kernel cache tarball", _SWITCH),
        EnvSetting("GDN_CP_MLM_ONE_GPU", "gdn_cp", "0",
                   "set by gdn_cp.testing.megatron.lm for its rank processes: 1 when the ranks share one GPU (gloo)",
                   _SWITCH),
    )
}


def _bad_value(setting: EnvSetting, text: str, why: str) -> ValueError:
    return ValueError(f"environment variable {setting.name}={text!r}: {why} (or unset it: default "
                      f"{setting.default or 'none'}); it sets {setting.help}")


def read(name: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """The checked value of setting ``name`` (an empty or unset variable gives the default; a
    setting without a default then reads as ``""``)."""
    setting = SETTINGS[name]
    env = os.environ if environ is None else environ
    text = env.get(name, "") or setting.default
    if text == "":
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
            raise ValueError(unknown_name_message(name))
        read(name, env)


def unknown_name_message(name: str) -> str:
    """One line for a ``GDN_CP_*`` name that is not in the table: the closest names, not all of them."""
    tails = {n[len(PREFIX):]: n for n in SETTINGS}  # the shared prefix would make every name look close
    close = [tails[t] for t in difflib.get_close_matches(name[len(PREFIX):], tails, n=2, cutoff=0.75)]
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    return (f"environment variable {name} is not a gdn-cp setting (a typo?); {hint}unset it, or pick one of the "
            f"{len(SETTINGS)} settings that `python3 -m gdn_cp.env` lists")


def table() -> str:
    """Every setting, one line each: name, who reads it, default, what it sets."""
    width = max(map(len, SETTINGS))
    return "\n".join(f"{s.name:<{width}}  {s.read_by:<10}  default {s.default or 'none':<16}  {s.help}"
                     for s in SETTINGS.values())


def main(argv: Optional[list[str]] = None) -> int:
    """``python3 -m gdn_cp.env``: print the table, then check the environment (exit 2 and one line
    on stderr for a bad or unknown variable, as every gdn-cp command does). ``--check``: only check
    (what benchmarks/gpu_suite.sh runs first)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if args not in ([], ["--check"]):
        print("usage: python3 -m gdn_cp.env [--check]", file=sys.stderr)
        return 2
    if not args:
        print(table())
    try:
        check_environment()
    except ValueError as err:
        print(f"gdn_cp.env: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
