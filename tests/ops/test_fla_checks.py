"""The FLA backend's input checks and feature detection: pure Python, no GPU, no FLA needed.

Bad layouts and boundaries must fail with a message that names the fix before any kernel or
collective runs; detection must never raise; FLA's CP context is cached by provenance.
(Moved from tests/gpu/test_fla_backend.py, whose tests all need a GPU.)
"""

from __future__ import annotations

import pytest
import torch

from gdn_cp.ops.fla import backend as fla_backend
from gdn_cp.ops.fla import check_chunkwise_layout, fla_available, fla_version, has_cp_context

CONV_W = 4
# T_global = 512 (128 rows per rank at cp=4): an empty segment; seq 3 = [126, 300) has 2 (= W-2)
# rows on rank 0, covers rank 1 and ends on rank 2; seq 5 = [383, 450) has 1 row on rank 2.
PACKED = [0, 37, 37, 126, 300, 383, 450, 512]


def test_layout_check_accepts_straddling_sequences():
    assert check_chunkwise_layout(PACKED, 4, CONV_W, local_rows=128) == PACKED


def test_layout_check_rejects_indivisible_total():
    with pytest.raises(ValueError, match=r"T_global=510 is not divisible by 4.*pad"):
        check_chunkwise_layout([0, 100, 510], 4, CONV_W)


def test_layout_check_rejects_wrong_local_rows():
    with pytest.raises(ValueError, match=r"holds 100 rows.*128 rows per rank"):
        check_chunkwise_layout([0, 512], 4, CONV_W, local_rows=100)


def test_layout_check_rejects_ranks_smaller_than_halo():
    with pytest.raises(ValueError, match=r"each rank holds 2 rows.*W-1=3"):
        check_chunkwise_layout([0, 3, 8], 4, CONV_W)


def test_layout_check_strict_short_tail_names_sequence():
    with pytest.raises(ValueError, match=r"sequence 3 \(rows \[126, 300\).*2 rows on rank 0"):
        check_chunkwise_layout(PACKED, 4, CONV_W, allow_short_tails=False)


def test_layout_check_rejects_tensor_boundaries():
    with pytest.raises(TypeError, match="list of Python ints"):
        check_chunkwise_layout(torch.tensor([0, 8]), 2, CONV_W)


def test_layout_check_zigzag_needs_2cp():
    with pytest.raises(ValueError, match=r"not divisible by 8 \(2\*cp=8\)"):
        check_chunkwise_layout([0, 12], 4, CONV_W, layout="zigzag")


def test_boundaries_must_be_host_ints():
    with pytest.raises(TypeError, match="Python ints"):
        fla_backend._check_cu_seqlens(torch.tensor([0, 4]), 4)
    with pytest.raises(ValueError, match="must start at 0 and end"):
        fla_backend._check_cu_seqlens([0, 3], 4)
    with pytest.raises(ValueError, match="decreases at index 2"):
        fla_backend._check_cu_seqlens([0, 3, 2, 4], 4)


def test_cpu_tensors_are_refused_with_a_fix():
    x = torch.zeros(8, 4)
    with pytest.raises(ValueError, match="CUDA tensors only.*reference"):
        fla_backend.causal_conv1d(x, torch.zeros(4, 4), cu_seqlens=[0, 8])


def test_head_dim_limits():
    with pytest.raises(ValueError, match=r"head_k_dim=512.*\[16, 256\]"):
        fla_backend._check_head_dims(512, 64)
    with pytest.raises(ValueError, match="num_v_heads=6 must be a positive multiple of num_k_heads=4"):
        fla_backend._group_ratio(4, 6)


def test_cp_context_cache_provenance(monkeypatch):
    """The FLA CP context is reused for the same provenance and rebuilt when any part changes."""
    built = []

    def fake_build(cu, group, conv1d_kernel_size=None, cu_seqlens_cpu=None):
        built.append((cu, cu_seqlens_cpu.tolist(), conv1d_kernel_size))
        return object()

    monkeypatch.setattr(fla_backend, "_fla_api", lambda: {"build_cp_context": fake_build})
    cache: dict = {}
    dev_cu = torch.tensor([0, 5, 5, 16])
    kw = dict(device=torch.device("cpu"), cp_size=2, cp_rank=0, conv_kernel_size=4, layout="contiguous")
    grp = object()
    a = fla_backend._get_cp_context(cache, cu=[0, 5, 5, 16], device_cu=dev_cu, group=grp, **kw)
    assert built[-1][1] == [0, 5, 16]  # empty segments never reach FLA
    assert fla_backend._get_cp_context(cache, cu=[0, 5, 5, 16], device_cu=dev_cu, group=grp, **kw) is a
    assert len(built) == 1
    dev_cu.add_(0)  # in-place change bumps _version
    b = fla_backend._get_cp_context(cache, cu=[0, 5, 5, 16], device_cu=dev_cu, group=grp, **kw)
    assert b is not a and len(built) == 2
    assert fla_backend._get_cp_context(cache, cu=[0, 6, 16], device_cu=None, group=grp, **kw) is not b
    c = fla_backend._get_cp_context(cache, cu=[0, 6, 16], device_cu=None, group=object(), **kw)
    assert len(built) == 4 and c is not None
    kw["cp_rank"] = 1
    fla_backend._get_cp_context(cache, cu=[0, 6, 16], device_cu=None, group=grp, **kw)
    assert len(built) == 5


def test_feature_detection_never_raises():
    v = fla_version()
    assert v is None or isinstance(v, str)
    assert isinstance(fla_available(), bool)
    assert isinstance(has_cp_context(), bool)
