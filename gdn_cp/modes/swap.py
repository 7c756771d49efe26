"""Where chunkwise swaps a layer's layouts: around the core (wide tensors) or around the layer (hidden_states).

chunkwise moves rows zigzag -> contiguous and back. in_proj, the gates, the gated norm and
out_proj act per token, so the swap can happen either

- at the core: in_proj output ``q|k|v`` plus the gates in (g fp32, beta in the activation
  dtype, packed into the same all-to-all), the core output ``o`` out, or
- at hidden_states: ``hidden_states`` in before in_proj, out_proj's output back.

The rule, per TP rank, in bytes per token (``a`` = activation bytes):

    core   = (2*Hk*Dk + Hv*Dv) * a + Hv * (4 + a) + Hv*Dv * a    (TP-local heads)
    hidden = 2 * H * a                                          (H = hidden size, replicated over TP)

take ``hidden`` when it is strictly smaller and allowed, else ``core``; ``GDN_CP_CHUNKWISE_SWAP``
(``Settings.chunkwise_swap``) forces one. The hidden swap is not allowed with sequence
parallelism and TP > 1 (hidden_states are then split along the sequence over TP and gathered
inside in_proj). Both paths give the same numbers (tested). The chunkwise mode decides once per
call, in its ``prepare``, and runs the swap itself (:class:`gdn_cp.modes.chunkwise.Chunkwise`).
Example, computed from the rule (``tests/megatron/test_swap.py`` checks these numbers): the
Qwen3.5-9B GDN shape at TP=1 (H=4096, 16 key / 32 value heads of dim 128, bf16) gives core
24,768 B/token and hidden 16,384 B/token; stock headwise moves 32,896 (q|k|v|z|beta|alpha in,
the normed output out), so the hidden swap moves 0.50x of stock headwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ops.shape import GDNShape

__all__ = ["SwapChoice", "choose_swap_point"]

_GATE_BYTES = 4


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
    """Apply the rule above; ``requested`` (a checked ``Settings.chunkwise_swap``) = ``hidden`` /
    ``core`` forces a point (``hidden`` raises ValueError where it is not allowed)."""
    core = (shape.conv_dim + shape.value_dim) * act_bytes + shape.num_v_heads * (_GATE_BYTES + act_bytes)
    stock = (shape.conv_dim + 2 * shape.value_dim + 2 * shape.num_v_heads) * act_bytes
    allowed = tp == 1 or not sequence_parallel
    hidden = 2 * hidden_size * act_bytes if allowed else None
    if requested == "hidden" and hidden is None:
        raise ValueError(
            "chunkwise swap at hidden_states (GDN_CP_CHUNKWISE_SWAP=hidden) is not possible with "
            f"sequence_parallel=True and tensor_model_parallel_size={tp}: hidden_states are then split "
            "along the sequence over TP and gathered inside in_proj; set GDN_CP_CHUNKWISE_SWAP=core or auto "
            "(or unset it)"
        )
    if requested != "auto":
        return SwapChoice(requested, core, hidden, stock, "requested")
    if hidden is not None and hidden < core:
        return SwapChoice("hidden", core, hidden, stock, f"hidden_states {hidden} B/token < core tensors {core} B/token")
    why = "sequence parallelism with TP > 1" if hidden is None else f"core tensors {core} <= hidden_states {hidden} B/token"
    return SwapChoice("core", core, hidden, stock, why)
