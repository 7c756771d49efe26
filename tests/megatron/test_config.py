"""linear_cp_mode at the Megatron boundary: the one check, auto resolution and the TransformerConfig
hook (pure Python: no Megatron, no GPU needed; configs are stand-in namespaces with the fields)."""

import logging
import sys
import types

import pytest

from gdn_cp.megatron import config as cfgmod
from gdn_cp.megatron import rules
from gdn_cp.megatron.config import configure_linear_cp_mode, explain_linear_cp_modes, resolve_linear_cp_mode
from gdn_cp.megatron.rules import check_linear_cp_mode
from gdn_cp.modes.spec import MODE_CHOICES, MODE_NAMES

# (K, V, TP, CP); the expected legality is computed by _expected: headwise needs K and V
# divisible by TP*CP, chunkwise and all_gather by TP.
SHAPES = [
    (16, 32, 1, 1),
    (16, 32, 2, 4),
    (16, 32, 4, 8),  # 16 % 32: headwise illegal
    (2, 4, 1, 4),  # small head count, CP=4
    (2, 4, 2, 2),
    (3, 6, 1, 2),
    (4, 8, 2, 1),
    (3, 6, 2, 1),  # 3 % 2: nothing legal
    (4, 12, 1, 3),  # K=4 % 3
    (6, 12, 1, 3),
    (8, 8, 8, 1),
    (16, 48, 4, 2),
    (16, 48, 4, 4),  # 48 % 16 = 0 but 16 % 16 = 0 -> legal; V alone
    (16, 64, 4, 8),  # V=64 % 32 legal, K illegal (V a multiple of K: V illegal with K legal cannot happen)
]


def _expected(k, v, tp, cp):
    return (k % (tp * cp) == 0 and v % (tp * cp) == 0), (k % tp == 0 and v % tp == 0)


_ABSENT = object()  # a config without the linear_cp_mode field


def _config(mode="headwise", k=16, v=32, tp=1, cp=2, variant="gated_delta_net", **extra):
    """A stand-in TransformerConfig carrying the fields the hook reads (activation_func: SiLU, unless
    ``extra`` says otherwise)."""
    import torch.nn.functional as F

    extra.setdefault("activation_func", F.silu)
    fields = dict(
        linear_num_key_heads=k, linear_num_value_heads=v, tensor_model_parallel_size=tp,
        context_parallel_size=cp, experimental_attention_variant=variant, **extra,
    )  # fmt: skip
    if mode is not _ABSENT:
        fields["linear_cp_mode"] = mode
    return types.SimpleNamespace(**fields)


@pytest.mark.parametrize("k,v,tp,cp", SHAPES)
@pytest.mark.parametrize("mode", MODE_NAMES)
def test_check_table(mode, k, v, tp, cp):
    """The forward's check and the config hook accept and refuse the same (mode, heads, TP, CP)."""
    headwise_ok, tp_ok = _expected(k, v, tp, cp)
    legal = headwise_ok if mode == "headwise" else tp_ok
    config = _config(mode, k, v, tp, cp)
    if legal:
        assert check_linear_cp_mode(mode, num_key_heads=k, num_value_heads=v, tp=tp, cp=cp) == mode
        assert configure_linear_cp_mode(config) == mode and config.linear_cp_mode == mode
        return
    errors = []
    for call in (
        lambda: check_linear_cp_mode(mode, num_key_heads=k, num_value_heads=v, tp=tp, cp=cp),
        lambda: configure_linear_cp_mode(config),
    ):
        with pytest.raises(ValueError) as ei:
            call()
        errors.append(str(ei.value))
    assert errors[0] == errors[1]  # one function behind both
    msg = errors[0]
    assert f"linear_cp_mode={mode!r}" in msg
    assert f"tensor_model_parallel_size={tp}" in msg and f"context_parallel_size={cp}" in msg
    bad_k = k % (tp * cp if mode == "headwise" else tp) != 0
    bad_v = v % (tp * cp if mode == "headwise" else tp) != 0
    assert (f"linear_num_key_heads={k}" in msg) == bad_k
    assert (f"linear_num_value_heads={v}" in msg) == bad_v
    assert "Fix:" in msg
    if mode == "headwise" and tp_ok:
        assert "'chunkwise' or 'all_gather'" in msg  # points to the modes that work


def test_config_without_the_patched_field_is_stocks_headwise():
    """A config object without ``linear_cp_mode`` (megatron-core unpatched, or a stand-in) runs stock's
    one scheme, headwise; the patched field's own default is ``auto`` (tests/patch/test_patched_megatron.py)."""
    with pytest.raises(ValueError, match="linear_cp_mode='headwise'"):
        configure_linear_cp_mode(_config(_ABSENT, 2, 4, 1, 4))


