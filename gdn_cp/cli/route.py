"""``gdn-cp route``: the zigzag <-> contiguous all-to-all plan of a packing, for debugging packings.

By default one line per rank (rows that leave it, peers, transfers, its chunkwise pieces), so that
``--cp 64`` prints 64 lines, not every transfer; ``--rank r`` prints one rank's transfers and
``--all`` every rank's (up to ``--cp 64``). Everything is built, and so checked, before anything
is printed.
"""

from __future__ import annotations

import argparse

from .args import int_list, int_range
from .output import CommandError, count, exit_epilog

__all__ = ["ROUTE_ALL_RANKS_MAX", "add_route_command", "route_text"]

ROUTE_ALL_RANKS_MAX = 64
"""``gdn-cp route`` covers every rank only up to this CP size (beyond it, ask for one ``--rank``)."""

_DIRECTIONS = ("both", "zigzag->contiguous", "contiguous->zigzag")


def add_route_command(sub, parents) -> None:
    p = sub.add_parser(
        "route", parents=parents, help="print the zigzag <-> contiguous all-to-all plan of a packing",
        description="Build the zigzag <-> contiguous routes of the given padded boundaries and print, per rank, "
        "the rows that leave it, the peers and transfers, and its chunkwise pieces (one line per rank); "
        "--rank r prints that rank's transfers, --all every rank's. Everything is checked before anything "
        "is printed.",
        epilog=exit_epilog("never (a packing that cannot be split is a bad argument: 2)"))
    p.add_argument("--cu", type=int_list(), required=True, metavar="LIST",
                   help="padded cu_seqlens, comma-separated, e.g. 0,128,384,512 (every length a multiple of 2*cp)")
    p.add_argument("--cp", type=int_range(1), required=True, help="context-parallel size")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int_range(0), default=None, help="print this rank's transfers in full")
    which.add_argument("--all", action="store_true",
                       help=f"print every rank's transfers in full (up to --cp {ROUTE_ALL_RANKS_MAX})")
    p.add_argument("--direction", default="both", choices=_DIRECTIONS, help="which route to print (default: both)")
    p.add_argument("--conv-width", type=int_range(1), default=4,
                   help="conv kernel W for the chunkwise halo plan (default 4)")
    p.set_defaults(func=run_route_command)


def _leaving(route, rank: int) -> tuple[int, int, int]:
    """(rows sent to other ranks, other ranks sent to, transfers to other ranks)."""
    out = [(peer, n) for peer, _g, n, _loc in route.send_transfers if peer != rank]
    return sum(n for _, n in out), len({peer for peer, _ in out}), len(out)


def _chunkwise_line(cw) -> str:
    first = f"continues from ranks {list(cw.compose_ranks)}" if cw.first_continues else "starts here"
    return (f"chunkwise: {count(len(cw.local_cu) - 1, 'piece')}, local boundaries {list(cw.local_cu)}; first "
            f"piece {first}; last piece {'continues on the next rank' if cw.last_continues else 'ends here'}")


def route_text(args) -> str:
    """Everything ``gdn-cp route`` prints, built (and so checked) before any of it is printed.
    ValueError / TypeError naming the flag when the input cannot be split."""
    from ..checks import MAX_CP_SIZE, size_limit_problem

    too_large = size_limit_problem(args.cp, MAX_CP_SIZE, "CP group")
    if too_large:
        raise ValueError(f"--cp {args.cp} is {too_large}")
    if args.rank is not None and args.rank >= args.cp:
        raise ValueError(f"--rank {args.rank} is not a rank of --cp {args.cp}; use a rank in [0, {args.cp - 1}]")
    if args.rank is None and args.cp > ROUTE_ALL_RANKS_MAX:
        raise ValueError(f"--cp {args.cp}: every rank is printed only up to --cp {ROUTE_ALL_RANKS_MAX}; "
                         "pass --rank r to print one")
    # the checks above need no torch (they answer at once); the boundaries' and the plans' need gdn_cp.layout
    from ..layout import CONTIGUOUS, ZIGZAG, build_chunkwise_plan, build_thd_route, validate_cu_seqlens
    from ..layout.chunkwise import MAX_CONV_WIDTH

    if args.conv_width > MAX_CONV_WIDTH:
        raise ValueError(f"--conv-width {args.conv_width} is larger than gdn-cp plans for (at most {MAX_CONV_WIDTH}); "
                         f"use --conv-width {MAX_CONV_WIDTH} or less (Megatron's GDN: 4)")
    cu = validate_cu_seqlens(args.cu, args.cp, name="--cu")
    both = [(ZIGZAG, CONTIGUOUS), (CONTIGUOUS, ZIGZAG)]
    directions = both if args.direction == "both" else [tuple(args.direction.split("->"))]
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    t_local = cu.total // args.cp
    lines = [f"{count(cu.num_sequences, 'sequence')} (lengths {min(lengths)}..{max(lengths)}, "
             f"{count(lengths.count(0), 'empty slot')}), T_global={cu.total}, cp={args.cp}, T_local={t_local}"]
    full = args.all or args.rank is not None
    ranks = range(args.cp) if args.rank is None else [args.rank]
    for rank in ranks:
        routes = [build_thd_route(cu, args.cp, rank, source, target) for source, target in directions]
        cw = build_chunkwise_plan(cu, args.cp, rank, args.conv_width)
        if full:
            lines.append(f"\n# rank {rank}")
            lines += [route.summary() for route in routes]
            lines.append(_chunkwise_line(cw))
            continue
        parts = []
        for route in routes:
            rows, peers, transfers = _leaving(route, rank)
            parts.append(f"{route.source}->{route.target} sends {rows} of {t_local} rows to "
                         f"{count(peers, 'rank')} ({count(transfers, 'transfer')})")
        lines.append(f"rank {rank}: " + "; ".join(parts) + f"; {count(len(cw.local_cu) - 1, 'chunkwise piece')}")
    if not full:
        lines.append(f"(--rank r: one rank's transfers and chunkwise plan; --all: every rank's)")
    return "\n".join(lines)


def run_route_command(args: argparse.Namespace) -> int:
    try:
        text = route_text(args)
    except (ValueError, TypeError) as err:
        raise CommandError(str(err)) from None
    print(text)
    return 0
