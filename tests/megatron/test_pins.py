"""The table of supported megatron-core releases: folders, adapters, and where the version is named."""

from __future__ import annotations

import hashlib
import re
import shutil
import sys
import types
from pathlib import Path

import pytest

from gdn_cp import pins
from gdn_cp.pins import lookup
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


# ------------------------------------------------------------------------------------------
# a new release: a pin row, its patch folder and its adapter (docs/architecture.md, "A new
# megatron-core release"), and nothing else
# ------------------------------------------------------------------------------------------
_NEW = "9.9.9"


def _code_of(path: Path) -> list[str]:
    """The import names and string constants of a module's code (docstrings left out)."""
    import ast

    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            found.append(node.value)
        elif isinstance(node, ast.ImportFrom):
            found += [node.module or ""] + [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names]
    return found


def test_only_the_pins_name_a_release_in_code():
    """Every release-specific read (the config's and the layer's fields, PackedSeqParams, Megatron-LM's
    flags and batches, TE's RMSNorm, the Python floor) goes through ``gdn_cp/pins/``: no other
    module of gdn_cp names a megatron-core release in its code or imports a release's adapter."""
    names = [re.escape(pin.version.rsplit(".", 1)[0]) for pin in pins.PINS.values()]  # "0.19": any 0.19.x
    names += [re.escape(ref) for pin in pins.PINS.values() for ref in pin.matching_refs]
    release = re.compile(r"megatron_core_\d|\b(?:" + "|".join(names) + r")\b")
    named = {}
    for path in sorted((REPO / "gdn_cp").rglob("*.py")):
        if "pins" in path.relative_to(REPO / "gdn_cp").parts:
            continue
        hits = [s for s in _code_of(path) if release.search(s)]
        if hits:
            named[str(path.relative_to(REPO))] = hits
    assert named == {}, named


def _fake_release(tmp_path, monkeypatch, overrides=None):
    """Megatron-core ``9.9.9`` added the documented way: (1) its patch folder, made by
    ``build_patch_files`` from a pristine and a patched copy of its target files, (2) its adapter
    (a subclass of 0.19.2's ``Release``, with its own ``LayerAdapter`` class, overriding ``overrides``),
    (3) its row in the pin table. Returns ``(pin, tree)``: ``tree`` a pristine 9.9.9 megatron tree."""
    from gdn_cp.pins import manifest
    from gdn_cp.patch import build_patch_files

    targets = [t.target for t in pins.load_manifest().files]
    trees = {kind: tmp_path / kind for kind in ("pristine", "patched", "tree")}
    for kind, root in trees.items():
        for target in targets:
            path = root / target
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"# {target} of megatron-core {_NEW}\n" + ("# gdn-cp's hook\n" if kind == "patched" else ""))
        info = root / "megatron/core/package_info.py"
        info.write_text("MAJOR = 9\nMINOR = 9\nPATCH = 9\nPRE_RELEASE = ''\n")
    patches = tmp_path / "patches"
    shutil.copytree(Path(str(pins.patch_dir())), patches / pins.get_pin().patch_folder)
    base = type(pins.load_adapter())
    layer_adapter = type("LayerAdapter", (base.LayerAdapter,), {"__slots__": ()})
    adapter = type("Release", (base,), {"VERSION": _NEW, "LayerAdapter": layer_adapter, **(overrides or {})})()
    pin = pins.Pin(_NEW, f"megatron-core-{_NEW}", adapter, python_floor=(3, 13))
    monkeypatch.setitem(pins.PINS, _NEW, pin)  # (3) the row
    monkeypatch.setattr(manifest, "source_patches", lambda: patches)
    build_patch_files(trees["pristine"], trees["patched"], targets, pin=_NEW, out_dir=patches / pin.patch_folder)  # (1)
    return pin, trees["tree"]


def test_a_new_release_is_its_pin_row_patch_folder_and_adapter(tmp_path, monkeypatch):
    from gdn_cp.cli.doctor import collect_report
    from gdn_cp.megatron.layer import layer_state
    from gdn_cp.patch import PATCHED, apply_patch, check_patch, detect_pin
    from gdn_cp_testing.stand_ins import stand_in_gdn

    pin, tree = _fake_release(tmp_path, monkeypatch)
    assert pins.load_manifest(_NEW).megatron_core_version == _NEW and pins.get_pin(_NEW) is pin
    # the patch tool finds the release by its files' hashes, and patches it
    assert detect_pin(tree) is pin
    apply_patch(tree)
    assert set(check_patch(tree).values()) == {PATCHED} and detect_pin(tree) is pin
    # a layer of the patched release gets its adapter (its gdn.py, by hash)
    module = types.ModuleType("fake_release_gdn")
    module.__file__ = str(tree / "megatron/core/ssm/gated_delta_net/gdn.py")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    layer_cls = type("GatedDeltaNet", (), {"__module__": module.__name__})
    layer = layer_cls()
    layer.__dict__.update(vars(stand_in_gdn()))
    assert lookup.pin_of_layer_class(layer_cls) is pin
    assert type(layer_state(layer).adapter) is pin.adapter.LayerAdapter
    # the install command and doctor read the row
    assert "--ignore-requires-python" in pin.install_command((3, 12)) and f"megatron-core=={_NEW}" in pin.install_command()
    assert collect_report()["versions"]["megatron-core pins"] == f"{pins.PINNED_VERSION}, {_NEW}"