def test_config_without_gdn_layers_checks_no_heads_but_rejects_typos():
    """Stock 0.19.2 checks heads only for experimental_attention_variant='gated_delta_net'."""
    other = _config("headwise", 3, 6, 1, 2, variant=None)
    assert configure_linear_cp_mode(other) == "headwise"  # K=3 at CP=2: not this config's business
    with pytest.raises(ValueError, match="linear_cp_mode='head_wise' is not a known mode"):
        configure_linear_cp_mode(_config("head_wise", variant=None))


def test_config_without_gdn_layers_resolves_checks_and_logs_nothing(caplog):
    """No GDN layer (neither the gated_delta_net variant nor a hybrid model): TP=3 with Megatron's
    default GDN heads (16, 32) is fine, 'auto' stays as given, nothing about GDN heads is logged."""
    caplog.set_level(logging.DEBUG, logger="gdn_cp")
    for mode in ("auto", "headwise", "chunkwise"):
        config = _config(mode, 16, 32, 3, 2, variant=None)
        assert configure_linear_cp_mode(config) == mode and config.linear_cp_mode == mode
    other = _config("auto", None, None, 3, 2, variant="dsa")  # heads never read
    assert configure_linear_cp_mode(other) == "auto"
    assert [r.getMessage() for r in caplog.records if r.name.startswith("gdn_cp")] == []


def test_hybrid_config_leaves_auto_to_its_gdn_layers_when_no_mode_is_legal(caplog):
    """A hybrid model's pattern (which the config does not see) may hold no GDN layer: with no legal
    mode for its heads, the config keeps 'auto' and does not raise; a GDN layer, if there is one,
    raises with the reason when its forward checks the mode."""
    caplog.set_level(logging.DEBUG, logger="gdn_cp")
    config = _config("auto", 16, 32, 3, 2, variant=None, is_hybrid_model=True)
    assert configure_linear_cp_mode(config) == "auto" and config.linear_cp_mode == "auto"
    assert [r for r in caplog.records if r.name.startswith("gdn_cp")] == []
    with pytest.raises(ValueError, match=r"linear_cp_mode='auto': no mode is legal: .*linear_num_key_heads=16"):
        check_linear_cp_mode("auto", num_key_heads=16, num_value_heads=32, tp=3, cp=2)  # the layer's check
    # an explicit mode: checked by the GDN layers (as before), not by the config
    assert configure_linear_cp_mode(_config("headwise", 16, 32, 3, 2, variant=None, is_hybrid_model=True)) == "headwise"


def test_sizes_take_integer_likes_and_errors_name_the_argument_used():
    """NumPy integers are integers (operator.index); refusals name the caller's keyword argument, and
    the config hook names the TransformerConfig field."""
    np = pytest.importorskip("numpy")
    assert resolve_linear_cp_mode("headwise", num_key_heads=np.int64(16), num_value_heads=np.int32(32),
                                  tp=np.int64(1), cp=np.uint8(2)) == "headwise"
    assert resolve_linear_cp_mode("auto", num_key_heads=np.int64(16), num_value_heads=32, tp=1, cp=2) == "chunkwise"
    assert check_linear_cp_mode("chunkwise", num_key_heads=np.int64(4), num_value_heads=8, tp=2, cp=4) == "chunkwise"
    assert explain_linear_cp_modes(num_key_heads=np.int64(4), num_value_heads=8, tp=1, cp=2)["auto"]["legal"]
    config = _config("auto", np.int64(16), np.int64(32), np.int64(1), np.int64(2))
    assert configure_linear_cp_mode(config) in MODE_NAMES
    for arg, bad in (("num_key_heads", np.float64(16.0)), ("num_value_heads", True), ("tp", 2.0), ("cp", np.bool_(True))):
        sizes = {**dict(num_key_heads=16, num_value_heads=32, tp=1, cp=2), arg: bad}
        for call in (resolve_linear_cp_mode, check_linear_cp_mode):
            with pytest.raises(ValueError) as ei:
                call("headwise", **sizes)
            msg = str(ei.value)
            assert msg.startswith(f"{arg}={bad!r} must be a positive integer"), msg
            assert "TransformerConfig" not in msg and "linear_num" not in msg, msg
    with pytest.raises(ValueError, match=r"^num_value_heads=6 must be a multiple of num_key_heads=4"):
        resolve_linear_cp_mode("headwise", num_key_heads=4, num_value_heads=6, tp=1, cp=1)
    with pytest.raises(ValueError, match=r"^linear_num_value_heads=6 must be a multiple of linear_num_key_heads=4"):
        configure_linear_cp_mode(_config("headwise", 4, 6, 1, 1))


