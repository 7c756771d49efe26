"""Dynamic CP (PackedSeqParams.cp_group / local_cp_size): every bad combination is a ValueError that
names the field, raised by the patched forward before any collective (a stand-in layer and stand-in
groups: no ranks needed)."""

from __future__ import annotations

import types

import pytest

from gdn_cp.megatron.gdn import gated_delta_net_forward
from gdn_cp_testing.stand_ins import StandInGroup, handed_over, stand_in_gdn

_STATIC = StandInGroup(4, 1)


def _params(cp_group=None, local_cp_size=None):
    return types.SimpleNamespace(qkv_format="thd", cp_group=cp_group, local_cp_size=local_cp_size)


def test_static_group_without_dynamic_fields():
    layer = stand_in_gdn(cp_group=_STATIC)
    assert handed_over(layer, packed_seq_params=None)[1] is _STATIC
    assert handed_over(layer, packed_seq_params=_params())[1] is _STATIC


def test_dynamic_group_is_used():
    group = StandInGroup(2, 0)
    assert handed_over(stand_in_gdn(cp_group=_STATIC), packed_seq_params=_params(group, 2))[1] is group


@pytest.mark.parametrize(
    "cp_group,local_cp_size,message",
    [
        (StandInGroup(2, 0), None, "must be set together.*local_cp_size=None"),
        (None, 2, "must be set together.*cp_group=None"),
        (StandInGroup(2, 0), 4, r"local_cp_size=4 does not match cp_group.size\(\)=2"),
        (StandInGroup(2, 0), 0, "local_cp_size=0 must be a positive integer"),
        (StandInGroup(2, 0), 2.0, "local_cp_size=2.0 must be a positive integer"),
        (StandInGroup(2, -1), 2, "does not contain this rank"),
    ],
)
def test_bad_dynamic_cp_is_refused(cp_group, local_cp_size, message):
    import torch

    with pytest.raises(ValueError, match=f"PackedSeqParams.*{message}"):
        gated_delta_net_forward(stand_in_gdn(cp_group=_STATIC), torch.zeros(4, 1, 8),
                                packed_seq_params=_params(cp_group, local_cp_size))
