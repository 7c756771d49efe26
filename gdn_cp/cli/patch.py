"""`gdn-cp patch apply|check|revert [PATH]`: the pinned Megatron-Core patch from the command line.

``gdn_cp.cli.command`` calls :func:`add_patch_commands` on its subparsers; the parsed
``args.func(args)`` returns the exit code or raises :class:`~gdn_cp.cli.output.CommandError`.
``apply --dry-run`` / ``revert --dry-run`` make every check and every file of the action, write
nothing, and print the files as unified diffs against the tree's.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import sys
import textwrap
from pathlib import Path
from typing import Optional, TextIO

from .. import patch
from ..pins import PINS
from .args import existing_path
from .output import EXIT_FOUND_PROBLEM, CommandError, exit_epilog

_RELEASES = ", ".join(PINS)

_DESCRIPTION = f"""\
Install, check or revert the gdn-cp patch of Megatron-Core {_RELEASES}.

The patch is thin: the logic lives in gdn_cp, where it is tested; the patched files hand over to it
(TransformerConfig's linear_cp_mode is checked, and 'auto' resolved, by gdn_cp; GatedDeltaNet.forward
hands over when context parallelism is on or the input is packed). Every target file is checked
against the sha256 of the release before anything is written (a Megatron-LM checkout may report
another version string: its files decide); all files are replaced or none; the originals are kept
as *{patch.BACKUP_SUFFIX} (listed in .git/info/exclude in a git checkout) and `revert` restores
them byte for byte.
"""


def _targets() -> str:
    """The target files, from the pinned patch's manifest (so that the help cannot drift from it)."""
    try:
        files = ", ".join(t.target for t in patch.load_manifest().files)
        return textwrap.fill(f"Target files: {files}.", width=100) + "\n"
    except patch.PatchError as err:  # a broken installation: the commands themselves say so
        return f"Target files: unknown ({err}).\n"


_PATH_HELP = """\
PATH: a Megatron-LM checkout, a site-packages folder holding megatron-core, or the megatron
package folder. Default: the megatron package importable by this Python.
"""

_FOUND_PROBLEM = {
    "apply": "the target files are not the release's (local edits, another release) or are partially "
    "patched, or writing failed; nothing was changed",
    "check": "the files are partially patched, modified or missing, or not in the --expect-ed state",
    "revert": "the target files are not the release's, patched or not; nothing was changed",
}

_REVERT_NOTE = f"""
Revert before `pip uninstall megatron-core`: pip does not know the *{patch.BACKUP_SUFFIX}
backups and leaves them (and their folders) behind; delete them by hand if it already ran.
"""