def test_config_resolves_auto_once_and_logs(caplog):
    caplog.set_level(logging.DEBUG, logger="gdn_cp.megatron.config")
    cfgmod._LOGGED.clear()
    config = _config("auto", 2, 4, 1, 4)
    assert configure_linear_cp_mode(config) == "chunkwise"  # headwise is illegal; never all_gather
    assert config.linear_cp_mode == "chunkwise"  # the field holds the concrete mode
    (rec,) = [r for r in caplog.records if r.name == "gdn_cp.megatron.config"]
    line = rec.getMessage()
    assert rec.levelno == logging.INFO
    for piece in ("requested=auto", "resolved=chunkwise", "tp=1", "cp=4", "linear_num_key_heads=2"):
        assert piece in line, (piece, line)
    assert configure_linear_cp_mode(config) == "chunkwise"  # a copy of the config: a concrete mode, no new log
    assert len([r for r in caplog.records if r.name == "gdn_cp.megatron.config"]) == 1
    # Megatron-LM rebuilds the config every micro-batch: the same request is logged at DEBUG only
    for _ in range(3):
        assert configure_linear_cp_mode(_config("auto", 2, 4, 1, 4)) == "chunkwise"
    levels = [r.levelno for r in caplog.records if r.name == "gdn_cp.megatron.config"]
    assert levels == [logging.INFO, logging.DEBUG, logging.DEBUG, logging.DEBUG]
    hybrid = _config("auto", 16, 32, 2, 4, variant=None, is_hybrid_model=True)
    assert configure_linear_cp_mode(hybrid) == "chunkwise"  # hybrid models too


def test_auto_is_machine_independent(monkeypatch):
    """auto never looks at the device or FLA: the same sizes give the same mode everywhere."""
    import importlib.util

    import gdn_cp.ops.fla.detect as detect

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: pytest.fail(f"looked for {name}"))
    monkeypatch.setattr(detect, "detect_fla_cp", lambda *a, **k: pytest.fail("asked for FLA"))
    assert resolve_linear_cp_mode("auto", num_key_heads=6, num_value_heads=12, tp=1, cp=4) == "chunkwise"


def test_config_auto_with_nothing_legal_names_fields_and_fix():
    config = _config("auto", 3, 6, 2, 1)
    with pytest.raises(ValueError) as ei:
        configure_linear_cp_mode(config)
    msg = str(ei.value)
    assert "linear_cp_mode='auto': no mode is legal" in msg and "linear_num_key_heads=3" in msg
    assert "Fix:" in msg and "TransformerConfig with linear_cp_mode='auto'" in msg
    assert config.linear_cp_mode == "auto"  # untouched on failure


def test_check_rejects_unresolved_auto_and_points_to_resolver():
    with pytest.raises(ValueError) as ei:
        check_linear_cp_mode("auto", num_key_heads=16, num_value_heads=32, tp=1, cp=2)
    assert "linear_cp_mode='auto' must be resolved" in str(ei.value)
    assert "gdn_cp.megatron.resolve_linear_cp_mode" in str(ei.value)


@pytest.mark.parametrize("bad", ["Headwise", "head_wise", "ring", "", None, 3])
def test_unknown_modes_list_every_choice(bad):
    for call in (
        lambda: check_linear_cp_mode(bad, num_key_heads=16, num_value_heads=32, tp=1, cp=2),
        lambda: configure_linear_cp_mode(_config(bad)),
        lambda: resolve_linear_cp_mode(bad, num_key_heads=16, num_value_heads=32, tp=1, cp=2),
    ):
        with pytest.raises(ValueError) as ei:
            call()
        msg = str(ei.value)
        assert f"linear_cp_mode={bad!r}" in msg
        assert all(repr(m) in msg for m in MODE_CHOICES), msg
        assert "--linear-cp-mode" in msg


@pytest.mark.parametrize("field,value", [("linear_num_key_heads", None), ("linear_num_value_heads", 0),
                                         ("tensor_model_parallel_size", 1.5)])
def test_rejects_missing_or_bad_sizes(field, value):
    config = _config("chunkwise")
    setattr(config, field, value)
    with pytest.raises(ValueError, match=f"{field}={value!r} must be a positive integer"):
        configure_linear_cp_mode(config)


