"""The library's ``GDN_CP_*`` environment variables, in one table, read and checked in one place.

Torch-free and imports nothing of gdn_cp, so every layer may read its settings here. The table holds
what the library reads (:data:`SETTINGS`: the chunkwise exchange path and the layout swap point, and
FlashQLA's auto_cp, which its backend's spec names; all read into :class:`gdn_cp.modes.settings.Settings`
where a call comes in; and whether TileLang's compile warnings show, read once per process where FlashQLA is
first used); each entry says how a value is checked. The tests' and benchmarks' variables
have their own table in the same form (``gdn_cp_testing.env``, not shipped).

* :func:`read` returns the checked value of one setting (its default when unset or empty);
  a bad value is a ValueError that names the variable, the value and what it accepts.
* :func:`check_environment` checks every ``GDN_CP_*`` variable of the table that is set, and refuses
  a name that is not in it but close to one of its names (a typo would otherwise be ignored). Every
  ``gdn-cp`` command calls it before doing anything else (one line on stderr, exit status 2), so a
  bad setting never surfaces later inside spawned ranks. Other ``GDN_CP_*`` names are the tests' and
  benchmarks' (``gdn-cp`` takes no setting from them): the test session and ``benchmarks/gpu_suite.sh`` check
  both tables, and refuse any name in neither (``python3 -m gdn_cp_testing.env --check``).
  ``python3 -m gdn_cp.env`` prints this table.
* :data:`CLONE_NAMES` names the tests' and benchmarks' variables (their table, with its rules, is
  ``gdn_cp_testing.env``, which a wheel does not ship), so that :func:`who_reads` can say of any
  ``GDN_CP_*`` name whether gdn-cp, a clone's tests or benchmarks, or nothing reads it
  (``gdn-cp doctor`` lists them so; ``gdn-cp run`` warns once about a name nothing reads).

``tests/test_env.py`` fails when a ``GDN_CP_*`` name used anywhere in the repository is in neither table,
when :data:`CLONE_NAMES` is not the tests' table, and when docs/errors.md's list is not :data:`SETTINGS`.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

__all__ = ["CHUNKWISE_PATHS", "CHUNKWISE_PATH_ENV", "CHUNKWISE_SWAP_ENV", "CLONE_NAMES", "GLUE_CHOICES", "GLUE_ENV",
           "NATIVE_WARNINGS", "NATIVE_WARNINGS_ENV", "NOBODY", "PREFIX", "SETTINGS", "SWAP_POINTS", "EnvSetting", "any_text",
           "check_environment", "one_of", "read", "set_names", "table", "unknown_name_message", "unread_names", "who_reads"]

PREFIX = "GDN_CP_"
CHUNKWISE_PATH_ENV = "GDN_CP_CHUNKWISE_PATH"
CHUNKWISE_SWAP_ENV = "GDN_CP_CHUNKWISE_SWAP"
GLUE_ENV = "GDN_CP_GLUE"
GLUE_CHOICES = ("auto", "triton", "triton_one_pass", "triton_norm", "triton_norm_dz_copy", "triton_norm_dz_copy_scan",
                "compiled", "unfused")
"""The values of ``GDN_CP_GLUE`` (``Settings.glue``): how a GPU runs the conv + SiLU + split + l2 norm and
the gates (:mod:`gdn_cp.ops.fused`); ``auto`` is the measured default."""
CHUNKWISE_PATHS = ("auto", "native", "generic")
"""The values of ``GDN_CP_CHUNKWISE_PATH`` (``Settings.chunkwise_path``, ``gdn_core(chunkwise_path=...)``)."""
SWAP_POINTS = ("auto", "hidden", "core")
"""The values of ``GDN_CP_CHUNKWISE_SWAP`` (``Settings.chunkwise_swap``): where chunkwise moves a layer's rows."""
NATIVE_WARNINGS_ENV = "GDN_CP_NATIVE_WARNINGS"
NATIVE_WARNINGS = ("hide", "show")
"""The values of ``GDN_CP_NATIVE_WARNINGS``: whether TileLang's compile warnings (C++, on stderr) are kept out of a
process that runs FlashQLA (:mod:`gdn_cp.ops.flashqla.native_warnings`); read once per process, not per call."""


def one_of(*choices: str) -> Callable[[str], str]:
    """A rule: the text is one of ``choices``."""
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"use one of {', '.join(choices)}")
        return text

    return parse


def any_text(text: str) -> str:
    """Free-form (a path, arguments of a script): taken as it is; its reader says when it does not work."""
    return text


