"""Differentiable collectives over an explicit CP process group, and the two TP helpers the
Megatron glue needs (group membership, a gradient sum for TP-replicated parameters).

The only module of the library's path that calls torch.distributed (see :mod:`gdn_cp.comm`).
Every op flattens its tensor to ``[rows, features]`` contiguous so that it runs on NCCL and on
gloo, with CPU or CUDA tensors. No op reads device data on the host: split sizes come from routes (Python ints).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..layout.route import Route
from ..nvtx import phase

__all__ = [
    "barrier",
    "group_size",
    "group_rank",
    "group_backend",
    "group_ranks",
    "is_process_group",
    "nccl_available",
    "world_group",
    "sum_over_group",
    "route_all_to_all",
    "route_all_to_all_many",
    "seq_to_head",
    "head_to_seq",
    "all_gather_rows",
    "GatherInFlight",
    "start_all_gather_rows",
    "wait_all_gather_rows",
]

# torch >= 2.13 names them *_single; older releases only have *_tensor.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def world_group():
    """The process group of every rank of this job (``torch.distributed``'s default group)."""
    return dist.group.WORLD


def is_process_group(group) -> bool:
    """Whether ``group`` is a ``torch.distributed`` process group."""
    return isinstance(group, dist.ProcessGroup)


def nccl_available() -> bool:
    """Whether this torch build has NCCL."""
    return dist.is_available() and dist.is_nccl_available()


def barrier(group) -> None:
    """Every rank of ``group`` waits for the others (timing: a run starts together)."""
    dist.barrier(group)


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
    dist.all_reduce(out, group=group)
    return out


def all_ranks_true(flag: bool, group) -> bool:
    """Whether ``flag`` is True on every rank of ``group`` (one tiny all-reduce of a CPU int).

    For decisions every rank must take together (e.g. refusing bad input that only one rank
    can see), so that no rank stops while the others go on into a collective. Host-side: gloo
    groups (CPU runs) only."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


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


def _check_inverse(route: Route, inverse: Route) -> None:
    if (inverse.source, inverse.target) != (route.target, route.source):
        raise ValueError(
            f"inverse route goes {inverse.source}->{inverse.target}, expected {route.target}->{route.source}"
        )


def route_all_to_all(x: torch.Tensor, route: Route, inverse: Route, group) -> torch.Tensor:
    """Move rows ``[T_src_local, *F]`` along ``route``; gradients go back along ``inverse``.

    ``inverse`` must be the route from ``route.target`` to ``route.source`` for the
    same boundaries, cp size and rank (a plan gives both).
    """
    _check_inverse(route, inverse)
    if x.shape[0] != route.rows_in:
        raise ValueError(
            f"route {route.source}->{route.target} expects {route.rows_in} local rows, got tensor of shape "
            f"{tuple(x.shape)}; the tensor and the route must come from the same micro-batch"
        )
    with phase("route"):
        return _RouteAllToAll.apply(x, route, inverse, group)


def _byte_columns(specs) -> tuple[list[int], int]:
    """Byte offset of each ``(dtype, features)`` in a packed row, and the row's width. Wider
    elements first and the width a multiple of the widest element, so that every column block
    can be viewed in its own dtype."""
    order = sorted(range(len(specs)), key=lambda i: -specs[i][0].itemsize)
    offsets, at = [0] * len(specs), 0
    for i in order:
        offsets[i] = at
        at += specs[i][0].itemsize * specs[i][1]
    widest = max(d.itemsize for d, _ in specs)
    return offsets, -(-at // widest) * widest


def _columns(buf: torch.Tensor, offset: int, dtype: torch.dtype, features: int) -> torch.Tensor:
    """``[rows, features]`` of ``dtype`` viewing bytes ``[offset, offset + features*itemsize)``
    of every row of the uint8 ``buf`` (no copy)."""
    return buf[:, offset:offset + features * dtype.itemsize].view(dtype)


def _apply_route_many(xs, route: Route, group) -> list[torch.Tensor]:
    """:func:`_apply_route` for several tensors of the same rows in one all-to-all: each is
    written (bit for bit) into its byte columns of one uint8 send buffer, in send order, and
    read back from the receive buffer in target order: one copy on each side, as one route.
    Where the receive order is the identity the results are views of the receive buffer (rows
    strided by the packed width), not copies."""
    if route.is_identity:
        return list(xs)
    flats = [x.reshape(x.shape[0], -1) for x in xs]
    specs = [(f.dtype, f.shape[1]) for f in flats]
    offsets, width = _byte_columns(specs)
    send = torch.empty((route.rows_in, width), dtype=torch.uint8, device=xs[0].device)
    positions = route.send_positions_on(send.device)
    for f, off, (dtype, n) in zip(flats, offsets, specs):
        cols = _columns(send, off, dtype, n)
        if positions is None:
            cols.copy_(f)
        else:
            cols.index_copy_(0, positions, f)
    recv = send.new_empty((route.rows_out, width))
    dist.all_to_all_single(
        recv, send, output_split_sizes=list(route.recv_splits), input_split_sizes=list(route.send_splits), group=group
    )
    _, recv_idx = route.indices_on(recv.device)
    outs = []
    for x, off, (dtype, n) in zip(xs, offsets, specs):
        cols = _columns(recv, off, dtype, n)
        if recv_idx is not None:
            cols = cols.index_select(0, recv_idx)
        outs.append(cols.unflatten(1, x.shape[1:]) if x.dim() > 1 else cols.squeeze(1))
    return outs


class _RouteAllToAllMany(torch.autograd.Function):
    @staticmethod
    def forward(ctx, route, inverse, group, *xs):
        ctx.inverse, ctx.group = inverse, group
        return tuple(_apply_route_many(xs, route, group))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, None, *_apply_route_many(grads, ctx.inverse, ctx.group))


def route_all_to_all_many(xs, route: Route, inverse: Route, group) -> tuple[torch.Tensor, ...]:
    """:func:`route_all_to_all` of several tensors with the same rows (``[T_src_local, *F_i]``,
    any dtypes) in ONE all-to-all per direction, exactly (bytes are moved, nothing is cast).
    Returns ``[T_dst_local, *F_i]`` in the same order (possibly strided views of one buffer);
    gradients go back along ``inverse``, also in one all-to-all."""
    xs = tuple(xs)
    if not xs:
        raise ValueError("route_all_to_all_many needs at least one tensor")
    _check_inverse(route, inverse)
    for i, x in enumerate(xs):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"route_all_to_all_many: item {i} is a {type(x).__name__}, not a tensor")
        if x.dim() < 1 or x.shape[0] != route.rows_in:
            raise ValueError(
                f"route {route.source}->{route.target} expects {route.rows_in} local rows, item {i} has shape "
                f"{tuple(x.shape)}; the tensors and the route must come from the same micro-batch"
            )
        if x.device != xs[0].device:
            raise ValueError(f"route_all_to_all_many: item {i} is on {x.device}, item 0 on {xs[0].device}")
    with phase("route"):
        return _RouteAllToAllMany.apply(route, inverse, group, *xs)


def _seq_to_head(x: torch.Tensor, group) -> torch.Tensor:
    world = group_size(group)
    t_local = x.shape[0]
    rest = x.shape[2:]
    # [T_local, world, *rest] -> [world, T_local, *rest]: block p goes to rank p.
    send = x.transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv.view(world, -1), send.view(world, -1), group=group)
    # Block q = rank q's rows of my head group: the rank-major buffer.
    return recv.view(world * t_local, *rest)


def _head_to_seq(y: torch.Tensor, group) -> torch.Tensor:
    world = group_size(group)
    t_local = y.shape[0] // world
    rest = y.shape[1:]
    send = y.contiguous().view(world, t_local, *rest)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv.view(world, -1), send.view(world, -1), group=group)
    return recv.transpose(0, 1).contiguous()  # [T_local, world, *rest]


class _Exchange(torch.autograd.Function):
    """``there(x, group)``, whose backward is ``back(grad, group)``: the seq -> head and head -> seq
    all-to-alls are each other's adjoint (each moves rows, and its inverse moves them back)."""

    @staticmethod
    def forward(ctx, x, group, there, back):
        ctx.group, ctx.back = group, back
        return there(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.back(grad, ctx.group), None, None, None


def seq_to_head(x: torch.Tensor, group) -> torch.Tensor:
    """``[T_local, cp, *F]`` (dim 1 = head group per destination rank) -> ``[cp*T_local, *F]``.

    The result is the rank-major buffer: rank 0's rows first (their zigzag local order),
    holding this rank's head group. Reorder with ``NaturalOrder.to_natural``.
    """
    world = group_size(group)
    if x.dim() < 2 or x.shape[1] != world:
        raise ValueError(f"seq_to_head expects [T_local, cp={world}, ...], got shape {tuple(x.shape)}")
    with phase("seq to head"):
        return _Exchange.apply(x, group, _seq_to_head, _head_to_seq)


def head_to_seq(y: torch.Tensor, group) -> torch.Tensor:
    """Inverse of :func:`seq_to_head`: ``[cp*T_local, *F]`` -> ``[T_local, cp, *F]``."""
    world = group_size(group)
    if y.shape[0] % world:
        raise ValueError(f"head_to_seq expects cp*T_local rows (cp={world}), got shape {tuple(y.shape)}")
    with phase("head to seq"):
        return _Exchange.apply(y, group, _head_to_seq, _seq_to_head)


class _AllGatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        world = group_size(group)
        flat = _flat(x)
        out = flat.new_empty((world * flat.shape[0], flat.shape[1]))
        _all_gather_flat(out, flat, group=group)
        return out.view(world * x.shape[0], *x.shape[1:])

    @staticmethod
    def backward(ctx, grad):
        world = group_size(ctx.group)
        flat = _flat(grad)
        out = flat.new_empty((flat.shape[0] // world, flat.shape[1]))
        _reduce_scatter_flat(out, flat, group=ctx.group)
        return out.view(grad.shape[0] // world, *grad.shape[1:]), None


def all_gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """``[n, *F]`` on every rank -> ``[cp*n, *F]`` rank-major; backward reduce-scatters (sums)."""
    with phase("all-gather"):
        return _AllGatherRows.apply(x, group)


# ---------------------------------------------------------------------------------------------
# an all-gather that travels while the caller computes
# ---------------------------------------------------------------------------------------------

class GatherInFlight:
    """An all-gather started by :func:`start_all_gather_rows` and not yet waited for.

    Autograd sees two nodes: the start (made where the gather is launched) and the wait (made
    where its result is first needed). Backward runs them mirrored: the wait's backward launches
    the reduce-scatter of the gradient and the start's backward waits for it. Autograd runs the
    ready node made last first, so the nodes made between the two (the work the gather overlapped
    in forward) run their backward in between, while the reduce-scatter travels.

    The collectives are asynchronous (``async_op=True``) where waiting costs no host sync: NCCL
    (the wait orders the compute stream after the collective) and gloo with CPU tensors; gloo
    with CUDA tensors stages through the host, so there they run synchronously (same results,
    no overlap).
    """

    __slots__ = ("group", "world", "async_op", "shape", "token", "send", "out", "work",
                 "grad_send", "grad_in", "grad_work")

    def __init__(self, group, async_op: bool):
        self.group, self.world, self.async_op = group, group_size(group), async_op
        self.shape = self.token = self.send = self.out = self.work = None
        self.grad_send = self.grad_in = self.grad_work = None


class _StartAllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, flight):
        flat = _flat(x)
        out = flat.new_empty((flight.world * flat.shape[0], flat.shape[1]))
        flight.work = _all_gather_flat(out, flat, group=flight.group, async_op=flight.async_op)
        flight.shape, flight.send, flight.out = tuple(x.shape), flat, out
        ctx.flight = flight
        return flat.new_zeros(())  # the token: links this node to the wait in the graph

    @staticmethod
    def backward(ctx, token_grad):  # noqa: ARG004 - the token carries no value
        f = ctx.flight
        if f.grad_work is not None:
            f.grad_work.wait()
        grad = f.grad_in.view(f.shape)
        f.grad_send = f.grad_in = f.grad_work = None
        return grad, None


class _WaitAllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token, flight):  # noqa: ARG004 - the token only orders the graph
        if flight.work is not None:
            flight.work.wait()
        ctx.flight = flight
        out = flight.out
        flight.work = flight.send = flight.out = None
        return out.view(flight.world * flight.shape[0], *flight.shape[1:])

    @staticmethod
    def backward(ctx, grad):
        f = ctx.flight
        flat = _flat(grad)
        out = flat.new_empty((flat.shape[0] // f.world, flat.shape[1]))
        f.grad_work = _reduce_scatter_flat(out, flat, group=f.group, async_op=f.async_op)
        f.grad_send, f.grad_in = flat, out  # kept alive until the start's backward has waited
        return grad.new_zeros(()), None


def start_all_gather_rows(x: torch.Tensor, group) -> GatherInFlight:
    """Launch :func:`all_gather_rows` of ``x [n, *F]``; the result comes from
    :func:`wait_all_gather_rows`. Between the two the caller may compute (see
    :class:`GatherInFlight` for the backward)."""
    async_op = group_backend(group) == "nccl" or x.device.type == "cpu"
    flight = GatherInFlight(group, async_op)
    flight.token = _StartAllGather.apply(x, flight)
    return flight


def wait_all_gather_rows(flight: GatherInFlight) -> torch.Tensor:
    """``[cp*n, *F]`` rank-major, as :func:`all_gather_rows`; backward reduce-scatters (sums)."""
    if flight.token is None:
        raise ValueError("wait_all_gather_rows: this gather was already waited for; start a new one")
    token, flight.token = flight.token, None
    return _WaitAllGather.apply(token, flight)
