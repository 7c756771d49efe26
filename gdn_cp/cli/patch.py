"""`gdn-cp patch apply|check|revert [PATH]`: the pinned Megatron-Core patch from the command line.

``gdn_cp.cli.command`` calls :func:`add_patch_commands` on its subparsers; the parsed ``args.func(args)``
returns the exit code (0: done / consistent state, 1: error or unexpected state).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence, TextIO

from gdn_cp.megatron import patching
from gdn_cp.megatron.pins import PINS

_RELEASES = ", ".join(PINS)

_DESCRIPTION = f"""\
Install, check or revert the gdn-cp patch of Megatron-Core {_RELEASES}.

The patch is thin: it adds TransformerConfig.linear_cp_mode (checked, and 'auto' resolved, by
gdn_cp) and makes GatedDeltaNet.forward hand over to gdn_cp when context parallelism is on or the
input is packed (THD). Every target file is checked against the sha256 of the release before
anything is written (a Megatron-LM checkout may report another version string: its files decide);
all files are replaced or none; the originals are kept as *{patching.BACKUP_SUFFIX} (listed in
.git/info/exclude in a git checkout) and `revert` restores them byte for byte.
"""

_EPILOG = """\
PATH: a Megatron-LM checkout, a site-packages folder holding megatron-core, or the megatron
package folder. Default: the megatron package importable by this Python.
Exit status: 0 on success (check: pristine or patched, or the --expect-ed state), 1 otherwise.
"""

_REVERT_NOTE = f"""
Revert before `pip uninstall megatron-core`: pip does not know the *{patching.BACKUP_SUFFIX}
backups and leaves them (and their folders) behind; delete them by hand if it already ran.
"""


def add_patch_commands(subparsers) -> argparse.ArgumentParser:
    """Register ``patch {apply,check,revert} [PATH]`` on an ``argparse`` subparsers object.

    Sets ``func`` on the parsed namespace: ``args.func(args)`` runs it and returns the exit code.
    Returns the new ``patch`` parser.
    """
    p = subparsers.add_parser(
        "patch",
        help=f"apply / check / revert the pinned Megatron-Core {patching.PINNED_VERSION} patch",
        description=_DESCRIPTION,
        epilog=_EPILOG,
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
            help=text,
            description=text + (_REVERT_NOTE if action == "revert" else ""),
            epilog=_EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        a.add_argument(
            "path",
            nargs="?",
            default=None,
            metavar="PATH",
            help="Megatron-LM checkout, site-packages folder or megatron package folder "
            "(default: the importable megatron)",
        )
        if action == "check":
            a.add_argument(
                "--expect",
                choices=(patching.PRISTINE, patching.PATCHED),
                default=None,
                help="exit 1 unless every file is in this state (e.g. in CI)",
            )
        else:
            a.set_defaults(expect=None)
        a.set_defaults(func=run_patch_command)
    return p


def _print_states(files: dict, out: TextIO) -> None:
    width = max(len(t) for t in files)
    for target, state in files.items():
        print(f"  {target:<{width}}  {state}", file=out)


def run_patch_command(
    args: argparse.Namespace, out: Optional[TextIO] = None, err: Optional[TextIO] = None
) -> int:
    """Run ``gdn-cp patch``; returns the exit status."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        root = patching.find_megatron_root(args.path)
        if args.patch_action == "check":
            files = patching.check_patch(root)
            state = patching.overall_state(files)
            print(f"{root}: {patching.describe_tree(root)}", file=out)
            _print_states(files, out)
            print(f"state: {state}", file=out)
            if args.expect is not None:
                ok = state == args.expect
                if not ok:
                    print(f"error: expected {args.expect}, found {state}", file=err)
                return 0 if ok else 1
            if state in (patching.PRISTINE, patching.PATCHED):
                return 0
            hint = (
                "run `gdn-cp patch revert` then `gdn-cp patch apply`"
                if state == patching.PARTIAL
                else f"restore files that match a supported megatron-core release ({_RELEASES}; "
                "reinstall it, or check out a matching commit) before applying"
            )
            print(f"error: megatron-core is {state}: {hint}", file=err)
            return 1
        if args.patch_action == "apply":
            result = patching.apply_patch(root)
        else:
            result = patching.revert_patch(root)
        print(result.message, file=out)
        _print_states(result.files, out)
        return 0
    except patching.PatchError as e:
        print(f"error: {e}", file=err)
        return 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Stand-alone entry point (``python -m gdn_cp.cli.patch patch check``)."""
    parser = argparse.ArgumentParser(prog="gdn-cp")
    sub = parser.add_subparsers(dest="command", required=True)
    add_patch_commands(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
