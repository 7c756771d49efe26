"""The ``gdn-cp`` command: the top-level parser, ``doctor`` and ``selftest``'s flags, and :func:`main`.

Every command goes through :func:`main`, which keeps the rules of :mod:`gdn_cp.cli.output` for
all of them: every ``GDN_CP_*`` environment variable is checked before the command runs; a
:class:`~gdn_cp.cli.output.CommandError` becomes one ``gdn-cp <command>: error: ...`` line and its
exit status; a reader that closes the output early (``| head``) ends the command quietly.
Importing this module imports no torch (``--help`` and ``patch`` run without it).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import textwrap

from .. import __version__, env
from ..checks import MAX_CP_SIZE, MAX_TP_SIZE
from ..pins import PINS
from ..modes.spec import AUTO, MODE_NAMES
from .args import existing_path, int_list, int_range
from .output import EXIT_STATUS, EXIT_USAGE, CommandError, exit_epilog, print_error
from .patch import add_patch_commands
from .route import add_route_command
from .run import add_run_command

__all__ = ["OneLineErrorParser", "build_parser", "main"]

EXIT_BROKEN_PIPE = 141
"""128 + SIGPIPE: what a Unix tool killed by a closed pipe exits with (``gdn-cp ... | head``)."""

_DESCRIPTION = (f"gdn-cp: context parallelism ({', '.join(MODE_NAMES)}) for Gated DeltaNet layers on "
                f"Megatron-Core {', '.join(PINS)}.")

_EPILOG = f"""\
`gdn-cp COMMAND --help` describes each command, and what its -v (more) and -q (less) print; both go before or
after COMMAND.

{textwrap.fill(EXIT_STATUS, width=100)}
"""


VERBOSITY = {
    "run": ("also print every rank's log: its THD cut, route, mode, backend and chunkwise exchange path",
            "print only the failures and the verdict"),
    "route": ("print every rank's transfers and chunkwise plan in full, as --all does",
              "print only the packing's line (sequences, T_global, cp, T_local): a check that it splits"),
    "patch": ("also print each target file's sha256 beside the release's and the patched one's",
              "print only the outcome: check, its state line; apply / revert, the line saying what was done"),
    "doctor": ("also print the folder each installed package is imported from",
               "print only the problems found (nothing when there is none) and, with --heads, what auto resolves to"),
    "selftest": ("also print the error of every output and gradient of every check, the passed ones too",
                 "print only the verdict, the failed checks and the notes on known hazards"),
}
"""What -v and -q print, per command (each command's ``--help`` shows its own pair, written here once).
Both also set the log level (-v DEBUG, -q WARNING); with --json they change only the log on stderr."""

_VERBOSE_HELP = "also print the DEBUG log; what each command prints more: gdn-cp COMMAND --help"
_QUIET_HELP = "print only warnings of the log; what each command prints less: gdn-cp COMMAND --help"


def _verbosity_flags(command: str, *, has_json: bool = True) -> argparse.ArgumentParser:
    """The parent parser of ``command``'s -v / -q, with that command's help (:data:`VERBOSITY`).
    Their SUPPRESS default keeps a command's parser from resetting one given before the command."""
    more, less = VERBOSITY[command]
    json_note = " (with --json: the log only)" if has_json else ""
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                       help=f"{more}; and the DEBUG log{json_note}")
    flags.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                       help=f"{less}; and of the log only warnings{json_note}")
    return flags


def _cmd_doctor(args) -> int:
    from .doctor import run_doctor

    heads = None if args.heads is None else tuple(args.heads)
    printed: list[str] = []
    echo = print
    if args.quiet and not args.json:  # -q: the problem lines and auto's line, as the report words them
        def echo(line: str) -> None:
            if line.startswith("problem: ") or line.lstrip().startswith(f"{AUTO} "):
                print(line)
    elif args.verbose and not args.json:
        echo = printed.append  # printed below, with where each package is imported from
    try:
        status = run_doctor(heads=heads, tp=args.tp, cp=args.cp, path=args.path, as_json=args.json, echo=echo)
    except ValueError as err:
        raise CommandError(str(err)) from None
    if printed:
        _print_with_locations(printed)
    return status


def _print_with_locations(lines: list[str]) -> None:
    """``doctor -v``: the report, each package of its versions block followed by where it is imported
    from (found without importing it; ``-`` where it is not installed)."""
    in_versions = False
    for line in lines:
        print(line)
        if line == "versions:":
            in_versions = True
            continue
        in_versions = in_versions and line.startswith("  ")
        if in_versions:
            folders = _package_folders(line[2:].split("  ")[0].strip())
            if folders:
                print(f"  {'':<24} from {', '.join(folders)}")


def _package_folders(name: str) -> list[str]:
    """Where the distribution ``name`` (``torch``, ``megatron-core``; ``python``: the interpreter) is imported
    from: its top-level packages' folders, found without importing them ([] for anything else)."""
    import importlib.metadata
    import importlib.util

    if name == "python":
        return [sys.executable]
    wanted = name.lower().replace("_", "-")
    folders = []
    for top, dists in importlib.metadata.packages_distributions().items():
        if wanted not in (d.lower().replace("_", "-") for d in dists) or top.startswith("_"):
            continue
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            continue
        if spec is not None:
            found = list(spec.submodule_search_locations or []) or ([spec.origin] if spec.origin else [])
            folders += [f for f in found if f not in folders]
    return folders


def _cmd_selftest(args) -> int:
    from .selftest import run_selftest_command  # imports torch

    return run_selftest_command(args)


