"""Collectives: the only layer that calls torch.distributed. Groups are always explicit."""

from .collectives import (
    all_gather_rows,
    comm_stats,
    group_backend,
    group_rank,
    group_ranks,
    group_size,
    head_to_seq,
    reset_comm_stats,
    route_all_to_all,
    seq_to_head,
    sum_over_group,
)

__all__ = [
    "all_gather_rows",
    "comm_stats",
    "group_backend",
    "group_rank",
    "group_ranks",
    "group_size",
    "head_to_seq",
    "reset_comm_stats",
    "route_all_to_all",
    "seq_to_head",
    "sum_over_group",
]
