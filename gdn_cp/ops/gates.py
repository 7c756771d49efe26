"""The one rule on the gates the kernels take: ``g`` is a finite log decay, ``g <= 0``.

The gated delta rule multiplies the state by ``exp(g)`` at every token; the chunked kernels
(reference and FLA) form ``exp(G_i - G_j)`` of in-chunk cumulative sums, which stay <= 1 only
when ``g <= 0``. A positive g (a decay above 1) overflows within a chunk and the output turns
non-finite; ``-inf`` gives ``inf - inf = nan``. Megatron computes ``g = -exp(A_log) *
softplus(alpha + dt_bias)``, which is <= 0.

Checking the values reads them. On the CPU that is free (the reference backend checks every
call); on a GPU it would synchronize the device, so the layer never checks there: call
:func:`check_log_decay` yourself when chasing a non-finite output.
"""

from __future__ import annotations

import torch

__all__ = ["check_log_decay", "log_decay_ok"]


def log_decay_ok(g: torch.Tensor) -> bool:
    """Whether every entry of ``g`` is finite and <= 0 (reads the values: host tensors only on the
    layer's path)."""
    with torch.no_grad():
        return bool(((g <= 0) & (g > float("-inf"))).all())


def check_log_decay(g: torch.Tensor, *, name: str = "g") -> None:
    """ValueError naming the first entry of ``g`` that is not a finite value <= 0.

    ``g``: a floating-point tensor of any shape (``[T, Hv]`` in the kernels). On a device other
    than the CPU this reads ``g`` back: one device->host sync (a debugging aid, never on the
    layer's path).
    """
    if not isinstance(g, torch.Tensor) or not g.is_floating_point():
        raise TypeError(f"{name} (log decay) must be a floating-point tensor, got {getattr(g, 'dtype', type(g).__name__)}")
    if g.is_meta:
        raise ValueError(f"{name} is on the meta device, which holds no values to check")
    with torch.no_grad():
        bad = ~((g <= 0) & (g > float("-inf")))
        if not bool(bad.any()):
            return
        where = tuple(int(i) for i in bad.nonzero()[0].tolist())
        value = float(g[where])
    raise ValueError(
        f"{name} (log decay) must be finite and <= 0, got {name}{list(where)}={value}; exp({name}) multiplies the "
        f"state at every token, so {name} > 0 overflows and -inf gives nan (Megatron's "
        f"g = -exp(A_log) * softplus(alpha + dt_bias) is <= 0)"
    )