# ----------------------------------------------------------------------------------------------
# resolve_linear_cp_mode
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k,v,tp,cp", SHAPES)
def test_resolve_auto_table(k, v, tp, cp, caplog):
    headwise_ok, tp_ok = _expected(k, v, tp, cp)
    caplog.set_level(logging.INFO, logger="gdn_cp.megatron.config")
    cfgmod._LOGGED.clear()
    if not tp_ok:
        with pytest.raises(ValueError, match="no mode is legal"):
            resolve_linear_cp_mode("auto", num_key_heads=k, num_value_heads=v, tp=tp, cp=cp)
        return
    assert resolve_linear_cp_mode("auto", num_key_heads=k, num_value_heads=v, tp=tp, cp=cp) == "chunkwise"
    records = [r for r in caplog.records if r.name == "gdn_cp.megatron.config"]
    assert len(records) == 1
    line = records[0].getMessage()
    for piece in ("requested=auto", "resolved=chunkwise", f"tp={tp}", f"cp={cp}", f"linear_num_key_heads={k}",
                  f"linear_num_value_heads={v}", "the first legal mode of chunkwise, headwise, all_gather", f"heads divisible by TP={tp}"):
        assert piece in line, (piece, line)


@pytest.mark.parametrize("mode", MODE_NAMES)
def test_resolve_explicit_returned_and_logged(mode, caplog):
    caplog.set_level(logging.INFO, logger="gdn_cp.megatron.config")
    cfgmod._LOGGED.clear()
    assert resolve_linear_cp_mode(mode, num_key_heads=16, num_value_heads=32, tp=2, cp=2) == mode
    (rec,) = [r for r in caplog.records if r.name == "gdn_cp.megatron.config"]
    assert f"requested={mode} resolved={mode}" in rec.getMessage()
    assert "explicitly requested" in rec.getMessage()


def test_resolve_explicit_illegal_raises_never_falls_back():
    with pytest.raises(ValueError, match="linear_cp_mode='headwise'.*linear_num_key_heads=2"):
        resolve_linear_cp_mode("headwise", num_key_heads=2, num_value_heads=4, tp=1, cp=4)
    with pytest.raises(ValueError, match="linear_cp_mode='chunkwise'.*linear_num_key_heads=3"):
        resolve_linear_cp_mode("chunkwise", num_key_heads=3, num_value_heads=6, tp=2, cp=1)


def test_resolve_uses_given_logger(caplog):
    lg = logging.getLogger("my.trainer")
    caplog.set_level(logging.INFO, logger="my.trainer")
    cfgmod._LOGGED.clear()
    resolve_linear_cp_mode("auto", num_key_heads=16, num_value_heads=32, tp=1, cp=2, logger=lg)
    assert [r.name for r in caplog.records] == ["my.trainer"]


def test_explain_linear_cp_modes():
    e = explain_linear_cp_modes(num_key_heads=2, num_value_heads=4, tp=1, cp=4)
    assert list(e) == [*MODE_NAMES, "auto"]  # the registry's modes, in its order
    assert e["headwise"]["legal"] is False and "TP*CP=1*4=4" in e["headwise"]["reason"]
    assert e["chunkwise"]["legal"] is True and e["all_gather"]["legal"] is True
    assert e["auto"] == {"legal": True, "resolved": "chunkwise", "reason": e["auto"]["reason"]}

    e = explain_linear_cp_modes(num_key_heads=16, num_value_heads=32, tp=2, cp=2)
    assert all(e[m]["legal"] for m in MODE_NAMES)
    assert e["auto"]["resolved"] == "chunkwise"

    e = explain_linear_cp_modes(num_key_heads=3, num_value_heads=6, tp=2, cp=1)
    assert not any(e[m]["legal"] for m in MODE_NAMES)
    assert e["auto"]["legal"] is False and e["auto"]["resolved"] is None


def _imported_heavy(code: str) -> list:
    """Top-level heavy packages (megatron, torch, fla, triton) that ``code`` imports, in a fresh Python."""
    import os
    import subprocess
    from pathlib import Path

    probe = code + "; import sys; print(sorted({m.split('.')[0] for m in sys.modules} & {'megatron','torch','fla','triton'}))"
    repo = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=repo)
    assert r.returncode == 0, r.stdout + r.stderr
    return eval(r.stdout.strip().splitlines()[-1])


def test_imports_are_light():
    """The patch tool imports no Megatron, torch, FLA or Triton; the config hook (imported by the
    patched TransformerConfig) adds nothing to what the mode registry itself costs."""
    assert _imported_heavy("import gdn_cp.megatron, gdn_cp.patch, gdn_cp.pins, gdn_cp.cli.patch, gdn_cp.cli.doctor") == []
    registry = _imported_heavy("import gdn_cp.modes.spec")
    assert "megatron" not in registry
    assert _imported_heavy("import gdn_cp.megatron.config, gdn_cp.pins.megatron_core_0_19_2") == registry


