"""gdn_cp.checks: one rule for integer arguments (what Python takes as an index), used by every layer."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from gdn_cp.checks import as_int
from gdn_cp.layout import build_thd_route, validate_cu_seqlens
from gdn_cp.layout.boundaries import sbhd_cu_seqlens
from gdn_cp.modes import GDNShape


def test_integer_likes_are_ints_bools_floats_and_tensors_are_not():
    for value in (3, np.int64(3), np.int32(3), np.uint8(3), np.array(3)):
        assert as_int(value) == 3 and type(as_int(value)) is int
    for value in (True, np.bool_(True), 3.0, np.float64(3.0), "3", None, [3], torch.tensor(3), np.array([3])):
        assert as_int(value) is None, value


def test_numpy_integers_pass_every_layer():
    """The class of issue #19's np.int64 example, below the Megatron glue: sizes given as NumPy
    integers are taken (and stored as ints) by the layout, the head shape and the SBHD boundaries."""
    cp = np.int64(2)
    assert validate_cu_seqlens([0, 8], cp) == (0, 8)
    assert build_thd_route([0, 8], cp, np.int32(1), "zigzag", "contiguous").rows_in == 4
    shape = GDNShape(num_k_heads=np.int64(2), num_v_heads=np.int64(4), head_k_dim=np.int16(8), head_v_dim=8)
    assert shape == GDNShape(2, 4, 8, 8) and type(shape.num_k_heads) is int
    with pytest.raises(ValueError, match="batch"):
        sbhd_cu_seqlens(np.int64(2**61), np.int64(4))  # the product is checked on Python ints: no wrap-around
    with pytest.raises(ValueError, match="cp_size must be a positive int, got np.float64"):
        validate_cu_seqlens([0, 8], np.float64(2.0))


def test_no_module_spells_out_its_own_integer_check():
    """The rule lives in gdn_cp/checks.py; a hand-written ``isinstance(x, int)`` check would refuse
    NumPy integers again (the bug of issue #19)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "gdn_cp"
    pattern = re.compile(r"not isinstance\(\w+, int\)|isinstance\(\w+, \(int, np\.integer\)\)")
    found = [f"{p.relative_to(root)}:{n}" for p in sorted(root.rglob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == [], f"use gdn_cp.checks.as_int: {found}"


def test_one_size_limit_everywhere(capsys):
    """Issue #25: the layout refused cp_size above 65536, but resolve_linear_cp_mode(..., cp=10**23)
    answered 'chunkwise' and `gdn-cp doctor --cp 99999999999999999999999` exited 0. The CP and TP
    limits live in gdn_cp.checks; every entry point that takes the size refuses a larger one."""
    from gdn_cp.checks import MAX_CP_SIZE, MAX_TP_SIZE
    from gdn_cp.cli import main
    from gdn_cp.megatron import configure_linear_cp_mode, explain_linear_cp_modes, resolve_linear_cp_mode

    assert MAX_CP_SIZE == MAX_TP_SIZE == 65536
    heads = dict(num_key_heads=4, num_value_heads=8)
    for cp in (MAX_CP_SIZE + 1, 10**23, np.int64(2**40)):
        with pytest.raises(ValueError, match=r"cp_size=\d+ is larger than any CP group gdn-cp plans for \(at most 65536\)"):
            validate_cu_seqlens([0, 0], cp)
        for call in (resolve_linear_cp_mode, explain_linear_cp_modes):
            args = ("auto",) if call is resolve_linear_cp_mode else ()
            with pytest.raises(ValueError, match=r"^cp=\d+ is larger than any CP group gdn-cp plans for \(at most 65536\)"):
                call(*args, **heads, tp=1, cp=cp)
    with pytest.raises(ValueError, match=r"^tp=65537 is larger than any TP group"):
        resolve_linear_cp_mode("chunkwise", **heads, tp=MAX_TP_SIZE + 1, cp=1)
    config = types.SimpleNamespace(linear_cp_mode="auto", linear_num_key_heads=4, linear_num_value_heads=8,
                                   tensor_model_parallel_size=1, context_parallel_size=10**23,
                                   experimental_attention_variant="gated_delta_net")
    with pytest.raises(ValueError, match=r"^context_parallel_size=\d+ is larger than any CP group"):
        configure_linear_cp_mode(config)
    assert resolve_linear_cp_mode("auto", **heads, tp=1, cp=MAX_CP_SIZE) == "chunkwise"  # the limit itself is fine
    for argv in (["doctor", "--heads", "4,8", "--cp", "99999999999999999999999"],
                 ["doctor", "--heads", "4,8", "--tp", "65537"],
                 ["route", "--cu", "0,0", "--cp", "65537", "--rank", "0"]):
        try:
            rc = main(argv)
        except SystemExit as exit_:
            rc = exit_.code
        cap = capsys.readouterr()
        assert rc == 2 and cap.out == "" and "65536" in cap.err, (argv, cap)


def test_the_size_limits_are_defined_once():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "gdn_cp"
    pattern = re.compile(r"^MAX_(CP|TP)_SIZE\s*=", re.M)
    found = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if pattern.search(p.read_text()))
    assert found == ["checks.py"], found
