"""Collectives: the only layer of gdn_cp that calls torch.distributed (``gdn-cp run``'s launcher,
``gdn_cp/cli/launch.py``, which starts the process groups, excepted); groups are always explicit.
Elsewhere: FLA's and FlashQLA's own cp contexts (run by their backends) make their collectives inside
those libraries, and the testing toolkit starts process groups of its own."""

from .collectives import (
    GatherInFlight,
    barrier,
    all_gather_rows,
    all_ranks_true,
    group_backend,
    group_rank,
    group_ranks,
    group_size,
    head_to_seq,
    is_process_group,
    nccl_available,
    route_all_to_all,
    route_all_to_all_many,
    seq_to_head,
    start_all_gather_rows,
    sum_over_group,
    wait_all_gather_rows,
    world_group,
)

__all__ = [
    "GatherInFlight",
    "barrier",
    "all_gather_rows",
    "all_ranks_true",
    "group_backend",
    "group_rank",
    "group_ranks",
    "group_size",
    "head_to_seq",
    "is_process_group",
    "nccl_available",
    "route_all_to_all",
    "route_all_to_all_many",
    "seq_to_head",
    "start_all_gather_rows",
    "sum_over_group",
    "wait_all_gather_rows",
    "world_group",
]