@dataclass(frozen=True)
class EnvSetting:
    """One ``GDN_CP_*`` variable. ``parse`` turns the text into the value or raises ValueError
    saying what is accepted (:func:`any_text` for free-form values: paths, argument strings)."""

    name: str
    read_by: str
    default: str
    help: str
    parse: Callable[[str], Any] = any_text


SETTINGS: dict[str, EnvSetting] = {
    s.name: s
    for s in (
        EnvSetting(CHUNKWISE_PATH_ENV, "gdn_cp", "auto",
                   "how chunkwise exchanges halos and state summaries: auto, native (FLA's cp context) or "
                   "generic (gdn-cp's own); see gdn_cp.modes.chunkwise",
                   one_of(*CHUNKWISE_PATHS)),
        EnvSetting(CHUNKWISE_SWAP_ENV, "gdn_cp", "auto",
                   "where chunkwise moves a Megatron layer's rows between layouts: auto (the fewer bytes), hidden "
                   "(hidden_states before in_proj) or core (q|k|v and the gates); see gdn_cp.modes.swap",
                   one_of(*SWAP_POINTS)),
        EnvSetting(GLUE_ENV, "gdn_cp", "auto",
                   "how a GPU runs the per-token glue around the core (conv + SiLU + q/k/v split + l2 norm, gates): "
                   "auto (the measured default), triton (gdn-cp's kernels), compiled (torch.compile) or unfused "
                   "(the backend's conv kernel, the kernel's l2 norm, gates op by op); see gdn_cp.ops.fused",
                   one_of(*GLUE_CHOICES)),
        EnvSetting("GDN_CP_FLASHQLA_AUTO_CP", "gdn_cp", "1",
                   "the FlashQLA backend's auto_cp (FlashQLA's own split of long sequences inside one GPU): 1 on "
                   "(FlashQLA's default), 0 off; see gdn_cp.ops.flashqla.spec.AUTO_CP_ENV", one_of("0", "1")),
        EnvSetting(NATIVE_WARNINGS_ENV, "gdn_cp", "hide",
                   "TileLang's compile warnings (C++, on stderr) and INFO log (stdout) while FlashQLA's kernels "
                   "compile: hide (a filter process keeps the warnings out and counts them in one line at exit; the "
                   "log at WARNING) or show (as TileLang prints them; so does gdn_cp's log at DEBUG, gdn-cp -v); see "
                   "gdn_cp.ops.flashqla.native_warnings",
                   one_of(*NATIVE_WARNINGS)),
    )
}


CLONE_NAMES: dict[str, tuple[str, ...]] = {
    "tests": (
        "GDN_CP_ALLOW_SKIP_MEGATRON", "GDN_CP_BENCHMARKS", "GDN_CP_FUZZ_EXAMPLES", "GDN_CP_GPU_RESULTS",
        "GDN_CP_GPU_TP_DTYPES", "GDN_CP_MEGATRON_SDIST", "GDN_CP_MLM_GDN_CP_AT_CP1", "GDN_CP_MLM_ONE_GPU", "GDN_CP_README_COMMAND",
        "GDN_CP_TEST_DIST_BACKEND", "GDN_CP_TEST_FAST_AUTOTUNE", "GDN_CP_TEST_OUTCOMES", "GDN_CP_TEST_PG_TIMEOUT",
        "GDN_CP_TMP",
    ),
    "benchmarks": (
        "GDN_CP_CACHE_MAX_MB", "GDN_CP_GLUE_KERNELS_ARGS", "GDN_CP_LAYER_FULL_ARGS",
        "GDN_CP_LAYER_FULL_B_ARGS", "GDN_CP_LAYER_FULL_B_TIMEOUT", "GDN_CP_LAYER_FULL_TIMEOUT", "GDN_CP_MLM",
        "GDN_CP_SAVE_AUTOTUNE", "GDN_CP_SAVE_CACHE", "GDN_CP_SAVE_TL_CACHE",
        "GDN_CP_SLIM", "GDN_CP_STACK", "GDN_CP_STAGES", "GDN_CP_SUITE_TIMEOUT", "GDN_CP_SYNCS_ARGS", "GDN_CP_SYNCS_TIMEOUT",
        "GDN_CP_TE",
        "GDN_CP_TESTS_FAST_AUTOTUNE", "GDN_CP_TL", "GDN_CP_TRAIN_MLM_ARGS", "GDN_CP_TRAIN_MLM_TIMEOUT",
        "GDN_CP_WGRADS_ARGS",
    ),
}
"""The names of the tests' and the benchmarks' variables (of a clone: ``gdn_cp_testing.env`` holds their
rules; gdn-cp takes no setting from them: ``gdn-cp run`` only notes the tests' rank-pool backend,
``GDN_CP_TEST_DIST_BACKEND``, where it differs from the run's), by reader. Only their names live here, so that the command can tell
them from names that nothing reads (tests/test_env.py keeps them equal to that table)."""

