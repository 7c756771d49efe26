"""Where chunkwise swaps layouts: around the core (wide tensors) or around the layer (hidden_states).

chunkwise moves rows zigzag -> contiguous and back. in_proj, the gates, the gated norm and
out_proj act per token, so the swap can happen either

- at the core: in_proj output ``q|k|v`` plus the gates in (g fp32, beta in the activation
  dtype, packed into the same all-to-all), the core output ``o`` out, or
- at hidden_states: ``hidden_states`` in before in_proj, out_proj's output back.

The rule, per TP rank, in bytes per token (``a`` = activation bytes):

    core   = (2*Hk*Dk + Hv*Dv) * a + Hv * (4 + a) + Hv*Dv * a    (TP-local heads)
    hidden = 2 * H * a                                          (H = hidden size, replicated over TP)

take ``hidden`` when it is strictly smaller and allowed, else ``core``. The hidden swap is
not allowed with sequence parallelism and TP > 1 (hidden_states are then split along the
sequence over TP and gathered inside in_proj). Both paths give the same numbers (tested).
Example, computed from the rule (``tests/megatron/test_swap.py`` checks these numbers): the
Qwen3.5-9B GDN shape at TP=1 (H=4096, 16 key / 32 value heads of dim 128, bf16) gives core
24,768 B/token and hidden 16,384 B/token; stock headwise moves 32,896 (q|k|v|z|beta|alpha in,
the normed output out), so the hidden swap moves 0.50x of stock headwise.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..modes import GDNShape

__all__ = ["SWAP_POINTS", "SwapChoice", "choose_swap_point", "set_chunkwise_swap", "chunkwise_swap"]

logger = logging.getLogger(__name__)

SWAP_POINTS = ("auto", "hidden", "core")
_GATE_BYTES = 4
_setting = {"swap": "auto"}


def set_chunkwise_swap(point: str) -> None:
    """Force the chunkwise swap point for this process: ``auto`` (default), ``hidden`` or ``core``."""
    if point not in SWAP_POINTS:
        raise ValueError(f"chunkwise swap point must be one of {SWAP_POINTS}, got {point!r}")
    _setting["swap"] = point


def chunkwise_swap() -> str:
    return _setting["swap"]


@dataclass(frozen=True)
class SwapChoice:
    point: str  # "hidden" or "core"
    core_bytes: int  # per token per TP rank
    hidden_bytes: int | None  # None when not allowed
    stock_headwise_bytes: int
    reason: str


def choose_swap_point(
    *, shape: GDNShape, hidden_size: int, tp: int, sequence_parallel: bool, act_bytes: int, requested: str = "auto"
) -> SwapChoice:
    """Apply the rule above; ``requested`` = ``hidden`` / ``core`` forces a point (``hidden``
    raises ValueError where it is not allowed)."""
    if requested not in SWAP_POINTS:
        raise ValueError(f"chunkwise swap point must be one of {SWAP_POINTS}, got {requested!r}")
    core = (shape.conv_dim + shape.value_dim) * act_bytes + shape.num_v_heads * (_GATE_BYTES + act_bytes)
    stock = (shape.conv_dim + 2 * shape.value_dim + 2 * shape.num_v_heads) * act_bytes
    allowed = tp == 1 or not sequence_parallel
    hidden = 2 * hidden_size * act_bytes if allowed else None
    if requested == "hidden" and hidden is None:
        raise ValueError(
            "chunkwise swap at hidden_states (set_chunkwise_swap('hidden')) is not possible with "
            f"sequence_parallel=True and tensor_model_parallel_size={tp}: hidden_states are then split "
            "along the sequence over TP and gathered inside in_proj; call "
            "gdn_cp.megatron.swap.set_chunkwise_swap('core') or ('auto')"
        )
    if requested != "auto":
        return SwapChoice(requested, core, hidden, stock, "requested")
    if hidden is not None and hidden < core:
        return SwapChoice("hidden", core, hidden, stock, f"hidden_states {hidden} B/token < core tensors {core} B/token")
    why = "sequence parallelism with TP > 1" if hidden is None else f"core tensors {core} <= hidden_states {hidden} B/token"
    return SwapChoice("core", core, hidden, stock, why)
