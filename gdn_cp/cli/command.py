"""The ``gdn-cp`` command: run the main job, inspect routes, patch Megatron-Core, check a stack."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .. import __version__
from .args import int_list, int_range
from .run import add_run_command
from ..megatron.pins import PINS
from ..modes.spec import MODE_NAMES

_DESCRIPTION = f"""\
gdn-cp: context parallelism ({", ".join(MODE_NAMES)}) for Gated DeltaNet layers on
Megatron-Core {", ".join(PINS)}.

  run       the main job: a real CP run of the GDN core on spawned ranks, checked against CP=1
  route     print the zigzag <-> contiguous all-to-all plan for a packing (debugging packings)
  patch     apply / check / revert the pinned Megatron-Core patch
  doctor    versions, patch state, GPUs, and which linear_cp_mode fits a head shape
  selftest  FLA backend vs the reference backend on this machine's GPU and versions
"""


ROUTE_ALL_RANKS_MAX = 64
"""``gdn-cp route`` prints every rank only up to this CP size (beyond it, ask for one ``--rank``)."""


def _existing_path(text: str) -> str:
    if not os.path.exists(os.path.expanduser(text)):
        raise argparse.ArgumentTypeError(f"{text} does not exist; pass a Megatron-LM checkout, a site-packages "
                                         "folder or the megatron package folder")
    return text


def _route_text(args) -> str:
    """Everything ``gdn-cp route`` prints, built (and so checked) before any of it is printed."""
    from ..layout import CONTIGUOUS, ZIGZAG, build_chunkwise_plan, build_thd_route, validate_cu_seqlens
    from ..layout.boundaries import MAX_CP_SIZE
    from ..layout.chunkwise import MAX_CONV_WIDTH

    if args.cp > MAX_CP_SIZE:
        raise ValueError(f"--cp {args.cp} is larger than any CP group gdn-cp plans for (at most {MAX_CP_SIZE})")
    if args.conv_width > MAX_CONV_WIDTH:
        raise ValueError(f"--conv-width {args.conv_width} is larger than gdn-cp plans for (at most {MAX_CONV_WIDTH})")
    cu = validate_cu_seqlens(args.cu, args.cp, name="--cu")
    if args.rank is not None and args.rank >= args.cp:
        raise ValueError(f"--rank {args.rank} is not a rank of --cp {args.cp}; use a rank in [0, {args.cp - 1}]")
    if args.rank is None and args.cp > ROUTE_ALL_RANKS_MAX:
        raise ValueError(f"--cp {args.cp} would print {args.cp} ranks; pass --rank r to print one")
    ranks = range(args.cp) if args.rank is None else [args.rank]
    both = [(ZIGZAG, CONTIGUOUS), (CONTIGUOUS, ZIGZAG)]
    directions = both if args.direction == "both" else [tuple(args.direction.split("->"))]
    lines = [f"{cu.num_sequences} sequences, T_global={cu.total}, cp={args.cp}, T_local={cu.total // args.cp}"]
    for rank in ranks:
        lines.append(f"\n# rank {rank}")
        for source, target in directions:
            lines.append(build_thd_route(cu, args.cp, rank, source, target).summary())
        cw = build_chunkwise_plan(cu, args.cp, rank, args.conv_width)
        lines.append(
            f"chunkwise pieces (local boundaries) {list(cw.local_cu)}; first piece continues: "
            f"{cw.first_continues} (state from ranks {list(cw.compose_ranks)}); last piece continues: "
            f"{cw.last_continues}"
        )
    return "\n".join(lines)


def _cmd_route(args) -> int:
    try:
        text = _route_text(args)
    except (ValueError, TypeError) as err:
        print(f"gdn-cp route: error: {err}", file=sys.stderr)
        return 2
    print(text)
    return 0


def _cmd_selftest(args) -> int:
    from .selftest import main as selftest_main

    return selftest_main((["--gpu"] if args.gpu else []) + (["--json"] if args.json else []))


def _cmd_doctor(args) -> int:
    from ..megatron.doctor import run_doctor

    return run_doctor(heads=args.heads, tp=args.tp, cp=args.cp, path=args.path,
                      error_echo=lambda line: print(line, file=sys.stderr))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gdn-cp", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"gdn-cp {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    add_run_command(sub)

    p = sub.add_parser("route", help="print the all-to-all plan for packed boundaries",
                       description="Build the zigzag <-> contiguous routes for the given padded boundaries and "
                       "print each rank's send/receive transfers and chunkwise pieces. Everything is checked before "
                       "anything is printed; exit 2 on a bad flag or boundaries a zigzag split cannot take.")
    p.add_argument("--cu", type=int_list(), required=True, metavar="LIST",
                   help="padded cu_seqlens, comma-separated, e.g. 0,128,384,512 (every length a multiple of 2*cp)")
    p.add_argument("--cp", type=int_range(1), required=True, help="context-parallel size")
    p.add_argument("--rank", type=int_range(0), default=None,
                   help=f"only this rank (default: all ranks, for --cp up to {ROUTE_ALL_RANKS_MAX})")
    p.add_argument("--direction", default="both", choices=["both", "zigzag->contiguous", "contiguous->zigzag"],
                   help="which route to print (default: both)")
    p.add_argument("--conv-width", type=int_range(1), default=4,
                   help="conv kernel W for the chunkwise halo plan (default 4)")
    p.set_defaults(func=_cmd_route)

    p = sub.add_parser("selftest", help="FLA vs reference backend on this GPU (catches broken FLA/Triton stacks)",
                       description="Compare the FLA backend with the plain-torch reference (outputs and gradients) "
                       "on this machine; exit 1 on a mismatch.")
    p.add_argument("--gpu", action="store_true", help="require a GPU (fail instead of skipping without one)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_cmd_selftest)

    p = sub.add_parser("doctor", help="versions, patch state, GPUs, legal modes for a head shape",
                       description="Report torch / megatron-core / FLA / Triton versions, the patch state of the "
                       "importable megatron-core, GPUs, and for --heads K,V --tp T --cp C which linear_cp_mode values "
                       "are legal and what auto resolves to, with reasons. Exit 0 when all is well; 1 when the "
                       "patch state is foreign or partial, --path holds no megatron-core, or no mode is legal for "
                       "--heads; 2 on a bad flag.")
    p.add_argument("--heads", type=int_list(1, count=2), default=None, metavar="K,V",
                   help="linear key,value heads (linear_num_key_heads, linear_num_value_heads), e.g. 16,32")
    p.add_argument("--tp", type=int_range(1), default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--cp", type=int_range(1), default=1, help="context-parallel size (default 1)")
    p.add_argument("--path", type=_existing_path, default=None,
                   help="Megatron-LM checkout or site-packages (default: the importable megatron)")
    p.set_defaults(func=_cmd_doctor)

    try:
        from .patch import add_patch_commands

        add_patch_commands(sub)
    except ImportError as err:  # pragma: no cover - broken install
        logging.getLogger(__name__).warning("patch commands unavailable: %s", err)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
