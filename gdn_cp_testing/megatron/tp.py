"""Tensor parallelism (TP) for the Megatron layer tests: the process groups as Megatron lays them
out, the full (TP=1) weights split over TP as megatron-core 0.19.2's GatedDeltaNet splits them,
gradients gathered back to full shape, and the TP step of ``finalize_model_grads``.

Rank layout (Megatron's default order ``tp-cp-ep-dp-pp``, TP fastest):
``rank = tp_rank + tp * (cp_rank + cp * dp_rank)``. On 4 ranks with TP=2 x CP=2 the TP groups are
{0,1} and {2,3} and the CP groups {0,2} and {1,3}; with TP=2 x CP=1 the ranks {0,1} and {2,3} are
two data-parallel replicas.

How 0.19.2 splits each parameter over TP (its forward and ``sharded_state_dict``): ``in_proj``
(weight ``[out, H]`` and bias) along its output channels, which are the sections
``q|k|v|z|beta|alpha`` (``in_proj_split_sections`` times TP), each section split evenly;
``conv1d`` (weight ``[C, 1, W]`` and bias) along ``q|k|v``; ``A_log`` / ``dt_bias`` along the
value heads; ``out_proj.weight [H, Hv*Dv]`` along its input channels (dim 1). Replicated:
``out_norm``'s parameters and ``out_proj.bias``. :func:`tp_splits` writes that table and refuses a
parameter tagged ``tensor_model_parallel`` that it does not know.

Megatron is imported lazily; nothing here runs at import time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = [
    "TPSplit",
    "finalize_tp_step",
    "gather_tp_grads",
    "sp_slice",
    "shard_for_tp",
    "tp_cp_groups",
    "tp_splits",
    "unshard_from_tp",
]

_GROUPS: dict = {}


def tp_cp_groups(tp: int, cp: int):
    """``(tp_group, cp_group, dp_rank)`` of this rank for a TP x CP grid over the whole world
    (see the module docstring for the layout). Every rank must call it with the same sizes, in
    the same order (groups are created collectively on first use, one per rank set: :func:`gdn_cp_testing.ranks.process_group`)."""
    import torch.distributed as dist

    from gdn_cp_testing.ranks import process_group

    key = (tp, cp)
    if key not in _GROUPS:
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % (tp * cp):
            raise ValueError(f"tp={tp} x cp={cp} does not divide the world of {world} ranks")
        mine = {}
        for dp in range(world // (tp * cp)):
            base = dp * tp * cp
            for c in range(cp):  # TP groups: consecutive ranks
                members = [base + c * tp + t for t in range(tp)]
                group = process_group(members)
                if rank in members:
                    mine["tp"] = group
            for t in range(tp):  # CP groups: stride tp
                members = [base + c * tp + t for c in range(cp)]
                group = process_group(members)
                if rank in members:
                    mine["cp"] = group
        _GROUPS[key] = (mine["tp"], mine["cp"], rank // (tp * cp))
    return _GROUPS[key]


@dataclass(frozen=True)
class TPSplit:
    """A TP-sharded parameter: along ``dim``, the full tensor is the concatenation of
    ``sections`` (full sizes); TP rank r holds the r-th of ``tp`` equal chunks of each section,
    concatenated in section order."""

    dim: int
    sections: tuple[int, ...]


def tp_splits(module) -> dict[str, Optional[TPSplit]]:
    """``{parameter name: TPSplit, or None when replicated over TP}`` for a GatedDeltaNet.

    Raises ValueError for a parameter tagged ``tensor_model_parallel`` that the table does not
    cover, or whose ``partition_dim`` disagrees with it (a new sharded parameter cannot slip
    through the parity tests unsharded).
    """
    tp = module.tp_size
    in_proj = TPSplit(0, tuple(s * tp for s in module.in_proj_split_sections))
    conv = TPSplit(0, (module.qk_dim, module.qk_dim, module.v_dim))
    heads = TPSplit(0, (module.num_value_heads,))
    table = {
        "in_proj.weight": in_proj, "in_proj.bias": in_proj,
        "conv1d.weight": conv, "conv1d.bias": conv,
        "A_log": heads, "dt_bias": heads,
        "out_proj.weight": TPSplit(1, (module.v_dim,)),
    }
    out = {}
    for name, p in module.named_parameters():
        sharded = bool(getattr(p, "tensor_model_parallel", False))
        split = table.get(name)
        if sharded and (split is None or getattr(p, "partition_dim", None) != split.dim):
            raise ValueError(
                f"parameter {name} is TP-sharded (partition_dim={getattr(p, 'partition_dim', None)}) but "
                f"gdn_cp_testing.megatron.tp.tp_splits has {split}; add its layout to the table"
            )
        out[name] = split if sharded else None
    return out


def shard_for_tp(full: torch.Tensor, split: TPSplit, tp_rank: int, tp: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s part of the full tensor (see :class:`TPSplit`)."""
    parts = torch.split(full, list(split.sections), dim=split.dim)
    return torch.cat([part.chunk(tp, dim=split.dim)[tp_rank] for part in parts], dim=split.dim)


