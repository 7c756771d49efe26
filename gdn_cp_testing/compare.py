"""Comparisons the tests share (one copy, so that the copies cannot drift apart).

Relative error is ``|got - want| / |want|``: ``want`` (the reference, e.g. CP=1) is always the second argument,
as in :func:`gdn_cp.ops.accuracy.max_rel`."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def rel_err(got: float, want: float) -> float:
    """``|got - want| / |want|`` of two numbers (0 where both are 0, inf where only ``want`` is)."""
    if want == 0:
        return 0.0 if got == 0 else math.inf
    return abs(got - want) / abs(want)


def max_rel_seq(got: Sequence[float], want: Sequence[float]) -> float:
    """The largest :func:`rel_err` over two sequences of the same length (e.g. the loss of every step)."""
    if len(got) != len(want):
        raise ValueError(f"{len(got)} values against {len(want)} in the reference")
    return max((rel_err(a, b) for a, b in zip(got, want)), default=0.0)


def training_diff(got: dict, ref: dict, *, part: bool = False) -> dict:
    """A training run (``loss`` and ``grad_norm`` per step, ``params`` by name) against its reference's:
    ``{"loss", "grad_norm", "params"}`` (largest relative errors; ``params``: max_rel per tensor) and
    ``names_ok``. The parameter names must be the reference's, or with ``part`` (a pipeline stage or an
    expert-parallel rank, which holds part of the model) a subset of them; the caller then checks that the
    parts together hold every parameter."""
    from gdn_cp.ops.accuracy import max_rel

    names, want = set(got["params"]), set(ref["params"])
    return {
        "loss": max_rel_seq(got["loss"], ref["loss"]),
        "grad_norm": max_rel_seq(got["grad_norm"], ref["grad_norm"]),
        "params": max((max_rel(p, ref["params"][n]) if n in ref["params"] else math.inf
                       for n, p in got["params"].items()), default=0.0),
        "names_ok": names <= want if part else names == want,
    }


def gather_rows(results: list, key: str, cp: int, group_start: int, t_global: int) -> dict:
    """One CP group's per-rank results of ``key`` (``rows``: the global rows each rank held, and per-row tensors
    ``o``, ``dqkv``, ``dg``, ``dbeta``) in global row order; the gradients of the conv's weight and bias,
    replicated over the group, summed (in float64)."""
    mine = [res[key] for res in results[group_start:group_start + cp]]
    rows = torch.cat([m["rows"] for m in mine])
    out = {}
    for k in ("o", "dqkv", "dg", "dbeta"):
        vals = torch.cat([m[k] for m in mine])
        full = torch.empty((t_global, *vals.shape[1:]), dtype=vals.dtype)
        full[rows] = vals
        out[k] = full
    for k in ("dw", "db"):
        out[k] = torch.stack([m[k].double() for m in mine]).sum(0)
    return out
