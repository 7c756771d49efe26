"""linear_cp_backend at the Megatron boundary (pure Python: configs and layers are stand-in namespaces):
checked when the config is built, resolved per layer call by the registry, logged once, never switched."""

from __future__ import annotations

import logging
import types

import pytest
import torch
import torch.nn.functional as F

from gdn_cp.megatron import backend as glue
from gdn_cp.megatron.config import configure_linear_cp_mode
from gdn_cp.ops import get_backend

from ..ops import fake_flashqla


def _config(backend="auto", *, dims=(128, 128), dtype=torch.bfloat16, deterministic=False, variant="gated_delta_net"):
    return types.SimpleNamespace(
        linear_num_key_heads=4, linear_num_value_heads=8, tensor_model_parallel_size=1, context_parallel_size=2,
        experimental_attention_variant=variant, activation_func=F.silu, linear_cp_mode="chunkwise",
        linear_cp_backend=backend, linear_key_head_dim=dims[0], linear_value_head_dim=dims[1], params_dtype=dtype,
        deterministic_mode=deterministic)


def _layer(backend="auto", *, dims=(128, 128), dtype=torch.bfloat16, deterministic=False):
    """``(settings, layer)`` of a layer: its checked settings and the adapter's view of the layer."""
    from gdn_cp.modes import Settings

    settings = Settings.from_environment(mode="chunkwise", backend=backend, deterministic=deterministic)
    return settings, types.SimpleNamespace(head_dims=dims, activation_dtype=dtype, layer_number=3)


@pytest.fixture
def fresh_choices(monkeypatch):
    monkeypatch.setattr(glue, "_LOGGED_CHOICES", set())


def test_config_default_is_auto_and_a_typo_fails():
    assert configure_linear_cp_mode(_config()) == "chunkwise"
    with pytest.raises(ValueError, match=r"TransformerConfig.linear_cp_backend='triton' is not a backend; set it to "
                                         r"one of 'auto', 'reference', 'fla', 'flashqla' \(Megatron-LM: --linear-cp-backend"):
        configure_linear_cp_mode(_config("triton"))
    with pytest.raises(ValueError, match="is not a backend"):  # even where the config builds no GDN layer
        configure_linear_cp_mode(_config("FLA", variant=None))


def test_config_refuses_a_named_backend_that_cannot_run_here():
    """This CPU machine: FLA and FlashQLA need CUDA; the message names the field, the value, why and the fix."""
    for name in ("fla", "flashqla"):
        with pytest.raises(ValueError) as err:
            configure_linear_cp_mode(_config(name))
        text = str(err.value)
        assert text.startswith(f"TransformerConfig.linear_cp_backend='{name}' (device cpu, head dims (128, 128), "
                               "params_dtype bfloat16") and "runs on cuda only" in text, text
        assert "Fix: set linear_cp_backend='auto'" in text and "or 'reference'" in text, text
    configure_linear_cp_mode(_config("reference"))
    configure_linear_cp_mode(_config("fla", variant=None))  # builds no GDN layer: only the name is checked


def test_config_with_the_stand_in(fake_installed):
    """Where FlashQLA runs (the CPU stand-in says sm_90), its own limits: head dims 128, bf16 / fp16,
    and deterministic_mode runs the reference only."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: True)
        configure_linear_cp_mode(_config("flashqla"))
        for cfg, why in ((_config("flashqla", dims=(64, 64)), "head dims of 128 only"),
                         (_config("flashqla", dtype=torch.float32), "bfloat16 / float16 activations only"),
                         (_config("flashqla", deterministic=True), "deterministic_mode runs the plain-torch")):
            with pytest.raises(ValueError, match=why):
                configure_linear_cp_mode(cfg)


@pytest.fixture
def fake_installed():
    fake_flashqla.install()
    try:
        yield
    finally:
        fake_flashqla.uninstall()


def test_forward_resolves_auto_per_device_and_logs_once(fresh_choices, fake_installed, caplog):
    with caplog.at_level(logging.INFO, logger="gdn_cp.megatron.backend"):
        assert glue.choose_backend(*_layer(), torch.device("cpu")) is get_backend("reference")
        assert glue.choose_backend(*_layer(), torch.device("cuda")) is get_backend("flashqla")
        assert glue.choose_backend(*_layer(), torch.device("cuda")) is get_backend("flashqla")
        assert glue.choose_backend(*_layer(dims=(64, 64)), torch.device("cuda")) is get_backend("reference")  # no FLA here
        assert glue.choose_backend(*_layer(deterministic=True), torch.device("cuda")) is get_backend("reference")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4, lines  # once per answer
    assert "requested=auto resolved=flashqla (device cuda, head dims (128, 128), bfloat16" in lines[1], lines
    assert "fla: FLA runs on cuda only" in lines[0] and "flashqla: FlashQLA runs on cuda only" in lines[0], lines[0]


def test_forward_refuses_a_named_backend_before_any_collective(fresh_choices, fake_installed):
    with pytest.raises(ValueError, match=r"GatedDeltaNet \(layer 3\): config.linear_cp_backend='flashqla' on cpu"):
        glue.choose_backend(*_layer("flashqla"), torch.device("cpu"))
    with pytest.raises(ValueError, match=r"config.linear_cp_backend='flashqla' on cuda, head dims \(128, 128\), "
                                         r"float32: backend 'flashqla' cannot run here: FlashQLA takes bfloat16"):
        glue.choose_backend(*_layer("flashqla", dtype=torch.float32), torch.device("cuda"))
    with pytest.raises(ValueError, match="is not a backend"):
        glue.choose_backend(*_layer("tl"), torch.device("cuda"))
    assert glue.choose_backend(*_layer("flashqla"), torch.device("cuda")) is get_backend("flashqla")
