"""Collectives: the only layer that calls torch.distributed. Groups are always explicit."""

from .collectives import (
    GatherInFlight,
    all_gather_rows,
    all_ranks_true,
    comm_stats,
    group_backend,
    group_rank,
    group_ranks,
    group_size,
    head_to_seq,
    reset_comm_stats,
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
    "comm_stats",
    "group_backend",
    "group_rank",
    "group_ranks",
    "group_size",
    "head_to_seq",
    "reset_comm_stats",
    "route_all_to_all",
    "route_all_to_all_many",
    "seq_to_head",
    "start_all_gather_rows",
    "sum_over_group",
    "wait_all_gather_rows",
]
