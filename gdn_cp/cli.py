"""The ``gdn-cp`` command: run the main job, inspect routes, patch Megatron-Core, check a stack."""

from __future__ import annotations

import argparse
import logging
import sys

from . import __version__
from .cli_run import add_run_command
from .megatron.pins import PINS
from .modes.spec import MODE_NAMES

_DESCRIPTION = f"""\
gdn-cp: context parallelism ({", ".join(MODE_NAMES)}) for Gated DeltaNet layers on
Megatron-Core {", ".join(PINS)}.

  run       the main job: a real CP run of the GDN core on spawned ranks, checked against CP=1
  route     print the zigzag <-> contiguous all-to-all plan for a packing (debugging packings)
  patch     apply / check / revert the pinned Megatron-Core patch
  doctor    versions, patch state, GPUs, and which linear_cp_mode fits a head shape
  selftest  FLA backend vs the reference backend on this machine's GPU and versions
"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.replace(" ", "").split(",") if v != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _cmd_route(args) -> int:
    from .layout import CONTIGUOUS, ZIGZAG, build_chunkwise_plan, build_thd_route, validate_cu_seqlens

    try:
        cu = validate_cu_seqlens(args.cu, args.cp)
        ranks = range(args.cp) if args.rank is None else [args.rank]
        directions = [(ZIGZAG, CONTIGUOUS), (CONTIGUOUS, ZIGZAG)] if args.direction == "both" else [
            tuple(args.direction.split("->"))
        ]
        lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
        print(f"{len(lengths)} sequences, T_global={cu[-1]}, cp={args.cp}, T_local={cu[-1] // args.cp}")
        for rank in ranks:
            print(f"\n# rank {rank}")
            for source, target in directions:
                print(build_thd_route(list(cu), args.cp, rank, source, target).summary())
            cw = build_chunkwise_plan(cu, args.cp, rank, args.conv_width)
            print(
                f"chunkwise pieces (local boundaries) {list(cw.local_cu)}; first piece continues: "
                f"{cw.first_continues} (state from ranks {list(cw.compose_ranks)}); last piece continues: "
                f"{cw.last_continues}"
            )
    except (ValueError, TypeError) as err:
        print(f"gdn-cp route: error: {err}", file=sys.stderr)
        return 2
    return 0


def _cmd_selftest(args) -> int:
    from .selftest import main as selftest_main

    return selftest_main(["--gpu"] if args.gpu else [])


def _cmd_doctor(args) -> int:
    from .megatron.doctor import run_doctor

    return run_doctor(heads=args.heads, tp=args.tp, cp=args.cp, path=args.path)


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
                       "print each rank's segments and send/receive plan.")
    p.add_argument("--cu", type=_int_list, required=True, help="padded cu_seqlens, e.g. 0,128,384,512")
    p.add_argument("--cp", type=int, required=True, help="context-parallel size")
    p.add_argument("--rank", type=int, default=None, help="only this rank (default: all)")
    p.add_argument("--direction", default="both", choices=["both", "zigzag->contiguous", "contiguous->zigzag"])
    p.add_argument("--conv-width", type=int, default=4, help="conv kernel W for the chunkwise halo plan")
    p.set_defaults(func=_cmd_route)

    p = sub.add_parser("selftest", help="FLA vs reference backend on this GPU (catches broken FLA/Triton stacks)",
                       description="Compare the FLA backend with the plain-torch reference (outputs and gradients) "
                       "on this machine; exit 1 on a mismatch.")
    p.add_argument("--gpu", action="store_true", help="require a GPU (fail instead of skipping without one)")
    p.set_defaults(func=_cmd_selftest)

    p = sub.add_parser("doctor", help="versions, patch state, GPUs, legal modes for a head shape",
                       description="Report torch / megatron-core / FLA / Triton versions, the patch state of the "
                       "importable megatron-core, GPUs, and for --heads K,V --tp T --cp C which linear_cp_mode values "
                       "are legal and what auto resolves to, with reasons.")
    p.add_argument("--heads", type=_int_list, default=None, help="linear key,value heads, e.g. 16,32")
    p.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--cp", type=_positive_int, default=1, help="context-parallel size (default 1)")
    p.add_argument("--path", default=None, help="Megatron-LM checkout or site-packages (default: importable)")
    p.set_defaults(func=_cmd_doctor)

    try:
        from .cli_patch import add_patch_commands

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