def _add_doctor_command(sub) -> None:
    p = sub.add_parser(
        "doctor", parents=[_verbosity_flags("doctor")], help="versions, patch state, GPUs, and which linear_cp_mode fits a head shape",
        description="Report gdn-cp / torch / megatron-core / FLA / Triton versions, GPUs, the GDN_CP_* environment "
        "variables set (and who reads each: gdn-cp, a clone's tests or benchmarks, or nothing), the patch state of the importable megatron-core (or of --path), and, for --heads K,V "
        "(with --tp and --cp), which linear_cp_mode values are legal and what auto resolves to, with reasons. "
        "Runs without torch (and says so).",
        epilog=exit_epilog("the megatron-core files are partially patched, modified or missing, or no mode is "
                           "legal for --heads"))
    p.add_argument("--heads", type=int_list(1, count=2), default=None, metavar="K,V",
                   help="linear key,value heads (linear_num_key_heads, linear_num_value_heads), e.g. 16,32")
    p.add_argument("--tp", type=int_range(1, MAX_TP_SIZE, high_why=" (the largest TP group gdn-cp plans for)"),
                   default=None, help=f"tensor-parallel size for --heads, in [1, {MAX_TP_SIZE}] (default 1)")
    p.add_argument("--cp", type=int_range(1, MAX_CP_SIZE, high_why=" (the largest CP group gdn-cp plans for)"),
                   default=None, help=f"context-parallel size for --heads, in [1, {MAX_CP_SIZE}] (default 1)")
    p.add_argument("--path", type=existing_path, default=None,
                   help="Megatron-LM checkout or site-packages (default: the importable megatron)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object (with its problems)")
    p.set_defaults(func=_cmd_doctor)


def _add_selftest_command(sub) -> None:
    p = sub.add_parser(
        "selftest", parents=[_verbosity_flags("selftest")], help="check the math backends on this machine (FLA against the reference)",
        description="With a CUDA GPU and flash-linear-attention: FLA's kernels (float32, bfloat16) against the "
        "plain-torch reference in float64, outputs and gradients (catches broken FLA/Triton stacks). Without "
        "them: the reference backend in float32 against float64 on the CPU, and the report says that FLA was "
        "not checked and why. Context parallelism is checked by `gdn-cp run`, not here.",
        epilog=exit_epilog("a backend disagrees with the reference beyond the tolerance, or fails"))
    p.add_argument("--gpu", action="store_true",
                   help="insist on the FLA check (exit 2 where there is no CUDA GPU or FLA does not import)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_cmd_selftest)


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors keep the exit-status rule: one line on stderr (``PROG: error:
    MESSAGE; usage: PROG --help``), exit status 2, nothing on stdout. argparse's usage block is
    what ``--help`` prints; the subparsers of every command are of this class too."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        print_error(self.prog, f"{message}; usage: {self.prog} --help")
        self.exit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    """The ``gdn-cp`` parser; each command sets ``func`` (returns the exit status) and ``prog``."""
    parser = OneLineErrorParser(
        prog="gdn-cp", description=_DESCRIPTION, epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-V", "--version", action="version", version=f"gdn-cp {__version__}",
                        help="print gdn-cp's version and exit")
    parser.add_argument("-v", "--verbose", action="store_true", help=_VERBOSE_HELP)
    parser.add_argument("-q", "--quiet", action="store_true", help=_QUIET_HELP)
    # -v / -q on every command, each with the command's own help (VERBOSITY)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")

    add_run_command(sub, [_verbosity_flags("run")])
    add_route_command(sub, [_verbosity_flags("route")])
    add_patch_commands(sub, [_verbosity_flags("patch", has_json=False)])
    _add_doctor_command(sub)
    _add_selftest_command(sub)
    for name, command in sub.choices.items():
        command.set_defaults(prog=f"gdn-cp {name}")  # patch's actions set their own
    return parser


def _quiet_stdout() -> None:
    """After a reader closed our stdout: point it at /dev/null, so that flushing at exit cannot
    raise a second BrokenPipeError."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout without a file descriptor (captured)
        pass
    finally:
        os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    """Run ``gdn-cp`` with ``argv``; returns the exit status (see :data:`gdn_cp.cli.output.EXIT_STATUS`)."""
    try:
        status = _main(argv)
        sys.stdout.flush()  # a reader that went away shows here, not in the interpreter's exit flush
        return status
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_BROKEN_PIPE


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command they were given to, not by the top level
        print_error(getattr(args, "prog", "gdn-cp"), f"unrecognized arguments: {' '.join(unknown)}; usage: "
                    f"{getattr(args, 'prog', 'gdn-cp')} --help")
        return EXIT_USAGE
    if args.verbose and args.quiet:
        print_error(getattr(args, "prog", "gdn-cp"), "-v and -q contradict each other: give one; usage: "
                    f"{getattr(args, 'prog', 'gdn-cp')} --help")
        return EXIT_USAGE
    level = logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if args.command is None:
        commands = ", ".join(parser._subparsers._group_actions[0].choices)  # noqa: SLF001 - argparse keeps them here
        print_error("gdn-cp", f"name a COMMAND ({commands}); usage: gdn-cp --help")
        return EXIT_USAGE
    try:
        env.check_environment()
    except ValueError as err:
        print_error(args.prog, str(err))
        return EXIT_USAGE
    try:
        return int(args.func(args) or 0)
    except CommandError as err:
        print_error(args.prog, str(err))
        return err.status
    except ModuleNotFoundError as err:
        if err.name not in ("torch", "numpy"):
            raise
        print_error(args.prog, f"this command needs {err.name}, which does not import here ({err}); install it "
                    f"(pip install {err.name}; CPU torch: pip install torch --index-url "
                    "https://download.pytorch.org/whl/cpu)")
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
