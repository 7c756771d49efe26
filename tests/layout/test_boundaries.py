"""Boundaries: one checked value with cached views; the one cp / rank check."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch

from gdn_cp.layout import Boundaries, check_cp, host_boundaries, validate_cu_seqlens


def test_is_a_tuple_of_ints_with_cached_views():
    cu = Boundaries([0, 4, 4, 10])
    assert cu == (0, 4, 4, 10) and all(type(c) is int for c in cu)
    assert cu.total == 10 and cu.num_sequences == 3
    assert cu.numpy().dtype == np.int64 and not cu.numpy().flags.writeable
    assert cu.cpu() is cu.cpu() and cu.cpu().dtype == torch.int64
    assert cu.cpu(torch.int32) is cu.cpu(torch.int32) and cu.cpu(torch.int32).tolist() == [0, 4, 4, 10]
    assert cu.on("cpu") is cu.cpu()


def test_views_are_copies_of_the_values():
    values = [0, 4, 10]
    cu = Boundaries(values)
    values[1] = 5
    assert cu == (0, 4, 10) and cu.cpu().tolist() == [0, 4, 10]
    array = np.array([0, 2, 6])
    from_array = Boundaries(array)
    array[1] = 3
    assert from_array == (0, 2, 6)


def test_nonempty_drops_padding_slots_once():
    cu = Boundaries([0, 4, 4, 10, 10])
    dense, keep = cu.nonempty()
    assert dense == (0, 4, 10) and keep == (0, 2) and isinstance(dense, Boundaries)
    assert cu.nonempty()[0] is dense
    full = Boundaries([0, 3])
    assert full.nonempty() == (full, (0,)) and full.nonempty()[0] is full


def test_a_boundaries_value_passes_through_every_check():
    cu = Boundaries([0, 8, 24])
    assert Boundaries(cu) is cu
    assert host_boundaries(cu, 24) is cu
    assert validate_cu_seqlens(cu, 2) is cu
    # ...but the rules that depend on the use are still checked
    with pytest.raises(ValueError, match="must end at the number of rows T=20"):
        host_boundaries(cu, 20)
    with pytest.raises(ValueError, match=r"sequence 0 of cu_seqlens has length 8, not divisible by 2\*cp=16"):
        validate_cu_seqlens(cu, 8)


def test_copies_and_pickles_drop_the_caches():
    cu = Boundaries([0, 2, 6])
    cu.cpu()
    for other in (copy.deepcopy(cu), pickle.loads(pickle.dumps(cu))):
        assert other == cu and isinstance(other, Boundaries) and other._views == {}


@pytest.mark.parametrize(
    "values, error, match",
    [
        ([0], ValueError, "at least 2 boundaries"),
        ([2, 4], ValueError, r"cu_seqlens\[0\] must be 0"),
        ([0, 4, 3], ValueError, r"non-decreasing, but cu_seqlens\[2\]=3 < cu_seqlens\[1\]=4"),
        ([0, -8], ValueError, r"cu_seqlens\[1\]=-8 is out of range \(negative\)"),  # not "non-decreasing" (issue #32)
        ([0, 4, -2, 6], ValueError, r"cu_seqlens\[2\]=-2 is out of range \(negative\)"),
        ([0, 4.0], TypeError, r"cu_seqlens\[1\] must be an int, got float"),
        ([0, True], TypeError, r"cu_seqlens\[1\] must be an int, got bool"),
        ("0,4", TypeError, "must be a list of ints"),
        (torch.tensor([0, 4]), TypeError, "Python ints.*tolist"),
    ],
)
def test_bad_values_name_the_fix(values, error, match):
    with pytest.raises(error, match=match):
        Boundaries(values)


def test_numpy_ints_are_ints():
    assert Boundaries([np.int64(0), np.int32(4)]) == (0, 4)


def test_validate_reads_a_tensor_once_and_returns_boundaries():
    t = torch.tensor([0, 8, 24], dtype=torch.int32)
    cu = validate_cu_seqlens(t, 2)
    assert isinstance(cu, Boundaries) and cu == (0, 8, 24)
    t[1] = 16  # the value owns its memory
    assert cu == (0, 8, 24) and cu.cpu().tolist() == [0, 8, 24]


@pytest.mark.parametrize(
    "cp, rank, match",
    [(0, None, "cp_size"), (2.0, None, "cp_size"), (True, None, "cp_size"), (2, 2, "cp_rank"), (2, -1, "cp_rank"),
     (2, 1.0, "cp_rank"), (2, False, "cp_rank")],
)
def test_check_cp(cp, rank, match):
    with pytest.raises(ValueError, match=match):
        check_cp(cp, rank)
    check_cp(4, 3)


def test_sbhd_length_error_speaks_of_the_sequence_not_packed_boundaries():
    """SBHD has no cu_seqlens_q_padded to pad: its error names seq_len and the SBHD fix, whichever
    entry point (plan or route) found it."""
    from gdn_cp.layout.plan import plan_for_sbhd
    from gdn_cp.layout.route import build_sbhd_route

    for call in (lambda: plan_for_sbhd(6, 2, 2, 0), lambda: build_sbhd_route(6, 2, 2, 0, "zigzag", "contiguous")):
        with pytest.raises(ValueError) as err:
            call()
        msg = str(err.value)
        assert msg.startswith("SBHD sequence length seq_len=6 is not divisible by 2*cp=4"), msg
        assert "cu_seqlens" not in msg and "sequence 0 of" not in msg, msg
