"""linear_cp_mode validation and resolution (pure Python: no Megatron, no GPU needed)."""

import logging
import sys
import types

import pytest

from gdn_cp.megatron import config as cfgmod
from gdn_cp.megatron.config import (
    LINEAR_CP_MODES,
    explain_linear_cp_modes,
    linear_cp_mode_problem,
    resolve_linear_cp_mode,
    validate_linear_cp_mode,
)

# (K, V, TP, CP); the expected legality is computed by _expected: headwise needs K and V
# divisible by TP*CP, chunkwise and all_gather by TP.
SHAPES = [
    (16, 32, 1, 1),
    (16, 32, 2, 4),
    (16, 32, 4, 8),  # 16 % 32: headwise illegal
    (2, 4, 1, 4),  # small head count, CP=4
    (2, 4, 2, 2),
    (3, 6, 1, 2),
    (4, 6, 2, 1),
    (3, 6, 2, 1),  # 3 % 2: nothing legal
    (4, 12, 1, 3),  # K=4 % 3
    (6, 12, 1, 3),
    (8, 8, 8, 1),
    (16, 48, 4, 2),
    (16, 48, 4, 4),  # 48 % 16 = 0 but 16 % 16 = 0 -> legal; V alone
    (32, 48, 4, 8),  # V=48 % 32 illegal, K legal
]


def _expected(k, v, tp, cp):
    return (k % (tp * cp) == 0 and v % (tp * cp) == 0), (k % tp == 0 and v % tp == 0)


@pytest.mark.parametrize("k,v,tp,cp", SHAPES)
@pytest.mark.parametrize("mode", LINEAR_CP_MODES)
def test_validate_table(mode, k, v, tp, cp):
    headwise_ok, tp_ok = _expected(k, v, tp, cp)
    legal = headwise_ok if mode == "headwise" else tp_ok
    config = types.SimpleNamespace(
        linear_cp_mode=mode,
        linear_num_key_heads=k,
        linear_num_value_heads=v,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
    )
    assert (linear_cp_mode_problem(mode, num_key_heads=k, num_value_heads=v, tp=tp, cp=cp) is None) == legal
    if legal:
        validate_linear_cp_mode(config)
    else:
        with pytest.raises(ValueError) as ei:
            validate_linear_cp_mode(config)
        msg = str(ei.value)
        assert f"linear_cp_mode={mode!r}" in msg
        assert f"tensor_model_parallel_size={tp}" in msg and f"context_parallel_size={cp}" in msg
        bad_k = k % (tp * cp if mode == "headwise" else tp) != 0
        bad_v = v % (tp * cp if mode == "headwise" else tp) != 0
        assert (f"linear_num_key_heads={k}" in msg) == bad_k
        assert (f"linear_num_value_heads={v}" in msg) == bad_v
        assert "Fix:" in msg
        if mode == "headwise" and tp_ok:
            assert "chunkwise" in msg  # points to the mode that works


def test_validate_default_mode_is_headwise():
    config = types.SimpleNamespace(
        linear_num_key_heads=2, linear_num_value_heads=4, tensor_model_parallel_size=1, context_parallel_size=4
    )
    with pytest.raises(ValueError, match="linear_cp_mode='headwise'"):
        validate_linear_cp_mode(config)


def test_validate_rejects_auto_and_points_to_resolver():
    config = types.SimpleNamespace(
        linear_cp_mode="auto",
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        tensor_model_parallel_size=1,
        context_parallel_size=2,
    )
    with pytest.raises(ValueError) as ei:
        validate_linear_cp_mode(config)
    assert "linear_cp_mode='auto'" in str(ei.value)
    assert "gdn_cp.megatron.resolve_linear_cp_mode" in str(ei.value)


@pytest.mark.parametrize("bad", ["Headwise", "head_wise", "ring", "", None, 3])
def test_validate_rejects_unknown_with_legal_list(bad):
    config = types.SimpleNamespace(
        linear_cp_mode=bad,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        tensor_model_parallel_size=1,
        context_parallel_size=2,
    )
    with pytest.raises(ValueError) as ei:
        validate_linear_cp_mode(config)
    msg = str(ei.value)
    assert f"linear_cp_mode={bad!r}" in msg
    for m in LINEAR_CP_MODES:
        assert repr(m) in msg


def test_validate_rejects_missing_heads():
    config = types.SimpleNamespace(
        linear_cp_mode="chunkwise",
        linear_num_key_heads=None,
        linear_num_value_heads=32,
        tensor_model_parallel_size=1,
        context_parallel_size=2,
    )
    with pytest.raises(ValueError, match="linear_num_key_heads=None"):
        validate_linear_cp_mode(config)


# ----------------------------------------------------------------------------------------------
# resolve_linear_cp_mode
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k,v,tp,cp", SHAPES)
@pytest.mark.parametrize("fla_usable", [True, False])
def test_resolve_auto_table(k, v, tp, cp, fla_usable, caplog):
    headwise_ok, tp_ok = _expected(k, v, tp, cp)
    caplog.set_level(logging.INFO, logger="gdn_cp.megatron.config")
    if not tp_ok:
        with pytest.raises(ValueError, match="no mode is legal"):
            resolve_linear_cp_mode("auto", num_key_heads=k, num_value_heads=v, tp=tp, cp=cp, fla_usable=fla_usable)
        return
    got = resolve_linear_cp_mode(
        "auto", num_key_heads=k, num_value_heads=v, tp=tp, cp=cp, fla_usable=fla_usable
    )
    want = "chunkwise" if fla_usable else ("headwise" if headwise_ok else "all_gather")
    assert got == want
    records = [r for r in caplog.records if r.name == "gdn_cp.megatron.config"]
    assert len(records) == 1
    line = records[0].getMessage()
    for piece in (
        "requested=auto",
        f"resolved={want}",
        f"tp={tp}",
        f"cp={cp}",
        f"linear_num_key_heads={k}",
        f"linear_num_value_heads={v}",
    ):
        assert piece in line, (piece, line)
    if want == "chunkwise":
        assert "FLA chunkwise CP path usable" in line
    elif want == "headwise":
        assert "FLA CP path not usable" in line and "divisible by TP*CP" in line
    else:
        assert "headwise is illegal" in line


