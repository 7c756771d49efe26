"""Dynamic CP (PackedSeqParams.cp_group / local_cp_size): every bad combination is a ValueError that
names the field, raised by resolve_cp_group before any collective (fake groups: no ranks needed)."""

from __future__ import annotations

import types

import pytest

from gdn_cp.megatron.gdn import resolve_cp_group


class _Group:
    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


_STATIC = _Group(4, 1)
_LAYER = types.SimpleNamespace(pg_collection=types.SimpleNamespace(cp=_STATIC))


def _params(cp_group=None, local_cp_size=None):
    return types.SimpleNamespace(qkv_format="thd", cp_group=cp_group, local_cp_size=local_cp_size)


def test_static_group_without_dynamic_fields():
    assert resolve_cp_group(_LAYER, None) is _STATIC
    assert resolve_cp_group(_LAYER, _params()) is _STATIC


def test_dynamic_group_is_used():
    group = _Group(2, 0)
    assert resolve_cp_group(_LAYER, _params(group, 2)) is group


@pytest.mark.parametrize(
    "cp_group,local_cp_size,message",
    [
        (_Group(2, 0), None, "must be set together.*local_cp_size=None"),
        (None, 2, "must be set together.*cp_group=None"),
        (_Group(2, 0), 4, r"local_cp_size=4 does not match cp_group.size\(\)=2"),
        (_Group(2, 0), 0, "local_cp_size=0 must be a positive integer"),
        (_Group(2, 0), 2.0, "local_cp_size=2.0 must be a positive integer"),
        (_Group(2, -1), 2, "does not contain this rank"),
    ],
)
def test_bad_dynamic_cp_is_refused(cp_group, local_cp_size, message):
    with pytest.raises(ValueError, match=f"PackedSeqParams.*{message}"):
        resolve_cp_group(_LAYER, _params(cp_group, local_cp_size))