def test_names_come_from_the_registry(monkeypatch):
    """A mode added to the registry is legal for the config, the check, auto and doctor alike."""
    from gdn_cp.modes import spec

    extra = spec.ModeSpec(name="ring", divides_by_cp=False, cost="test mode", auto_rank=-1)
    monkeypatch.setitem(spec.MODES, "ring", extra)
    monkeypatch.setattr(rules, "MODE_NAMES", (*MODE_NAMES, "ring"))
    assert check_linear_cp_mode("ring", num_key_heads=3, num_value_heads=6, tp=1, cp=2) == "ring"
    assert configure_linear_cp_mode(_config("ring", 3, 6, 1, 2)) == "ring"
    assert resolve_linear_cp_mode("auto", num_key_heads=3, num_value_heads=6, tp=1, cp=2) == "ring"
    assert "ring" in explain_linear_cp_modes(num_key_heads=3, num_value_heads=6, tp=1, cp=2)


def test_each_gdn_layer_logs_the_mode_it_runs_once(caplog):
    """Issue #32: at start-up every GDN layer says, once at INFO, which linear_cp_mode it runs (with TP,
    CP and its heads); its later calls log nothing more at INFO, a new CP size (dynamic CP) at DEBUG."""
    from gdn_cp.megatron import call
    from gdn_cp.megatron.layer import layer_state

    caplog.set_level(logging.DEBUG, logger="gdn_cp")
    from gdn_cp_testing.stand_ins import stand_in_gdn

    layers = [layer_state(stand_in_gdn(layer_number=n)) for n in (1, 3)]
    for _ in range(3):
        for layer in layers:
            call.check_mode(layer, 2)
    call.check_mode(layers[0], 4)
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and r.name == call.logger.name]
    assert info == [f"GatedDeltaNet layer {n} runs linear_cp_mode=chunkwise (TP=1, CP=2, linear_num_key_heads=4, "
                    "linear_num_value_heads=8)" for n in (1, 3)], info
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG and r.name == call.logger.name]
    assert debug == ["GatedDeltaNet layer 1 runs linear_cp_mode=chunkwise (TP=1, CP=4, linear_num_key_heads=4, "
                     "linear_num_value_heads=8)"], debug


def test_each_head_rule_message_is_written_once():
    """The head rule's two errors (a mode that cannot split the heads; ``auto`` with no legal mode) are built in
    one place, gdn_cp/modes/spec.py, and the config hook, a layer's check, doctor's table and the core's entry
    call it: the same heads give the same message (the config adds which config asked; the core names its
    GDNShape's fields and the CP group)."""
    import re
    from pathlib import Path

    from gdn_cp.modes.spec import heads_error, no_legal_mode_error

    root = Path(__file__).resolve().parents[2] / "gdn_cp"
    for phrase in ("no mode is legal: ", "which these heads allow", "is not divisible by {spec.divisor_text"):
        where = [str(p.relative_to(root)) for p in root.rglob("*.py") if phrase in p.read_text()]
        assert where == ["modes/spec.py"], (phrase, where)

    want = str(no_legal_mode_error(3, 6, 2, 1))
    with pytest.raises(ValueError) as layer:
        check_linear_cp_mode("auto", num_key_heads=3, num_value_heads=6, tp=2, cp=1)
    with pytest.raises(ValueError) as config:
        configure_linear_cp_mode(_config("auto", 3, 6, 2, 1))
    with pytest.raises(ValueError) as resolved:
        resolve_linear_cp_mode("auto", num_key_heads=3, num_value_heads=6, tp=2, cp=1)
    doctor = explain_linear_cp_modes(num_key_heads=3, num_value_heads=6, tp=2, cp=1)["auto"]["reason"]
    assert str(layer.value) == str(resolved.value) == doctor == want
    assert str(config.value).startswith(want[:-1] + " (TransformerConfig with linear_cp_mode='auto'")

    want = str(heads_error("headwise", num_key_heads=4, num_value_heads=8, tp=1, cp=8))
    with pytest.raises(ValueError) as layer:
        check_linear_cp_mode("headwise", num_key_heads=4, num_value_heads=8, tp=1, cp=8)
    assert str(layer.value) == want
    assert re.search(r"linear_num_key_heads=4 is not divisible by TP\*CP=1\*8=8\. Fix: set linear_cp_mode to "
                     r"'chunkwise' or 'all_gather'", want)