def test_an_adapter_that_leaves_out_a_member_is_refused():
    """The release adapter's interface is declared (gdn_cp.pins.adapter): a subclass that leaves out a method
    or a class attribute cannot be made."""
    from gdn_cp.pins.adapter import ReleaseAdapter

    base = type(pins.load_adapter())
    assert isinstance(base(), ReleaseAdapter) and issubclass(base.LayerAdapter, pins.LayerAdapter)
    with pytest.raises(TypeError, match="abstract"):
        type("Half", (ReleaseAdapter,), {"read_config": lambda self, config: None})()
    attrs = {name: getattr(base, name) for name in ReleaseAdapter._CLASS_ATTRIBUTES if name != "HYBRID_GDN"}
    methods = {name: getattr(base, name) for name in ReleaseAdapter.__abstractmethods__}
    with pytest.raises(TypeError, match="does not set HYBRID_GDN"):
        type("NoSymbol", (ReleaseAdapter,), {**attrs, **methods})()
    with pytest.raises(TypeError, match="not a subclass"):
        type("NoLayer", (base,), {"LayerAdapter": object})()


def test_every_hook_reads_the_running_release_with_two_pins_installed(tmp_path, monkeypatch):
    """Two pins installed (0.19.2 and a fake 9.9.9 that differs in every read below): each hook (the config, the
    Megatron-LM args and their THD cut, the padded cut's row multiples, pipeline stages' shape exchange, the batch
    cut, a layer) reads the release of the megatron-core that runs, found when the hook runs by its files' sha256:
    0.19.2 for the megatron-core this process imports, 9.9.9 where megatron-core is the fake release's tree."""
    import torch

    from gdn_cp.megatron.config import configure_linear_cp_mode
    from gdn_cp.megatron.document_padding import cut_packed_rows, pad_and_cut
    from gdn_cp.megatron.layer import layer_state
    from gdn_cp.megatron.packed_pipeline import configure_packed_pipeline
    from gdn_cp.megatron.padded_cut import padded_rows_multiple
    from gdn_cp.megatron.thd_split import configure_megatron_lm_args
    from gdn_cp_testing.stand_ins import stand_in_gdn

    seen = []

    def read_config(self, config):
        seen.append("read_config")
        return type(pins.load_adapter()).read_config(self, config)

    def megatron_lm_args(self):
        seen.append("megatron_lm_args")
        return None

    pin, tree = _fake_release(tmp_path, monkeypatch, {
        "read_config": read_config, "megatron_lm_args": megatron_lm_args,
        "megatron_lm_thd_split": lambda self, **flags: "whole_row",  # 0.19.2: --sft cuts per document
        "QUANTIZED_ROW_MULTIPLE": {"fp8": 48, "mxfp8": 96, "fp4": 96},  # 0.19.2: 16, 32, 32
        "ALLGATHER_REFUSES_VARIABLE_SEQ_LENGTHS": False,  # 0.19.2: True
        "BATCH_PAD_VALUES": {"tokens": 99, "labels": 99, "loss_mask": 0, "position_ids": 0},  # 0.19.2: 0
    })
    from gdn_cp.patch import apply_patch

    apply_patch(tree)
    here = lookup.running_megatron_root()
    assert here is not None and (here / "megatron").is_dir()

    def hooks() -> dict:
        """What each hook read, for a run with the running megatron-core."""
        seen.clear()
        config = types.SimpleNamespace(linear_cp_mode="chunkwise")
        configure_linear_cp_mode(config)
        config_reads = seen.count("read_config")
        split = configure_megatron_lm_args(types.SimpleNamespace(sft=True, dataloader_inter_document_masking=False,
                                                                 hybrid_context_parallel=False, linear_cp_thd_split=None))
        fp8 = padded_rows_multiple(types.SimpleNamespace(fp8="hybrid"))
        pp_args = types.SimpleNamespace(pipeline_model_parallel_size=2, sft=True, micro_batch_size=2,
                                        moe_token_dispatcher_type="allgather", num_experts=None)
        configure_packed_pipeline(pp_args)
        batch = {"cu_seqlens": torch.tensor([[0, 3, 8]], dtype=torch.int32), "tokens": torch.arange(1, 9).view(1, 8)}
        cut_packed_rows(dict(batch), None)
        pad = set(pad_and_cut(batch, 2, 0)["tokens"][0].tolist()) - set(range(1, 9))
        module_name = "fake_running_gdn"
        module = types.ModuleType(module_name)
        module.__file__ = str(lookup.running_megatron_root() / "megatron/core/ssm/gated_delta_net/gdn.py")
        monkeypatch.setitem(sys.modules, module_name, module)
        layer = type("GatedDeltaNet", (), {"__module__": module_name})()
        layer.__dict__.update(vars(stand_in_gdn()))
        adapter = layer_state(layer).adapter
        layer_reads = seen.count("read_config") - config_reads  # the layer reads its config through its release
        return {"config": (config_reads, layer_reads), "thd_split": split, "padded_cut": fp8,
                "packed_pipeline": pp_args.moe_token_dispatcher_type, "document_padding": (pad, seen.count("megatron_lm_args")),
                "layer": (type(adapter), adapter.release)}

    release = pins.get_pin().adapter
    assert hooks() == {"config": (0, 0), "thd_split": "per_document", "padded_cut": 16, "packed_pipeline": "alltoall",
                       "document_padding": ({0}, 0), "layer": (release.LayerAdapter, release)}
    monkeypatch.setattr(lookup, "running_megatron_root", lambda: tree)  # now the fake release runs
    assert hooks() == {"config": (1, 1), "thd_split": "whole_row", "padded_cut": 48, "packed_pipeline": "allgather",
                       "document_padding": ({99}, 1), "layer": (pin.adapter.LayerAdapter, pin.adapter)}
    # the lookup is cached per location and sees the files change: the tree is no release once they do
    (tree / "megatron/core/ssm/gated_delta_net/gdn.py").write_text("# another file\n")
    with pytest.raises(ValueError, match=f"the megatron-core at {tree} is none of the releases .*gdn-cp patch check"):
        lookup.running_release()