def add_patch_commands(subparsers, parents=()) -> argparse.ArgumentParser:
    """Register ``patch {apply,check,revert} [PATH]`` on an ``argparse`` subparsers object
    (``parents``: the flags every command takes, e.g. ``-v``).

    Sets ``func`` on the parsed namespace: ``args.func(args)`` runs it and returns the exit code.
    Returns the new ``patch`` parser.
    """
    p = subparsers.add_parser(
        "patch",
        parents=list(parents),
        help=f"apply / check / revert the pinned Megatron-Core {patch.PINNED_VERSION} patch",
        description=_DESCRIPTION + "\n" + _targets(),
        epilog=_PATH_HELP + "\n" + exit_epilog("see `gdn-cp patch apply|check|revert --help`"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = p.add_subparsers(dest="patch_action", metavar="{apply,check,revert}", required=True)
    helps = {
        "apply": "patch the files (a no-op if already patched)",
        "check": "report each file as pristine / patched / modified / missing",
        "revert": "restore the byte-identical pristine files (a no-op if not patched)",
    }
    for action, text in helps.items():
        a = actions.add_parser(
            action,
            parents=list(parents),
            help=text,
            description=text + (_REVERT_NOTE if action == "revert" else ""),
            epilog=_PATH_HELP + "\n" + exit_epilog(_FOUND_PROBLEM[action]),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        a.add_argument(
            "path",
            nargs="?",
            type=existing_path,
            default=None,
            metavar="PATH",
            help="Megatron-LM checkout, site-packages folder or megatron package folder "
            "(default: the importable megatron)",
        )
        if action in ("apply", "revert"):
            a.add_argument("--dry-run", action="store_true",
                           help=f"write nothing: make every check of `{action}` and print what it would change, "
                           "as a unified diff per file")
        else:
            a.set_defaults(dry_run=False)
        if action == "check":
            a.add_argument(
                "--expect",
                choices=(patch.PRISTINE, patch.PATCHED),
                default=None,
                help="exit 1 unless every file is in this state (e.g. in CI)",
            )
        else:
            a.set_defaults(expect=None)
        if action == "revert":
            a.add_argument(
                "--from-backups",
                action="store_true",
                help=f"also restore files that changed since gdn-cp patched them (another gdn-cp version's "
                f"patch, after an upgrade) from their *{patch.BACKUP_SUFFIX} backups; edits made to them are lost",
            )
        else:
            a.set_defaults(from_backups=False)
        a.set_defaults(func=run_patch_command, prog=f"gdn-cp patch {action}")
    return p


def _print_states(files: dict, out: TextIO, hashes_of: Optional[Path] = None) -> None:
    """One line per target file and its state; with ``hashes_of`` (the tree, ``-v``), each file's sha256
    below it, beside the release's and the patched file's."""
    width = max(len(t) for t in files)
    targets = {}
    if hashes_of is not None:
        from ..patch.tree import resolve_pin, target_path

        targets = {t.target: t for t in resolve_pin(hashes_of, None)[1].files}
    for target, state in files.items():
        print(f"  {target:<{width}}  {state}", file=out)
        t = targets.get(target)
        if t is not None:
            path = target_path(hashes_of, t)
            found = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "(missing)"
            print(f"    sha256 {found}; the release's {t.sha256_pristine}; patched {t.sha256_patched}", file=out)


def run_patch_command(args: argparse.Namespace, out: Optional[TextIO] = None) -> int:
    """Run ``gdn-cp patch``; returns the exit status, raises :class:`CommandError` with the reason
    (2: no megatron-core where PATH points, nothing looked at; 1: the files are not in a state the
    action can take, nothing changed)."""
    out = out or sys.stdout
    quiet = getattr(args, "quiet", False)
    hashes_of = None
    try:
        root = patch.find_megatron_root(args.path)
    except patch.MegatronNotFound as e:
        raise CommandError(str(e)) from None
    if getattr(args, "verbose", False):
        hashes_of = root
    try:
        if args.patch_action == "check":
            return _check(root, args.expect, out, quiet=quiet, hashes_of=hashes_of)
        if getattr(args, "dry_run", False):
            return _dry_run(root, args.patch_action, args.from_backups, out, quiet=quiet)
        result = _act(root, args.patch_action, args.from_backups)
    except patch.PatchError as e:
        raise CommandError(str(e), EXIT_FOUND_PROBLEM) from None
    print(result.message, file=out)
    if not quiet:
        _print_states(result.files, out, hashes_of)
    return 0


def _act(root: Path, action: str, from_backups: bool, dry_run: bool = False) -> "patch.PatchResult":
    if action == "apply":
        return patch.apply_patch(root, dry_run=dry_run)
    return patch.revert_patch(root, from_backups=from_backups, dry_run=dry_run)


def _dry_run(root: Path, action: str, from_backups: bool, out: TextIO, quiet: bool = False) -> int:
    """The action's every check, and the files it would write, printed as unified diffs against
    ``root``'s; nothing is written. Refusals: the action's own."""
    result = _act(root, action, from_backups, dry_run=True)
    if not result.changed:
        print(f"{result.message} (dry run: nothing was written)", file=out)
        return 0
    verb = "patch" if action == "apply" else "restore"
    print(f"gdn-cp patch {action} --dry-run: would {verb} {len(result.changed)} files of megatron-core at {root} "
          f"(nothing was written; `gdn-cp patch {action} {root}` writes them):", file=out)
    for target in [] if quiet else result.changed:
        before = root.joinpath(*target.split("/")).read_text(encoding="utf-8").splitlines(keepends=True)
        after = result.contents[target].decode("utf-8").splitlines(keepends=True)
        text = "".join(difflib.unified_diff(before, after, f"a/{target}", f"b/{target}"))
        print(text, end="" if text.endswith("\n") else "\n", file=out)
    return 0


def _check(root, expect: Optional[str], out: TextIO, *, quiet: bool = False, hashes_of: Optional[Path] = None) -> int:
    files = patch.check_patch(root)
    state = patch.overall_state(files)
    if not quiet:
        print(f"{root}: {patch.describe_tree(root)}", file=out)
        _print_states(files, out, hashes_of)
    print(f"state: {state}", file=out)
    if expect is not None:
        if state != expect:
            fix = {(patch.PATCHED, patch.PRISTINE): f"; patch it: `gdn-cp patch apply {root}`",
                   (patch.PRISTINE, patch.PATCHED): f"; restore it: `gdn-cp patch revert {root}`"}.get((expect, state))
            raise CommandError(f"expected {expect}, found {state}: {patch.describe_state(state)}"
                               f"{fix or _fix(root, files, state)}", EXIT_FOUND_PROBLEM)
        return 0
    if state in (patch.PRISTINE, patch.PATCHED):
        return 0
    raise CommandError(f"megatron-core at {root}: {patch.describe_state(state)}{_fix(root, files, state)}",
                       EXIT_FOUND_PROBLEM)


def _fix(root, files: dict, state: str) -> str:
    """What to do about a tree that is neither pristine nor patched (``; ...``; the partial state's words
    say it already): the fix ``apply`` would give for this tree (a git checkout: git; a copy without git:
    the release's sources; an installed package: a reinstall)."""
    from ..patch.tree import foreign_fix, resolve_pin

    if state in (patch.PARTIAL, patch.PRISTINE, patch.PATCHED):
        return ""
    fix = foreign_fix(root, files, resolve_pin(root, None)[1])[1]
    return f"; {fix}" + ("" if "gdn-cp patch apply" in fix else f", then `gdn-cp patch apply {root}`")
