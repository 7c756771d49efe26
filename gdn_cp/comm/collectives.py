"""Differentiable collectives over an explicit CP process group, and the two TP helpers the
Megatron glue needs (group membership, a gradient sum for TP-replicated parameters).

The only module that calls torch.distributed. Every op flattens its tensor to
``[rows, features]`` contiguous so that it runs on NCCL and on gloo, with CPU or CUDA
tensors. No op reads device data on the host: split sizes come from routes (Python ints).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..layout.route import Route

__all__ = [
    "comm_stats",
    "reset_comm_stats",
    "group_size",
    "group_rank",
    "group_backend",
    "group_ranks",
    "sum_over_group",
    "route_all_to_all",
    "seq_to_head",
    "head_to_seq",
    "all_gather_rows",
]

# torch >= 2.13 names them *_single; older releases only have *_tensor.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


_STATS: dict[str, int] = {}


def _count(op: str, sent: torch.Tensor) -> None:
    """Bytes this rank sends, per op (host-side sizes only: no device work, no sync)."""
    _STATS[op] = _STATS.get(op, 0) + sent.numel() * sent.element_size()
    _STATS[op + ":calls"] = _STATS.get(op + ":calls", 0) + 1


def comm_stats() -> dict[str, int]:
    """Bytes sent and calls per collective since the last reset, for benchmarks."""
    return dict(_STATS)


def reset_comm_stats() -> None:
    _STATS.clear()


def group_size(group) -> int:
    return dist.get_world_size(group)


def group_rank(group) -> int:
    return dist.get_rank(group)


def group_backend(group) -> str:
    """The group's backend name (``"nccl"``, ``"gloo"``, ...): a host-side lookup."""
    return dist.get_backend(group)


def group_ranks(group) -> tuple[int, ...]:
    """Global ranks of the group's members, in group-rank order (a host-side lookup)."""
    return tuple(dist.get_process_group_ranks(group))


def sum_over_group(x: torch.Tensor, group) -> torch.Tensor:
    """A copy of ``x`` summed over ``group`` (any shape). Not differentiable: it is meant for
    gradient hooks, where the result replaces the gradient."""
    out = x.contiguous().clone()
    _count("grad_all_reduce", out)
    dist.all_reduce(out, group=group)
    return out


def _flat(x: torch.Tensor) -> torch.Tensor:
    """``[n, *F] -> [n, prod(F)]`` contiguous (features spelled out: n may be 0)."""
    return x.reshape(x.shape[0], math.prod(x.shape[1:])).contiguous()


def _apply_route(x: torch.Tensor, route: Route, group) -> torch.Tensor:
    """Forward pass of a route on ``x`` [T_src_local, *F] -> [T_dst_local, *F]."""
    if route.is_identity:
        return x
    feat = x.shape[1:]
    send_idx, recv_idx = route.indices_on(x.device)
    send = _flat(x if send_idx is None else x.index_select(0, send_idx))
    recv = send.new_empty((route.rows_out, send.shape[1]))
    _count("route_all_to_all", send)
    dist.all_to_all_single(
        recv, send, output_split_sizes=list(route.recv_splits), input_split_sizes=list(route.send_splits), group=group
    )
    if recv_idx is not None:
        recv = recv.index_select(0, recv_idx)
    return recv.view(route.rows_out, *feat)


class _RouteAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, route, inverse, group):
        ctx.inverse, ctx.group = inverse, group
        return _apply_route(x, route, group)

    @staticmethod
    def backward(ctx, grad):
        # A route is a permutation of global rows, so its adjoint is the inverse route.
        return _apply_route(grad.contiguous(), ctx.inverse, ctx.group), None, None, None


def route_all_to_all(x: torch.Tensor, route: Route, inverse: Route, group) -> torch.Tensor:
    """Move rows ``[T_src_local, *F]`` along ``route``; gradients go back along ``inverse``.

    ``inverse`` must be the route from ``route.target`` to ``route.source`` for the
    same boundaries, cp size and rank (a plan gives both).
    """
    if (inverse.source, inverse.target) != (route.target, route.source):
        raise ValueError(
            f"inverse route goes {inverse.source}->{inverse.target}, expected {route.target}->{route.source}"
        )
    if x.shape[0] != route.rows_in:
        raise ValueError(
            f"route {route.source}->{route.target} expects {route.rows_in} local rows, got tensor of shape "
            f"{tuple(x.shape)}; the tensor and the route must come from the same micro-batch"
        )
    return _RouteAllToAll.apply(x, route, inverse, group)


def _seq_to_head(x: torch.Tensor, group) -> torch.Tensor:
    world = group_size(group)
    t_local = x.shape[0]
    rest = x.shape[2:]
    # [T_local, world, *rest] -> [world, T_local, *rest]: block p goes to rank p.
    send = x.transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    _count("seq_head_all_to_all", send)
    dist.all_to_all_single(recv.view(world, -1), send.view(world, -1), group=group)
    # Block q = rank q's rows of my head group: the rank-major buffer.
    return recv.view(world * t_local, *rest)


def _head_to_seq(y: torch.Tensor, group) -> torch.Tensor:
    world = group_size(group)
    t_local = y.shape[0] // world
    rest = y.shape[1:]
    send = y.contiguous().view(world, t_local, *rest)
    recv = torch.empty_like(send)
    _count("seq_head_all_to_all", send)
    dist.all_to_all_single(recv.view(world, -1), send.view(world, -1), group=group)
    return recv.transpose(0, 1).contiguous()  # [T_local, world, *rest]


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_head(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _head_to_seq(grad, ctx.group), None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _head_to_seq(y, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_head(grad, ctx.group), None


def seq_to_head(x: torch.Tensor, group) -> torch.Tensor:
    """``[T_local, cp, *F]`` (dim 1 = head group per destination rank) -> ``[cp*T_local, *F]``.

    The result is the rank-major buffer: rank 0's rows first (their zigzag local order),
    holding this rank's head group. Reorder with ``NaturalOrder.to_natural``.
    """
    world = group_size(group)
    if x.dim() < 2 or x.shape[1] != world:
        raise ValueError(f"seq_to_head expects [T_local, cp={world}, ...], got shape {tuple(x.shape)}")
    return _SeqToHead.apply(x, group)


def head_to_seq(y: torch.Tensor, group) -> torch.Tensor:
    """Inverse of :func:`seq_to_head`: ``[cp*T_local, *F]`` -> ``[T_local, cp, *F]``."""
    world = group_size(group)
    if y.shape[0] % world:
        raise ValueError(f"head_to_seq expects cp*T_local rows (cp={world}), got shape {tuple(y.shape)}")
    return _HeadToSeq.apply(y, group)


class _AllGatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        world = group_size(group)
        flat = _flat(x)
        out = flat.new_empty((world * flat.shape[0], flat.shape[1]))
        _count("all_gather", flat)
        _all_gather_flat(out, flat, group=group)
        return out.view(world * x.shape[0], *x.shape[1:])

    @staticmethod
    def backward(ctx, grad):
        world = group_size(ctx.group)
        flat = _flat(grad)
        out = flat.new_empty((flat.shape[0] // world, flat.shape[1]))
        _count("reduce_scatter", flat)
        _reduce_scatter_flat(out, flat, group=ctx.group)
        return out.view(grad.shape[0] // world, *grad.shape[1:]), None


def all_gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """``[n, *F]`` on every rank -> ``[cp*n, *F]`` rank-major; backward reduce-scatters (sums)."""
    return _AllGatherRows.apply(x, group)
