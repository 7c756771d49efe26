"""Collectives: on the library's path (layout, ops, modes, megatron) the only layer that calls
torch.distributed; groups are always explicit. Elsewhere: FLA's own cp context (run by
``gdn_cp.ops.fla``) makes its collectives inside FLA, and the testing toolkit and ``gdn-cp run``
above the library start process groups and barriers of their own."""

from .collectives import (
    GatherInFlight,
    all_gather_rows,
    all_ranks_true,
    group_backend,
    group_rank,
    group_ranks,
    group_size,
    head_to_seq,
    route_all_to_all,
    route_all_to_all_many,
    seq_to_head,
    start_all_gather_rows,
    sum_over_group,
    wait_all_gather_rows,
)

__all__ = [
    "GatherInFlight",
    "all_gather_rows",
    "all_ranks_true",
    "group_backend",
    "group_rank",
    "group_ranks",
    "group_size",
    "head_to_seq",
    "route_all_to_all",
    "route_all_to_all_many",
    "seq_to_head",
    "start_all_gather_rows",
    "sum_over_group",
    "wait_all_gather_rows",
]
