"""The FLA backend's input checks and feature detection: pure Python, no GPU, no FLA needed.

Bad layouts and boundaries must fail with a message that names the fix before any kernel or
collective runs; detection must never raise; FLA's CP context is cached by provenance.
"""

from __future__ import annotations

import pytest
import torch

from gdn_cp.layout import Boundaries
from gdn_cp.ops import get_backend
from gdn_cp.ops.fla import native_cp
from gdn_cp.ops.fla import spec as fla_spec
from gdn_cp.ops.fla.detect import FLAFeatures, fla_available, fla_version, has_cp_context
from gdn_cp.ops.fla.kernels import FLAFunctions
from gdn_cp.ops.fla.native_cp import check_chunkwise_layout

fla_backend = get_backend("fla")  # the kernels' module loads (torch), FLA itself on a kernel's first call

CONV_W = 4
# T_global = 512 (128 rows per rank at cp=4): an empty segment; seq 3 = [126, 300) has 2 (= W-2)
# rows on rank 0, covers rank 1 and ends on rank 2; seq 5 = [383, 450) has 1 row on rank 2.
PACKED = [0, 37, 37, 126, 300, 383, 450, 512]


def test_layout_check_accepts_straddling_sequences():
    assert check_chunkwise_layout(PACKED, 4, CONV_W, local_rows=128) == tuple(PACKED)


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
    with pytest.raises(TypeError, match="Python ints.*tolist"):
        check_chunkwise_layout(torch.tensor([0, 8]), 2, CONV_W)


def test_layout_check_uses_the_boundaries_rules():
    with pytest.raises(ValueError, match=r"cu_seqlens_global\[0\] must be 0"):
        check_chunkwise_layout([1, 4], 1, CONV_W)
    with pytest.raises(ValueError, match=r"non-decreasing, but cu_seqlens_global\[2\]=2"):
        check_chunkwise_layout([0, 3, 2, 4], 1, CONV_W)
    cu = Boundaries([0, 4, 8])
    assert check_chunkwise_layout(cu, 2, CONV_W) is cu  # checked boundaries pass through


def test_cpu_tensors_are_refused_with_a_fix():
    x = torch.zeros(8, 4)
    with pytest.raises(ValueError, match="CUDA tensors only.*reference"):
        fla_backend.causal_conv1d(x, torch.zeros(4, 4), cu_seqlens=[0, 8])


def test_head_dim_limits():
    with pytest.raises(ValueError, match=r"head_k_dim=512.*\[16, 256\]"):
        fla_backend.spec.check_head_dims(512, 64)


def test_cp_context_cache_provenance(monkeypatch):
    """The FLA CP context is reused for the same boundaries object, group, kernel size, device and rows,
    and rebuilt when any of them changes; the rows' layout is checked when it is built (once per plan:
    a hit trusts it), before any collective; empty sequences never reach FLA."""
    built, checked = [], []

    def fake_build(cu, group, conv1d_kernel_size=None, cu_seqlens_cpu=None):
        built.append((cu.tolist(), cu_seqlens_cpu.tolist(), conv1d_kernel_size))
        return object()

    monkeypatch.setattr(native_cp, "fla_api", lambda: FLAFunctions(None, None, fake_build))
    monkeypatch.setattr(native_cp, "features", lambda: FLAFeatures(
        None, None, kernel_size_arg="conv1d_kernel_size", takes_cu_seqlens_cpu=True))
    monkeypatch.setattr(native_cp, "group_size", lambda group: 2)
    real_check = native_cp.check_chunkwise_layout
    monkeypatch.setattr(native_cp, "check_chunkwise_layout", lambda *a, **k: (checked.append(a), real_check(*a, **k))[1])
    cache: dict = {}
    cpu, grp = torch.device("cpu"), object()
    cu = Boundaries([0, 5, 5, 16])
    a = native_cp._cp_context(cache, cu, grp, 4, cpu, 8)
    assert built == [([0, 5, 16], [0, 5, 16], 4)] and len(checked) == 1
    assert native_cp._cp_context(cache, cu, grp, 4, cpu, 8) is a and len(built) == 1 and len(checked) == 1
    same_values = Boundaries([0, 5, 5, 16])
    b = native_cp._cp_context(cache, same_values, grp, 4, cpu, 8)  # a new micro-batch's boundaries
    assert b is not a and len(built) == 2
    assert native_cp._cp_context(cache, same_values, object(), 4, cpu, 8) is not b and len(built) == 3
    native_cp._cp_context(cache, same_values, grp, 3, cpu, 8)
    assert len(built) == 4 and len(checked) == 4
    with pytest.raises(ValueError, match="this rank holds 7 rows but cu_seqlens_global ends at 16"):
        native_cp._cp_context(cache, same_values, grp, 3, cpu, 7)  # other rows: checked again, refused
    assert len(built) == 4


def test_feature_detection_never_raises():
    v = fla_version()
    assert v is None or isinstance(v, str)
    assert isinstance(fla_available(), bool)
    assert isinstance(has_cp_context(), bool)


def test_native_core_runs_on_nccl_and_on_backends_a_harness_adapted(monkeypatch, caplog):
    """Only NCCL takes FLA's collectives as FLA calls them; another backend's groups are taken where a
    harness that adapted FLA's collectives added it to FLA_COLLECTIVE_BACKENDS, and the first group
    of each backend is logged (never a silent switch)."""
    import logging

    monkeypatch.setattr(native_cp, "has_cp_context", lambda: True)
    monkeypatch.setattr(native_cp, "has_zigzag_layout", lambda: True)
    monkeypatch.setattr(native_cp, "_ADMITTED", set())
    backends = {"nccl": object(), "gloo": object()}
    monkeypatch.setattr(native_cp, "group_backend", lambda g: next(k for k, v in backends.items() if v is g))
    with caplog.at_level(logging.INFO, logger=native_cp.__name__):
        assert native_cp.native_cp_core(backends["nccl"]) is native_cp.cp_context_core
    assert "runs on a nccl group" in caplog.text
    assert native_cp.native_zigzag_cp_core(backends["nccl"]) is native_cp.zigzag_context_core
    assert native_cp.native_cp_core(backends["gloo"]) is None and native_cp.native_cp_core(None) is None
    monkeypatch.setattr(fla_spec, "FLA_COLLECTIVE_BACKENDS", ("nccl", "gloo"))  # what the test rank pool does
    assert native_cp.native_cp_core(backends["gloo"]) is native_cp.cp_context_core
    monkeypatch.setattr(native_cp, "has_zigzag_layout", lambda: False)
    assert native_cp.native_zigzag_cp_core(backends["gloo"]) is None


@pytest.mark.parametrize("cu, cp, rows, match", [
    ([0, 30], 2, 15, "not divisible by 2\\*cp=4"),
    ([0, 32], 2, 8, "holds 8 rows"),
    ([0, 8], 4, 2, "each zigzag part holds 1 rows"),
])
def test_zigzag_stream_checks(cu, cp, rows, match):
    with pytest.raises(ValueError, match=match):
        native_cp.check_zigzag_stream(cu, cp, 4, local_rows=rows)
    assert native_cp.check_zigzag_stream([0, 5, 32], 2, 4, local_rows=16) == (0, 5, 32)
