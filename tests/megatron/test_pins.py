"""The table of supported megatron-core releases: folders, adapters, and where the version is named."""

from __future__ import annotations

import hashlib
import re
import sys
import types
from pathlib import Path

import pytest

from gdn_cp.megatron import pins
from gdn_cp.megatron.pins import lookup
from gdn_cp.patch import PATCH_NAME

REPO = Path(__file__).resolve().parents[2]
_ADAPTER_API = ("VERSION", "read_config", "set_linear_cp_mode", "LayerAdapter")


@pytest.mark.parametrize("version", list(pins.PINS))
def test_every_pin_has_its_patch_folder_and_adapter(version):
    pin = pins.get_pin(version)
    manifest = pins.load_manifest(version)
    assert manifest.megatron_core_version == version
    assert Path(str(pins.patch_dir(version))).name == pin.patch_folder
    adapter = pins.load_adapter(version)
    assert all(hasattr(adapter, name) for name in _ADAPTER_API), adapter
    assert adapter.VERSION == version
    assert pin.requirement == f"megatron-core=={version}"


def test_default_pin_is_in_the_table_and_unknown_pins_are_refused():
    assert pins.PINNED_VERSION in pins.PINS and PATCH_NAME == pins.get_pin().patch_folder
    with pytest.raises(ValueError, match=r"megatron-core '0\.1\.0' is not supported .*supported: 0\.19\.2"):
        pins.get_pin("0.1.0")


def test_install_files_name_the_default_pin():
    """The places that must name the version outside Python read like the table."""
    want = f"megatron-core=={pins.PINNED_VERSION}"
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r'megatron = \["megatron-core==([^"]+)"\]', pyproject).group(1) == pins.PINNED_VERSION
    install = (REPO / "tests" / "install_deps.sh").read_text()
    assert set(re.findall(r"megatron-core==[\w.]+", install)) == {want}


def test_adapter_reads_config_fields_with_release_defaults():
    adapter = pins.load_adapter()
    f = adapter.read_config(types.SimpleNamespace(linear_num_key_heads=4, experimental_attention_variant="gated_delta_net"))
    assert (f.linear_cp_mode, f.num_key_heads, f.num_value_heads, f.tp, f.cp, f.builds_gdn) == ("headwise", 4, None, 1, 1, True)
    config = types.SimpleNamespace(linear_cp_mode="auto")
    adapter.set_linear_cp_mode(config, "chunkwise")
    assert config.linear_cp_mode == "chunkwise"


def test_layer_class_pin_single_and_by_hash(monkeypatch, tmp_path):
    class Layer:
        pass

    assert pins.pin_of_layer_class(Layer) is pins.get_pin()  # one pin: no file needed

    # Two pins: the class's source file decides, by the patched sha256 in each manifest.
    gdn = tmp_path / "megatron" / "core" / "ssm" / "gated_delta_net" / "gdn.py"
    gdn.parent.mkdir(parents=True)
    gdn.write_bytes(b"# patched gdn.py of another release\n")
    module = types.ModuleType("fake_megatron_gdn")
    module.__file__ = str(gdn)
    monkeypatch.setitem(sys.modules, "fake_megatron_gdn", module)
    Layer.__module__ = "fake_megatron_gdn"
    other = pins.Pin("9.9.9", "megatron-core-9.9.9", pins.load_adapter())
    monkeypatch.setitem(pins.PINS, "9.9.9", other)
    real_load = lookup.manifest.load_manifest
    digest = hashlib.sha256(gdn.read_bytes()).hexdigest()

    def load_manifest(pin=None):
        if pin != "9.9.9":
            return real_load(pin)
        target = pins.PatchTarget("megatron/core/ssm/gated_delta_net/gdn.py", "gdn.py.patch", "0" * 64, digest)
        return pins.Manifest("9.9.9", "megatron/core/package_info.py", (target,))

    monkeypatch.setattr(lookup.manifest, "load_manifest", load_manifest)
    assert pins.pin_of_layer_class(Layer) is other
    gdn.write_bytes(b"# something else\n")
    with pytest.raises(ValueError, match="not the patched file of any megatron-core release"):
        pins.pin_of_layer_class(Layer)
