"""``gdn-cp route``: the zigzag <-> contiguous all-to-all plan of a packing, for debugging packings.

By default one line per rank (rows that leave it, peers, transfers, its chunkwise pieces), so that
``--cp 64`` prints 64 lines, not every transfer; ``--rank r`` prints one rank's transfers and
``--all`` (or ``-v``) every rank's (up to ``--cp 64``); ``-q`` only the packing's line (a check that it
splits); ``--json`` prints the plan as one JSON object (every transfer of the ranks asked for).
Everything is built, and so checked, before anything is printed. Integer work only: torch is not imported.
"""

from __future__ import annotations

import argparse
import json

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
    p.add_argument("--json", action="store_true",
                   help="print the plan as one JSON object: the packing, and per rank (every rank, or --rank r) each "
                   "route's split sizes and transfers [peer, global start, rows, local row] and its chunkwise pieces")
    p.set_defaults(func=run_route_command)


def _leaving(route, rank: int) -> tuple[int, int, int]:
    """(rows sent to other ranks, other ranks sent to, transfers to other ranks)."""
    out = [(peer, n) for peer, _g, n, _loc in route.send_transfers if peer != rank]
    return sum(n for _, n in out), len({peer for peer, _ in out}), len(out)


def _chunkwise_line(cw) -> str:
    first = f"continues from ranks {list(cw.compose_ranks)}" if cw.first_continues else "starts here"
    return (f"chunkwise: {count(len(cw.local_cu) - 1, 'piece')}, local boundaries {list(cw.local_cu)}; first "
            f"piece {first}; last piece {'continues on the next rank' if cw.last_continues else 'ends here'}")


def route_plan(args) -> tuple:
    """``(cu, directions, {rank: (routes, chunkwise plan)})`` for the ranks asked for, every one built and so
    checked. ValueError / TypeError naming the flag when the input cannot be split."""
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
    ranks = range(args.cp) if args.rank is None else [args.rank]
    built = {rank: ([build_thd_route(cu, args.cp, rank, source, target) for source, target in directions],
                    build_chunkwise_plan(cu, args.cp, rank, args.conv_width)) for rank in ranks}
    return cu, directions, built


def route_json(args) -> dict:
    """What ``gdn-cp route --json`` prints (every transfer of the ranks asked for)."""
    cu, _directions, built = route_plan(args)
    ranks = []
    for rank, (routes, cw) in built.items():
        ranks.append({
            "rank": rank,
            "routes": [{"source": r.source, "target": r.target, "identity": r.is_identity,
                        "send_splits": list(r.send_splits), "recv_splits": list(r.recv_splits),
                        "rows_leaving": _leaving(r, rank)[0],
                        "send_transfers": [list(x) for x in r.send_transfers],
                        "recv_transfers": [list(x) for x in r.recv_transfers]} for r in routes],
            "chunkwise": {"local_cu": list(cw.local_cu), "first_continues": cw.first_continues,
                          "last_continues": cw.last_continues, "compose_ranks": list(cw.compose_ranks)},
        })
    return {"cu": list(cu), "cp": args.cp, "t_global": cu.total, "t_local": cu.total // args.cp,
            "conv_width": args.conv_width, "ranks": ranks}


def route_text(args) -> str:
    """Everything ``gdn-cp route`` prints, built (and so checked) before any of it is printed.
    ValueError / TypeError naming the flag when the input cannot be split."""
    cu, _directions, built = route_plan(args)
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    t_local = cu.total // args.cp
    lines = [f"{count(cu.num_sequences, 'sequence')} (lengths {min(lengths)}..{max(lengths)}, "
             f"{count(lengths.count(0), 'empty slot')}), T_global={cu.total}, cp={args.cp}, T_local={t_local}"]
    if getattr(args, "quiet", False):
        return lines[0]
    full = args.all or args.rank is not None or getattr(args, "verbose", False)
    for rank, (routes, cw) in built.items():
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
        lines.append("(--rank r: one rank's transfers and chunkwise plan; --all: every rank's)")
    return "\n".join(lines)


def run_route_command(args: argparse.Namespace) -> int:
    try:
        text = json.dumps(route_json(args), indent=1) if args.json else route_text(args)
    except (ValueError, TypeError) as err:
        raise CommandError(str(err)) from None
    print(text)
    return 0
