"""GatedDeltaNet.forward for the pinned megatron-core, handed to a gdn-cp mode.

The pinned patch calls :func:`gated_delta_net_forward` at the top of ``GatedDeltaNet.forward``
(through :mod:`gdn_cp.megatron.hooks`). It returns ``(out, out_bias)`` where gdn-cp runs the call (CP > 1,
static or dynamic, or packed THD input) and None where the stock code below the hand-over runs (CP=1
SBHD). It reads as

    state   = the layer's gdn-cp state: adapter, settings, shape (:mod:`.layer`, made on its first call)
    batch   = the micro-batch's PackedSeqParams fields, through the layer's release adapter
    group   = the micro-batch's CP group (checked), and whether gdn-cp runs the call (:mod:`.call`)
    context = every check of the call, before any collective (:func:`gdn_cp.megatron.call.call_context`)
    mode.run(context, hidden_states, the layer's per-token work (:mod:`.segment`))

and names no mode: the mode (:mod:`gdn_cp.modes`) owns its whole segment, layout swaps included, and
runs the layer's per-token steps where it says (chunkwise may run them on its contiguous rows).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..modes.entry import prepare_mode
from .call import call_context, cp_group, should_dispatch
from .layer import layer_state
from .segment import LayerSegment

__all__ = ["gated_delta_net_forward"]


def gated_delta_net_forward(
    module,
    hidden_states: torch.Tensor,
    attention_mask=None,
    inference_context=None,
    packed_seq_params=None,
    sequence_len_offset=None,
    **kwargs,
) -> Optional[tuple]:
    """The patched ``GatedDeltaNet.forward``'s hand-over: ``(out, out_bias)`` where gdn-cp runs the
    call, None where the stock code runs (CP=1 SBHD).

    Args:
        module: the ``GatedDeltaNet`` being called (its release is found by its ``gdn.py``'s sha256).
        hidden_states (torch.Tensor): ``[S_local, B, H]``, this CP rank's zigzag rows (S_local split over TP
            under sequence parallelism); THD input is ``[T_local, 1, H]``.
        attention_mask: unused (as stock).
        inference_context: must be None (GDN has no inference path in megatron-core).
        packed_seq_params: the micro-batch's ``PackedSeqParams`` (``qkv_format='thd'``: packed rows,
            ``cu_seqlens_q_padded`` / ``cu_seqlens_q`` ``[n+1]``; ``cp_group`` / ``local_cp_size``: dynamic CP), or None.
        sequence_len_offset: unused (as stock).

    Returns:
        ``(out [S_local, B, H], out_bias [H] | None)`` as stock's forward returns them, or None where the
        stock code runs (CP=1 SBHD). ValueError / TypeError, before any collective, for input gdn-cp cannot run.
    """
    state = layer_state(module)
    batch = state.adapter.packed_seq(packed_seq_params)
    group = cp_group(state, batch)
    if not should_dispatch(state, group, batch):
        return None
    if inference_context is not None or kwargs.get("inference_params") is not None:
        raise NotImplementedError("GDN does not support inference in megatron-core (nor in gdn-cp)")
    ctx = call_context(state, group, hidden_states, batch)
    segment = LayerSegment(state, ctx.backend)
    return prepare_mode(ctx).run(ctx, hidden_states, segment)