NOBODY = "nothing"
"""What :func:`who_reads` says of a ``GDN_CP_*`` name in neither table."""


def who_reads(name: str) -> str:
    """Who reads the variable ``name``: ``gdn_cp`` (the library's table), ``tests`` or ``benchmarks``
    (of a clone), or :data:`NOBODY`."""
    if name in SETTINGS:
        return SETTINGS[name].read_by
    return next((reader for reader, names in CLONE_NAMES.items() if name in names), NOBODY)


def set_names(environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """The ``GDN_CP_*`` variables set (non-empty or not) in ``environ``, sorted."""
    env = os.environ if environ is None else environ
    return sorted(n for n in env if n.startswith(PREFIX))


def unread_names(environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """The ``GDN_CP_*`` variables set in ``environ`` that nothing reads (neither gdn-cp nor a clone's tests
    and benchmarks): a guessed name, a misspelling, a variable of another version."""
    return [n for n in set_names(environ) if who_reads(n) == NOBODY]


def _bad_value(setting: EnvSetting, text: str, why: str) -> ValueError:
    return ValueError(f"environment variable {setting.name}={text!r}: {why} (or unset it: default "
                      f"{setting.default or 'none'}); it sets {setting.help}")


def read(name: str, environ: Optional[Mapping[str, str]] = None, settings: Mapping[str, EnvSetting] = SETTINGS) -> Any:
    """The checked value of setting ``name`` of ``settings`` (an empty or unset variable gives the
    default; a setting without a default then reads as ``""``)."""
    setting = settings[name]
    env = os.environ if environ is None else environ
    text = env.get(name, "") or setting.default
    if text == "":
        return text
    try:
        return setting.parse(text)
    except ValueError as err:
        raise _bad_value(setting, text, str(err)) from None


def check_environment(environ: Optional[Mapping[str, str]] = None, settings: Mapping[str, EnvSetting] = SETTINGS,
                      *, strict: bool = False, lister: str = "python3 -m gdn_cp.env") -> None:
    """ValueError (one line) for the first ``GDN_CP_*`` variable of ``settings`` set to a bad value,
    or whose name is not in ``settings`` but close to one of its names (a typo); with ``strict``, for
    any name not in ``settings``. None when every one is fine."""
    env = os.environ if environ is None else environ
    for name in sorted(n for n in env if n.startswith(PREFIX)):
        if name in settings:
            read(name, env, settings)
        elif strict or _close_names(name, settings):
            raise ValueError(unknown_name_message(name, settings, lister))


def _close_names(name: str, settings: Mapping[str, EnvSetting]) -> list[str]:
    tails = {n[len(PREFIX):]: n for n in settings}  # the shared prefix would make every name look close
    return [tails[t] for t in difflib.get_close_matches(name[len(PREFIX):], tails, n=2, cutoff=0.75)]


def unknown_name_message(name: str, settings: Mapping[str, EnvSetting] = SETTINGS,
                         lister: str = "python3 -m gdn_cp.env") -> str:
    """One line for a ``GDN_CP_*`` name that is not in the table: the closest names, not all of them."""
    close = _close_names(name, settings)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    return (f"environment variable {name} is not a gdn-cp setting (a typo?); {hint}unset it, or pick one of the "
            f"{len(settings)} settings that `{lister}` lists")


def table(settings: Mapping[str, EnvSetting] = SETTINGS) -> str:
    """Every setting, one line each: name, who reads it, default, what it sets."""
    width = max(map(len, settings))
    return "\n".join(f"{s.name:<{width}}  {s.read_by:<10}  default {s.default or 'none':<16}  {s.help}"
                     for s in settings.values())


def main(argv: Optional[list[str]] = None, *, prog: str = "gdn_cp.env", settings: Mapping[str, EnvSetting] = SETTINGS,
         check: Optional[Callable[[], None]] = None) -> int:
    """``python3 -m gdn_cp.env``: print the table, then check the environment (exit 2 and one line
    on stderr for a bad variable or a misspelt name, as every gdn-cp command does). ``--check``:
    only check. ``prog`` / ``settings`` / ``check``: another table's module (the tests')."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if args not in ([], ["--check"]):
        print(f"usage: python3 -m {prog} [--check]", file=sys.stderr)
        return 2
    if not args:
        print(table(settings))
    try:
        (check or check_environment)()
    except ValueError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
