"""A GatedDeltaNet stand-in without megatron-core, for what the patched forward checks before any
collective, and a way to see what the forward hands on without running a mode.

:func:`stand_in_gdn` answers every attribute the forward reads up to its call context (the
adapter's view of a layer); :func:`handed_over` calls the public forward and stops it where the
mode would start, returning what it got that far.
"""

from __future__ import annotations

import types
from typing import Any, Optional

import torch
import torch.nn.functional as F

__all__ = ["Handed", "StandInGroup", "handed_over", "stand_in_gdn"]


class StandInGroup:
    """A process group that knows its size and this rank's place in it, and nothing else."""

    def __init__(self, size: int, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def stand_in_gdn(*, cp_group=None, tp_size: int = 1, tp_group=None, act_fn=F.silu, layer_number: int = 1,
                 heads=(4, 8), head_dim: int = 8, **config) -> Any:
    """A GatedDeltaNet as the pin's adapter reads it: ``config`` (fields as keywords; ``linear_cp_mode``
    defaults to chunkwise), the static CP group (default: one rank), TP size and group, activation,
    heads ``(key, value)`` (TP-local = global here) of ``head_dim``, an ``out_norm`` without parameters."""
    cfg = dict(linear_cp_mode="chunkwise", linear_num_key_heads=heads[0], linear_num_value_heads=heads[1],
               deterministic_mode=True)
    cfg.update(config)
    return types.SimpleNamespace(
        config=types.SimpleNamespace(**cfg),
        pg_collection=types.SimpleNamespace(cp=cp_group or StandInGroup(1), tp=tp_group),
        out_norm=types.SimpleNamespace(named_parameters=lambda: []), tp_size=tp_size, sp_size=1, act_fn=act_fn,
        layer_number=layer_number, num_key_heads=heads[0],
        num_value_heads=heads[1], num_k_heads_local_tp=heads[0], num_v_heads_local_tp=heads[1],
        key_head_dim=head_dim, value_head_dim=head_dim, use_qk_l2norm=True,
        conv1d=types.SimpleNamespace(weight=torch.zeros(1, 1, 4)),  # its parameters' dtype and device
    )


class Handed(Exception):
    """Raised in place of the mode: the forward got this far. ``args``: ``(state, group, hidden_states,
    batch)`` as the forward passed them to its call context (``batch``: the PackedSeqParams' fields)."""


def handed_over(module, hidden_states: Optional[torch.Tensor] = None, packed_seq_params=None):
    """Call the public forward (:func:`gdn_cp.megatron.gdn.gated_delta_net_forward`) up to its call
    context: returns None where it leaves the call to the stock code, the :class:`Handed` arguments
    where it would build the context (its checks before that raise as they do)."""
    import gdn_cp.megatron.gdn as glue

    def stop(*args):
        raise Handed(*args)

    hidden_states = torch.zeros(4, 1, 8) if hidden_states is None else hidden_states
    saved, glue.call_context = glue.call_context, stop
    try:
        return glue.gated_delta_net_forward(module, hidden_states, packed_seq_params=packed_seq_params)
    except Handed as handed:
        return handed.args
    finally:
        glue.call_context = saved