@pytest.mark.parametrize("mode", LINEAR_CP_MODES)
def test_resolve_explicit_returned_and_logged(mode, caplog):
    caplog.set_level(logging.INFO, logger="gdn_cp.megatron.config")
    assert resolve_linear_cp_mode(mode, num_key_heads=16, num_value_heads=32, tp=2, cp=2, fla_usable=True) == mode
    (rec,) = [r for r in caplog.records if r.name == "gdn_cp.megatron.config"]
    assert f"requested={mode} resolved={mode}" in rec.getMessage()
    assert "explicitly requested" in rec.getMessage()


def test_resolve_explicit_illegal_raises_never_falls_back():
    with pytest.raises(ValueError, match="linear_cp_mode='headwise'.*linear_num_key_heads=2"):
        resolve_linear_cp_mode("headwise", num_key_heads=2, num_value_heads=4, tp=1, cp=4, fla_usable=True)
    with pytest.raises(ValueError, match="linear_cp_mode='chunkwise'.*linear_num_key_heads=3"):
        resolve_linear_cp_mode("chunkwise", num_key_heads=3, num_value_heads=6, tp=2, cp=1)


def test_resolve_unknown_raises():
    with pytest.raises(ValueError, match="'ring' is not a known mode.*'headwise', 'chunkwise', 'all_gather'"):
        resolve_linear_cp_mode("ring", num_key_heads=16, num_value_heads=32, tp=1, cp=2)


def test_resolve_uses_given_logger(caplog):
    lg = logging.getLogger("my.trainer")
    caplog.set_level(logging.INFO, logger="my.trainer")
    resolve_linear_cp_mode("auto", num_key_heads=16, num_value_heads=32, tp=1, cp=2, fla_usable=False, logger=lg)
    assert [r.name for r in caplog.records] == ["my.trainer"]


def test_resolve_detects_cpu_device_without_fla_import(monkeypatch, caplog):
    """device_type='cpu' -> FLA path unusable, without looking for FLA at all."""
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: pytest.fail("looked for FLA"))
    caplog.set_level(logging.INFO, logger="gdn_cp.megatron.config")
    got = resolve_linear_cp_mode("auto", num_key_heads=16, num_value_heads=32, tp=1, cp=2, device_type="cpu")
    assert got == "headwise"
    assert "device is 'cpu'" in caplog.records[-1].getMessage()


def test_detect_fla_cp_is_the_ops_detector(monkeypatch):
    """config.detect_fla_cp answers what gdn_cp.ops.fla.detect answers (variants: tests/ops/test_fla_detect.py)."""
    from gdn_cp.ops.fla import detect

    monkeypatch.setattr(detect, "features", lambda: detect.FLAFeatures(None, "kernels take no cp_context"))
    assert cfgmod.detect_fla_cp("cuda") == (False, "kernels take no cp_context")
    monkeypatch.setattr(detect, "features", lambda: detect.FLAFeatures(None, None, "conv1d_kernel_size"))
    assert cfgmod.detect_fla_cp("cuda")[0] is True
    assert cfgmod.detect_fla_cp("cpu") == (False, "device is 'cpu', FLA's CP kernels need CUDA")


def test_explain_linear_cp_modes():
    e = explain_linear_cp_modes(num_key_heads=2, num_value_heads=4, tp=1, cp=4, fla_usable=False)
    assert set(e) == {"headwise", "chunkwise", "all_gather", "auto"}
    assert e["headwise"]["legal"] is False and "TP*CP=1*4=4" in e["headwise"]["reason"]
    assert e["chunkwise"]["legal"] is True and e["all_gather"]["legal"] is True
    assert e["auto"] == {"legal": True, "resolved": "all_gather", "reason": e["auto"]["reason"]}
    assert "headwise is illegal" in e["auto"]["reason"]

    e = explain_linear_cp_modes(num_key_heads=16, num_value_heads=32, tp=2, cp=2, fla_usable=True)
    assert all(e[m]["legal"] for m in LINEAR_CP_MODES)
    assert e["auto"]["resolved"] == "chunkwise"

    e = explain_linear_cp_modes(num_key_heads=3, num_value_heads=6, tp=2, cp=1, fla_usable=True)
    assert not any(e[m]["legal"] for m in LINEAR_CP_MODES)
    assert e["auto"]["legal"] is False and e["auto"]["resolved"] is None


def test_package_import_is_light():
    """Importing gdn_cp.megatron (which the patched TransformerConfig does) pulls in no Megatron."""
    import subprocess

    code = (
        "import sys, gdn_cp.megatron, gdn_cp.megatron.config, gdn_cp.megatron.patching, gdn_cp.cli_patch;"
        "bad=[m for m in sys.modules if m.split('.')[0] in ('megatron','torch','fla','triton')];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    import os
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=repo)
    assert r.returncode == 0, r.stdout + r.stderr