def unshard_from_tp(local: torch.Tensor, split: TPSplit, tp_group) -> torch.Tensor:
    """The full tensor from every TP rank's part (an all-gather over ``tp_group``)."""
    import torch.distributed as dist

    tp = tp_group.size()
    gathered = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(gathered, local.contiguous(), group=tp_group)
    local_sections = [s // tp for s in split.sections]
    per_rank = [torch.split(g, local_sections, dim=split.dim) for g in gathered]
    return torch.cat([torch.cat([per_rank[r][i] for r in range(tp)], dim=split.dim)
                      for i in range(len(local_sections))], dim=split.dim)


def gather_tp_grads(module, grads: dict, tp_group) -> dict:
    """``{name: full gradient}`` from this TP rank's ``{name: gradient}``: sharded parameters are
    gathered over ``tp_group``; replicated ones are returned as they are (each rank's own). A
    missing gradient stays None (its rank still takes part in the gather, with zeros)."""
    out = {}
    for name, split in tp_splits(module).items():
        g = grads[name]
        if split is None or tp_group.size() == 1:
            out[name] = g
            continue
        p = dict(module.named_parameters())[name]
        full = unshard_from_tp(torch.zeros_like(p) if g is None else g, split, tp_group)
        out[name] = None if g is None else full
    return out


def sp_slice(n: int, tp: int, tp_rank: int) -> slice:
    """Rows ``[n/tp * tp_rank, n/tp * (tp_rank+1))``: a TP rank's part of a CP rank's ``n`` rows
    (dim 0 of ``[S, B, H]`` or ``[T, 1, H]``) under sequence parallelism."""
    if n % tp:
        raise ValueError(f"{n} rows cannot be split over tp={tp} for sequence parallelism")
    return slice(n // tp * tp_rank, n // tp * (tp_rank + 1))


class _Chunk:
    """What ``finalize_model_grads`` expects of a model chunk: ``ddp_config`` and ``module``."""

    def __init__(self, module):
        from megatron.core.distributed import DistributedDataParallelConfig

        self.module = module
        self.ddp_config = DistributedDataParallelConfig()


def finalize_tp_step(module, tp_group) -> None:
    """The TP step of megatron-core 0.19.2's ``finalize_model_grads`` on ``module``'s ``.grad``:
    ``_allreduce_non_tensor_model_parallel_grads`` itself (sums parameters tagged
    ``sequence_parallel`` under sequence parallelism, averages those tagged
    ``average_gradients_across_tp_domain``), called as finalize calls it."""
    from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads

    _allreduce_non_tensor_model_parallel_grads([_Chunk(module)], module.config, tp_group)
