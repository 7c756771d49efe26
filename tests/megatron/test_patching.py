"""The pinned Megatron-Core 0.19.2 patch: apply / check / revert on real megatron-core sources.

Sources: the megatron-core 0.19.2 sdist (``$GDN_CP_MEGATRON_SDIST`` if set, else ``pip download``),
else the installed megatron-core (reverted in a copy when it is patched; the manifest's pristine
hashes are the oracle either way). Tests needing them are marked ``megatron``; when no source can
be had they FAIL with the reason, unless ``GDN_CP_ALLOW_SKIP_MEGATRON=1`` is set.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from gdn_cp.cli import main as cli_main
from gdn_cp.megatron import patching
from gdn_cp.megatron.patching import (
    BACKUP_SUFFIX,
    MISSING,
    MODIFIED,
    PARTIAL,
    PATCHED,
    PRISTINE,
    PatchError,
    apply_patch,
    check_patch,
    find_megatron_root,
    load_manifest,
    overall_state,
    revert_patch,
)

REPO = Path(__file__).resolve().parents[2]
VERSION = patching.PINNED_VERSION
GDN = "megatron/core/ssm/gated_delta_net/gdn.py"
CFG = "megatron/core/transformer/transformer_config.py"
UTILS = "megatron/core/utils.py"  # get_batch_on_this_cp_rank records its THD split
ARGS = "megatron/training/arguments.py"  # validate_args sets --linear-cp-thd-split from the data flags
TARGETS = (CFG, GDN, UTILS, ARGS)
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*" + BACKUP_SUFFIX, "*.gdn_cp.tmp")


def _megatron_unavailable(reason: str):
    if os.environ.get("GDN_CP_ALLOW_SKIP_MEGATRON") == "1":
        pytest.skip(reason)
    pytest.fail(
        f"{reason}\nThese tests need the megatron-core {VERSION} sources: network access to PyPI "
        f"(pip download), GDN_CP_MEGATRON_SDIST=/path/megatron_core-{VERSION}.tar.gz, or an "
        f"installed megatron-core=={VERSION}. Set GDN_CP_ALLOW_SKIP_MEGATRON=1 to skip instead.",
        pytrace=False,
    )


def _extract(tar_path: Path, dest: Path) -> Path:
    with tarfile.open(tar_path) as tf:
        if hasattr(tarfile, "data_filter"):
            tf.extractall(dest, filter="data")
        else:  # pragma: no cover - Python < 3.11.4
            tf.extractall(dest)
    (top,) = [p for p in dest.iterdir() if p.is_dir()]
    return top


def _all_pristine(root: Path) -> bool:
    return set(check_patch(root).values()) == {PRISTINE}


@pytest.fixture(scope="session")
def pristine_megatron(tmp_path_factory) -> Path:
    """A folder holding a pristine megatron-core 0.19.2 ``megatron/`` package (read-only use)."""
    base = tmp_path_factory.mktemp("megatron-src")
    tried = []

    sdist = os.environ.get("GDN_CP_MEGATRON_SDIST")
    if sdist:
        root = _extract(Path(sdist), base / "given")
        if _all_pristine(root):
            return root
        tried.append(f"GDN_CP_MEGATRON_SDIST={sdist}: not pristine 0.19.2 ({check_patch(root)})")

    dl = base / "download"
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-binary", "megatron-core", "--no-deps",
        "--ignore-requires-python", f"megatron-core=={VERSION}", "-d", str(dl),
    ]  # fmt: skip
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        tars = sorted(dl.glob("megatron_core-*.tar.gz"))
        if r.returncode == 0 and tars:
            root = _extract(tars[0], base / "sdist")
            if _all_pristine(root):
                return root
            tried.append(f"pip download: sdist not pristine ({check_patch(root)})")
        else:
            tried.append(f"pip download failed (rc={r.returncode}): {r.stderr.strip()[-500:]}")
    except (OSError, subprocess.TimeoutExpired) as e:
        tried.append(f"pip download failed: {e!r}")

    try:
        installed = find_megatron_root()
        root = base / "installed"
        shutil.copytree(installed / "megatron", root / "megatron", ignore=_IGNORE)
        states = check_patch(root)
        if set(states.values()) <= {PRISTINE, PATCHED}:
            revert_patch(root)  # hash-checked against the manifest's pristine sha256
        if _all_pristine(root):
            return root
        tried.append(f"installed megatron-core at {installed}: {states}")
    except PatchError as e:
        tried.append(f"installed megatron-core: {e}")
    _megatron_unavailable("no pristine megatron-core 0.19.2 sources: " + " | ".join(tried))


def _tree_digest(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts:
            out[p.relative_to(root).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


class Layout:
    """A pristine megatron tree laid out as a Megatron-LM checkout or as site-packages."""

    def __init__(self, kind: str, base: Path, src: Path):
        self.kind = kind
        if kind == "checkout":
            self.root = base / "Megatron-LM"
            shutil.copytree(src / "megatron", self.root / "megatron", ignore=_IGNORE)
            (self.root / "pretrain_gpt.py").write_text("# placeholder\n")
            (self.root / "pyproject.toml").write_text("[project]\nname = 'megatron-core'\n")
        else:
            self.root = base / "lib" / "python3" / "site-packages"
            shutil.copytree(src / "megatron", self.root / "megatron", ignore=_IGNORE)
            info = self.root / f"megatron_core-{VERSION}.dist-info"
            info.mkdir()
            (info / "METADATA").write_text(f"Name: megatron-core\nVersion: {VERSION}\n")
        self.pristine = _tree_digest(self.root)

    def path(self, target: str) -> Path:
        return self.root / target

    def digest(self) -> dict[str, str]:
        return _tree_digest(self.root)

    def stray(self) -> list[str]:
        return [
            p.relative_to(self.root).as_posix()
            for p in self.root.rglob("*")
            if p.name.endswith((BACKUP_SUFFIX, ".gdn_cp.tmp"))
        ]


@pytest.fixture(params=["checkout", "site-packages"])
def layout(request, pristine_megatron, tmp_path) -> Layout:
    return Layout(request.param, tmp_path, pristine_megatron)


@pytest.fixture
def site(pristine_megatron, tmp_path) -> Layout:
    return Layout("site-packages", tmp_path, pristine_megatron)


# ----------------------------------------------------------------------------------------------
# the vendored patch (no megatron needed)
# ----------------------------------------------------------------------------------------------
def test_manifest_and_patch_files_are_consistent():
    m = load_manifest()
    assert m.megatron_core_version == VERSION
    assert [t.target for t in m.files] == list(TARGETS)
    d = patching.patch_dir()
    for t in m.files:
        text = (d / t.patch).read_text(encoding="utf-8")
        assert f"--- a/{t.target}\n" in text and f"+++ b/{t.target}\n" in text
        assert len(t.sha256_pristine) == 64 and len(t.sha256_patched) == 64
    # the patch stays thin: two config fields + the validation call, the forward hand-over, the
    # splitter's record of its THD split and the training arguments' hook (the logic is in gdn_cp)
    added = sum(
        1
        for t in m.files
        for line in (d / t.patch).read_text().splitlines()
        if line.startswith("+") and not line.startswith("+++")
    )
    assert added < 100, added


def test_find_megatron_root_rejects_other_folders(tmp_path):
    with pytest.raises(PatchError, match="no megatron/core inside"):
        find_megatron_root(tmp_path)
    with pytest.raises(PatchError, match="does not exist"):
        find_megatron_root(tmp_path / "nope")


def test_pyproject_lists_every_package():
    tomllib = pytest.importorskip("tomllib")
    from setuptools import find_namespace_packages

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        p
        for p in find_namespace_packages(where=str(REPO), include=["gdn_cp", "gdn_cp.*"])
        if "__pycache__" not in p.split(".")
    }
    missing = found - listed
    assert not missing, f"add these to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"
    assert "gdn_cp._patches" in listed


def test_patch_folder_ships_in_a_real_wheel_install(tmp_path):
    """`pip install --no-deps --target` (non-editable) carries patches/ as gdn_cp._patches."""
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(REPO / "pyproject.toml", src)
    readme = REPO / "README.md"
    (src / "README.md").write_text(readme.read_text() if readme.exists() else "gdn-cp\n")
    shutil.copytree(REPO / "gdn_cp", src / "gdn_cp", ignore=_IGNORE)
    shutil.copytree(REPO / "patches", src / "patches", ignore=_IGNORE)
    target = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(target), str(src)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    shipped = target / "gdn_cp" / "_patches" / patching.PATCH_NAME
    names = sorted(p.name for p in shipped.iterdir())
    assert names == sorted(["manifest.json"] + [t.patch for t in load_manifest().files])
    code = (
        "from gdn_cp.megatron import patching as p; d = p.patch_dir(); "
        "assert p.load_manifest().files; print(d)"
    )
    env = dict(os.environ, PYTHONPATH=str(target))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert str(shipped) in r.stdout


# ----------------------------------------------------------------------------------------------
# apply / check / revert on real sources
# ----------------------------------------------------------------------------------------------
@pytest.mark.megatron
def test_find_megatron_root_forms(layout):
    r = layout.root
    assert find_megatron_root(r) == r.resolve()
    assert find_megatron_root(r / "megatron") == r.resolve()
    assert find_megatron_root(r / "megatron" / "core") == r.resolve()
    assert find_megatron_root(str(r)) == r.resolve()


@pytest.mark.megatron
def test_find_megatron_root_default_is_importable_one_without_importing_it(site):
    code = (
        "import sys; from gdn_cp.megatron.patching import find_megatron_root; "
        "print(find_megatron_root()); "
        "assert 'megatron.core' not in sys.modules, 'imported megatron.core'"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site.root), str(REPO)]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=site.root)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(site.root.resolve())


@pytest.mark.megatron
def test_apply_check_revert_roundtrip(layout):
    m = load_manifest()
    assert check_patch(layout.root) == dict.fromkeys(TARGETS, PRISTINE)
    originals = {t.target: layout.path(t.target).read_bytes() for t in m.files}

    res = apply_patch(layout.root)
    assert res.action == "applied" and set(res.changed) == set(TARGETS)
    assert check_patch(layout.root) == dict.fromkeys(TARGETS, PATCHED)
    for t in m.files:
        assert hashlib.sha256(layout.path(t.target).read_bytes()).hexdigest() == t.sha256_patched
        backup = layout.path(t.target).with_name(layout.path(t.target).name + BACKUP_SUFFIX)
        assert backup.read_bytes() == originals[t.target]
    # everything else untouched
    after = layout.digest()
    changed = {k for k in set(after) | set(layout.pristine) if after.get(k) != layout.pristine.get(k)}
    assert changed == set(TARGETS) | {t + BACKUP_SUFFIX for t in TARGETS}
    assert not [s for s in layout.stray() if s.endswith(".gdn_cp.tmp")]

    res = revert_patch(layout.root)
    assert res.action == "reverted" and set(res.changed) == set(TARGETS)
    assert layout.digest() == layout.pristine  # byte-identical, backups gone
    assert layout.stray() == []

    assert apply_patch(layout.root).action == "applied"  # re-apply
    assert overall_state(check_patch(layout.root)) == PATCHED
    assert revert_patch(layout.root).action == "reverted"
    assert layout.digest() == layout.pristine


@pytest.mark.megatron
def test_apply_twice_is_a_noop(layout):
    apply_patch(layout.root)
    before = {t: (layout.path(t).stat().st_mtime_ns, layout.path(t).read_bytes()) for t in TARGETS}
    res = apply_patch(layout.root)
    assert res.action == "already_patched" and res.changed == ()
    assert "already patched" in res.message
    assert {t: (layout.path(t).stat().st_mtime_ns, layout.path(t).read_bytes()) for t in TARGETS} == before


@pytest.mark.megatron
def test_revert_of_pristine_is_a_noop(layout):
    res = revert_patch(layout.root)
    assert res.action == "already_pristine" and res.changed == ()
    assert layout.digest() == layout.pristine


@pytest.mark.megatron
def test_revert_without_or_with_a_bad_backup_uses_the_reverse_diff(layout):
    apply_patch(layout.root)
    layout.path(GDN + BACKUP_SUFFIX).unlink()
    layout.path(CFG + BACKUP_SUFFIX).write_bytes(b"not the original\n")
    assert revert_patch(layout.root).action == "reverted"
    assert layout.digest() == layout.pristine


@pytest.mark.megatron
def test_foreign_modification_is_detected_and_nothing_written(layout):
    gdn = layout.path(GDN)
    gdn.write_bytes(gdn.read_bytes() + b"# someone else's change\n")
    before = layout.digest()
    assert check_patch(layout.root) == {CFG: PRISTINE, GDN: MODIFIED, UTILS: PRISTINE, ARGS: PRISTINE}
    with pytest.raises(PatchError) as ei:
        apply_patch(layout.root)
    msg = str(ei.value)
    assert GDN in msg and "modified" in msg and "Nothing was changed" in msg
    assert layout.digest() == before and layout.stray() == []
    with pytest.raises(PatchError, match="cannot revert"):
        revert_patch(layout.root)
    assert layout.digest() == before


@pytest.mark.megatron
def test_modified_after_patching_blocks_revert(layout):
    apply_patch(layout.root)
    cfg = layout.path(CFG)
    patched = cfg.read_bytes()
    cfg.write_bytes(patched.replace(b'"auto"] = "headwise"', b'"auto"] = "chunkwise"'))  # a user's edit
    assert cfg.read_bytes() != patched
    before = layout.digest()
    assert check_patch(layout.root)[CFG] == MODIFIED
    with pytest.raises(PatchError, match=f"{CFG} is modified"):
        revert_patch(layout.root)
    with pytest.raises(PatchError):
        apply_patch(layout.root)
    assert layout.digest() == before


@pytest.mark.megatron
def test_partially_patched_is_refused_and_revert_recovers(layout):
    apply_patch(layout.root)
    layout.path(GDN).write_bytes(layout.path(GDN + BACKUP_SUFFIX).read_bytes())  # gdn.py back to pristine
    assert check_patch(layout.root) == {CFG: PATCHED, GDN: PRISTINE, UTILS: PATCHED, ARGS: PATCHED}
    assert overall_state(check_patch(layout.root)) == PARTIAL
    before = layout.digest()
    with pytest.raises(PatchError, match="partially patched.*gdn-cp patch revert"):
        apply_patch(layout.root)
    assert layout.digest() == before
    res = revert_patch(layout.root)
    assert res.action == "reverted" and res.changed == (CFG, UTILS, ARGS)
    assert layout.digest() == layout.pristine


@pytest.mark.megatron
def test_missing_target(layout):
    layout.path(GDN).unlink()
    assert check_patch(layout.root) == {CFG: PRISTINE, GDN: MISSING, UTILS: PRISTINE, ARGS: PRISTINE}
    before = layout.digest()
    with pytest.raises(PatchError, match=f"{GDN} is missing"):
        apply_patch(layout.root)
    assert layout.digest() == before


@pytest.mark.megatron
def test_wrong_version_is_named(layout):
    info = layout.path("megatron/core/package_info.py")
    info.write_text(info.read_text().replace("MINOR = 19\nPATCH = 2", "MINOR = 18\nPATCH = 0"))
    for t in TARGETS:  # another release's files differ
        layout.path(t).write_bytes(layout.path(t).read_bytes() + b"\n# 0.18.0\n")
    assert patching.megatron_version(layout.root) == "0.18.0"
    before = layout.digest()
    with pytest.raises(PatchError) as ei:
        apply_patch(layout.root)
    msg = str(ei.value)
    assert "megatron-core 0.18.0" in msg and f"pinned to megatron-core {VERSION}" in msg
    assert f"megatron-core=={VERSION}" in msg
    assert layout.digest() == before and layout.stray() == []


@pytest.mark.megatron
def test_unwritable_dir(layout, monkeypatch):
    gdn_dir = layout.path(GDN).parent
    before = layout.digest()
    if os.geteuid() == 0:
        # root ignores directory permissions: simulate the check's view of an unwritable dir
        real_access = os.access
        monkeypatch.setattr(
            patching.os, "access", lambda p, mode: False if Path(p) == gdn_dir else real_access(p, mode)
        )
    else:
        gdn_dir.chmod(0o555)
    try:
        with pytest.raises(PatchError) as ei:
            apply_patch(layout.root)
    finally:
        gdn_dir.chmod(0o755)
    assert "not writable" in str(ei.value) and str(gdn_dir) in str(ei.value)
    assert "Nothing was changed" in str(ei.value)
    assert layout.digest() == before and layout.stray() == []


@pytest.mark.megatron
def test_staging_failure_writes_nothing(layout, monkeypatch):
    real_write = patching._write_file

    def failing_write(path, data, mode):
        if path.name.startswith("gdn.py"):
            raise PermissionError(13, "Permission denied", str(path))
        real_write(path, data, mode)

    monkeypatch.setattr(patching, "_write_file", failing_write)
    with pytest.raises(PatchError, match="could not write.*Nothing was changed"):
        apply_patch(layout.root)
    assert layout.digest() == layout.pristine and layout.stray() == []


@pytest.mark.megatron
def test_rename_failure_rolls_back(layout, monkeypatch):
    real_replace = os.replace
    calls = []

    def failing_replace(src, dst):
        calls.append(Path(dst).name)
        if Path(dst).name == "gdn.py" and calls.count("gdn.py") == 1:
            raise OSError(30, "Read-only file system", str(dst))
        real_replace(src, dst)

    monkeypatch.setattr(patching.os, "replace", failing_replace)
    with pytest.raises(PatchError, match="originals were restored"):
        apply_patch(layout.root)
    assert calls[0] == "transformer_config.py"  # the first file had been replaced already
    assert layout.digest() == layout.pristine and layout.stray() == []


@pytest.mark.megatron
def test_gnu_patch_agrees(pristine_megatron, tmp_path):
    """The stored diffs are ordinary unified diffs: `patch -p1` gives the same files."""
    exe = shutil.which("patch")
    if exe is None:
        pytest.skip("GNU patch is not installed (the pure-python applier is tested above)")
    lay = Layout("checkout", tmp_path, pristine_megatron)
    for t in load_manifest().files:
        r = subprocess.run(
            [exe, "-p1", "--forward", "--silent", "-i", str(patching.patch_dir() / t.patch)],
            cwd=lay.root, capture_output=True, text=True,
        )  # fmt: skip
        assert r.returncode == 0, r.stdout + r.stderr
    assert check_patch(lay.root) == dict.fromkeys(TARGETS, PATCHED)


@pytest.mark.megatron
def test_cli(layout, capsys):
    p = str(layout.root)
    assert cli_main(["patch", "check", p]) == 0
    out = capsys.readouterr().out
    assert f"megatron-core {VERSION}" in out and "state: pristine" in out and GDN in out
    assert cli_main(["patch", "check", "--expect", "patched", p]) == 1
    assert "expected patched, found pristine" in capsys.readouterr().err

    assert cli_main(["patch", "apply", str(layout.root / "megatron")]) == 0
    assert "patched megatron-core" in capsys.readouterr().out
    assert cli_main(["patch", "apply", p]) == 0
    assert "already patched" in capsys.readouterr().out
    assert cli_main(["patch", "check", "--expect", "patched", p]) == 0
    capsys.readouterr()

    layout.path(GDN).write_bytes(layout.path(GDN).read_bytes() + b"#\n")
    assert cli_main(["patch", "check", p]) == 1
    cap = capsys.readouterr()
    assert "state: modified" in cap.out and "error:" in cap.err
    assert cli_main(["patch", "revert", p]) == 1
    assert "error: cannot revert" in capsys.readouterr().err

    layout.path(GDN).write_bytes(layout.path(GDN + BACKUP_SUFFIX).read_bytes())
    assert cli_main(["patch", "check", p]) == 1  # partial
    assert "gdn-cp patch revert" in capsys.readouterr().err
    assert cli_main(["patch", "revert", p]) == 0
    assert "restored the pristine" in capsys.readouterr().out
    assert layout.digest() == layout.pristine
    assert cli_main(["patch", "revert", p]) == 0
    assert "not patched; nothing to do" in capsys.readouterr().out
    for action in ("check", "apply", "revert"):  # nothing to look at: a bad argument (2), as in doctor --path
        assert cli_main(["patch", action, str(layout.root / "nowhere")]) == 2
        cap = capsys.readouterr()
        assert cap.out == "" and cap.err.startswith(f"gdn-cp patch {action}: error: ") and "does not exist" in cap.err
    assert cli_main(["patch", "apply", str(layout.root.parent)]) == 2  # exists, holds no megatron-core
    assert "neither a Megatron-LM checkout" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# the patched package imports and behaves
# ----------------------------------------------------------------------------------------------
_TABLE_SCRIPT = r"""
import json, sys, typing, warnings
warnings.filterwarnings("ignore")
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig
import megatron.core
assert megatron.core.__file__.startswith(sys.argv[1]), megatron.core.__file__
shapes = json.loads(sys.argv[2])
modes = json.loads(sys.argv[3])
field = TransformerConfig.__dataclass_fields__.get("linear_cp_mode")
out = [list(typing.get_args(field.type)) if field is not None else None]
try:  # megatron-core itself refuses sequence parallelism without TP > 1
    TransformerConfig(num_layers=4, hidden_size=96, num_attention_heads=24, sequence_parallel=True)
    out.append("sp-accepted")
except ValueError as e:
    out.append(str(e))
for k, v, tp, cp in shapes:
    for mode in modes:
        kw = dict(num_layers=4, hidden_size=96, num_attention_heads=24,
                  experimental_attention_variant="gated_delta_net", linear_attention_freq=4,
                  linear_num_key_heads=k, linear_num_value_heads=v, activation_func=F.silu,
                  tensor_model_parallel_size=tp, context_parallel_size=cp)
        if mode is not None:
            kw["linear_cp_mode"] = mode
        try:
            c = TransformerConfig(**kw)
            out.append([k, v, tp, cp, mode, "ok", getattr(c, "linear_cp_mode", None)])
        except Exception as e:
            out.append([k, v, tp, cp, mode, type(e).__name__, str(e)])
try:  # TransformerConfig's default activation_func (gelu), with GDN layers
    TransformerConfig(num_layers=4, hidden_size=96, num_attention_heads=24, experimental_attention_variant="gated_delta_net",
                      linear_attention_freq=4, linear_num_key_heads=16, linear_num_value_heads=32)
    gelu = "accepted"
except Exception as e:
    gelu = [type(e).__name__, str(e)]
print("GELU" + json.dumps(gelu))
print("RESULT" + json.dumps(out))
"""

_SHAPES = [
    (16, 32, 1, 1),
    (16, 32, 2, 2),
    (16, 32, 2, 8),  # TP*CP = 16 divides K=16 and V=32
    (16, 32, 4, 8),  # TP*CP = 32 does not divide K=16
    (2, 4, 1, 4),
    (2, 4, 2, 2),
    (3, 6, 1, 2),
    (3, 6, 3, 2),
    (4, 12, 2, 1),
    (6, 12, 4, 1),  # TP=4 does not divide K=6
]


def _run_table(root: Path, modes) -> list:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(REPO)]))
    r = subprocess.run(
        [sys.executable, "-c", _TABLE_SCRIPT, str(root), json.dumps(_SHAPES), json.dumps(modes)],
        capture_output=True, text=True, env=env, cwd=root, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")]
    literal, sp_error, *rows = json.loads(line[len("RESULT"):])
    assert sp_error == "Cannot use sequence parallelism without tensor parallelism", sp_error
    (gelu,) = [json.loads(ln[len("GELU"):]) for ln in r.stdout.splitlines() if ln.startswith("GELU")]
    return literal, rows, gelu


@pytest.mark.megatron
def test_patched_transformer_config_validation_table(site):
    from gdn_cp.megatron.config import resolve_linear_cp_mode
    from gdn_cp.modes.spec import MODE_CHOICES

    literal, stock, gelu = _run_table(site.root, [None])
    assert literal is None  # no linear_cp_mode field before patching
    assert gelu == "accepted"  # stock refuses a non-SiLU GDN activation only when the layer runs
    for k, v, tp, cp, _, outcome, detail in stock:  # stock 0.19.2: heads % (TP*CP), AssertionError
        ok = k % (tp * cp) == 0 and v % (tp * cp) == 0
        assert outcome == ("ok" if ok else "AssertionError"), (k, v, tp, cp, outcome, detail)

    apply_patch(site.root)
    modes = [None, "headwise", "chunkwise", "all_gather", "auto", "ring", "HEADWISE"]
    literal, rows, gelu = _run_table(site.root, modes)
    assert tuple(literal) == MODE_CHOICES  # the field's Literal[...] lists the registry's choices
    assert gelu[0] == "ValueError" and gelu[1].startswith("TransformerConfig.activation_func=gelu, but gated delta "
                                                          "net layers need SiLU"), gelu
    assert len(rows) == len(_SHAPES) * len(modes)
    for k, v, tp, cp, mode, outcome, detail in rows:
        case = (k, v, tp, cp, mode, outcome, detail)
        if mode in ("ring", "HEADWISE"):
            assert outcome == "ValueError", case
            assert "'headwise', 'chunkwise', 'all_gather', 'auto'" in detail, case
            continue
        if mode == "auto":  # resolved when the config is built, from the sizes alone
            try:
                want = resolve_linear_cp_mode("auto", num_key_heads=k, num_value_heads=v, tp=tp, cp=cp)
            except ValueError:
                assert outcome == "ValueError" and "no mode is legal" in detail and "Fix:" in detail, case
                continue
            assert outcome == "ok" and detail == want, case
            continue
        effective = mode or "headwise"  # the field's default
        div = tp * cp if effective == "headwise" else tp
        ok = k % div == 0 and v % div == 0
        if ok:
            assert outcome == "ok" and detail == effective, case
        else:
            assert outcome == "ValueError", case
            assert f"linear_cp_mode={effective!r}" in detail, case
            assert f"tensor_model_parallel_size={tp}" in detail and "Fix:" in detail, case
            bad_field = "linear_num_key_heads" if k % div else "linear_num_value_heads"
            assert f"{bad_field}=" in detail, case


_FORWARD_SCRIPT = r"""
import sys, types, warnings
warnings.filterwarnings("ignore")
import torch
import gdn_cp.megatron
from megatron.core.ssm.gated_delta_net import gdn as gdn_mod
from megatron.core.packed_seq_params import PackedSeqParams
assert gdn_mod.__file__.startswith(sys.argv[1]), gdn_mod.__file__
forward = gdn_mod.GatedDeltaNet.forward

calls = []
fake = types.ModuleType("gdn_cp.megatron.gdn")
fake.should_dispatch = lambda self, psp: calls.append(("should", self, psp)) or self.dispatch
def gated_delta_net_forward(self, hidden_states, attention_mask, **kw):
    calls.append(("forward", self, hidden_states, attention_mask, kw))
    return "OUT", "BIAS"
fake.gated_delta_net_forward = gated_delta_net_forward
sys.modules["gdn_cp.megatron.gdn"] = fake

class FakeGDN:  # the stock path needs far more than this: it fails on self.sp_size
    dispatch = True
me = FakeGDN()
hs, mask = torch.zeros(4, 1, 8), None
psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 4], dtype=torch.int32))

# 1. dispatch: everything is handed over, stock code does not run
out = forward(me, hs, mask, None, psp, 3, inference_params=None, extra_kw=7)
assert out == ("OUT", "BIAS"), out
assert calls[0] == ("should", me, psp)
_, s, h, m, kw = calls[1]
assert s is me and h is hs and m is mask
assert kw == dict(inference_context=None, packed_seq_params=psp, sequence_len_offset=3,
                  inference_params=None, extra_kw=7), kw

# 2. no dispatch: the stock code below the hook runs
me.dispatch = False
calls.clear()
try:
    forward(me, hs, mask)
    raise SystemExit("stock path did not run")
except AttributeError as e:
    assert "sp_size" in str(e), e
assert [c[0] for c in calls] == ["should"]

# 3. gdn_cp.megatron.gdn not importable: a clear ImportError
sys.modules["gdn_cp.megatron.gdn"] = None
try:
    forward(me, hs, mask)
    raise SystemExit("no ImportError")
except ImportError as e:
    assert "pip install -e <clone>" in str(e) and "gdn-cp patch revert" in str(e), e
print("FORWARD-OK")
"""


@pytest.mark.megatron
def test_patched_gdn_forward_hands_over(site):
    apply_patch(site.root)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site.root), str(REPO)]))
    r = subprocess.run(
        [sys.executable, "-c", _FORWARD_SCRIPT, str(site.root)],
        capture_output=True, text=True, env=env, cwd=site.root, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0 and "FORWARD-OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


# ----------------------------------------------------------------------------------------------
# a Megatron-LM git checkout: version strings differ from the release, files decide; git status
# ----------------------------------------------------------------------------------------------
_INFO = "megatron/core/package_info.py"


def _git(cwd: Path, *args: str) -> str:
    env = dict(os.environ, GIT_CONFIG_NOSYSTEM="1", HOME=str(cwd), GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t")  # fmt: skip
    r = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"git {args}: {r.stdout}{r.stderr}"
    return r.stdout


def _megatron_lm_repo(base: Path, src: Path, patch_level: int = 1) -> Path:
    """A git repository laid out like a Megatron-LM checkout whose ``package_info.py`` reports
    0.19.<patch_level> (tag core_v0.19.0 reports 0.19.1) while its target files are 0.19.2's."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    root = base / "Megatron-LM"
    for rel in (*TARGETS, _INFO):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / rel, root / rel)
    info = root / _INFO
    text = info.read_text()
    assert "PATCH = 2\n" in text
    info.write_text(text.replace("PATCH = 2\n", f"PATCH = {patch_level}\n"))
    (root / "pretrain_gpt.py").write_text("# placeholder\n")
    (root / ".gitignore").write_text("__pycache__/\n")
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "megatron-lm")
    return root


def _status(root: Path) -> list[str]:
    return sorted(_git(root, "status", "--porcelain", "--untracked-files=all").splitlines())


@pytest.mark.megatron
def test_megatron_lm_checkout_goes_by_files_and_keeps_git_status_clean(pristine_megatron, tmp_path, capsys):
    root = _megatron_lm_repo(tmp_path, pristine_megatron)
    exclude = root / ".git" / "info" / "exclude"
    exclude_before = exclude.read_text()
    assert _status(root) == []

    assert cli_main(["patch", "apply", str(root)]) == 0
    out = capsys.readouterr().out
    assert "megatron-core 0.19.1 according to megatron/core/package_info.py" in out, out
    assert f"its target files (by sha256) are the megatron-core {VERSION} release's with the gdn-cp patch" in out, out
    assert str(exclude) in out
    assert _status(root) == sorted(f" M {t}" for t in TARGETS)  # the backups are excluded, not listed
    assert (root / (GDN + BACKUP_SUFFIX)).is_file()
    assert ".gitignore" not in _git(root, "status", "--porcelain")  # the user's tracked ignore file untouched

    assert cli_main(["patch", "check", "--expect", "patched", str(root)]) == 0
    assert "0.19.1" in capsys.readouterr().out

    assert cli_main(["patch", "revert", str(root)]) == 0
    assert "0.19.1" in capsys.readouterr().out
    assert _status(root) == [] and exclude.read_text() == exclude_before
    assert not list(root.rglob("*" + BACKUP_SUFFIX))


@pytest.mark.megatron
def test_git_worktree_of_a_checkout_uses_the_common_exclude(pristine_megatron, tmp_path):
    main = _megatron_lm_repo(tmp_path, pristine_megatron)
    _git(main, "worktree", "add", "-q", str(tmp_path / "wt"))
    wt = tmp_path / "wt"
    assert (wt / ".git").is_file()
    assert patching.git_exclude_file(wt) == (main / ".git" / "info" / "exclude").resolve()
    apply_patch(wt)
    assert _status(wt) == sorted(f" M {t}" for t in TARGETS) and _status(main) == []
    revert_patch(wt)
    assert _status(wt) == [] and f"*{BACKUP_SUFFIX}" not in (main / ".git" / "info" / "exclude").read_text()


@pytest.mark.megatron
def test_checkout_messages_name_the_checkouts_own_version(pristine_megatron, tmp_path):
    root = _megatron_lm_repo(tmp_path, pristine_megatron)
    (root / GDN).write_text((root / GDN).read_text() + "# a local change\n")
    with pytest.raises(PatchError) as ei:
        apply_patch(root)
    msg = str(ei.value)
    assert "This tree reports megatron-core 0.19.1" in msg and f"the megatron-core {VERSION} release's, so these are local edits" in msg
    assert f"restore them: `git checkout -- {GDN}`" in msg and "Nothing was changed" in msg
    assert f"megatron-core {VERSION} according" not in msg
    assert "gdn-cp release" not in msg and "0.19.1 release" not in msg  # no release to point to but the pin
    assert _status(root) == [f" M {GDN}"]  # nothing written, not even the exclude lines

    info = root / _INFO  # another release: other version string, other files (none is the pin's)
    info.write_text(info.read_text().replace("MINOR = 19\n", "MINOR = 20\n").replace("PATCH = 1\n", "PATCH = 0\n"))
    for t in load_manifest().files:  # every target differs from the pin's
        (root / t.target).write_text((root / t.target).read_text() + "# another release\n")
    with pytest.raises(PatchError) as ei:
        apply_patch(root)
    msg = str(ei.value)
    assert "This tree reports megatron-core 0.20.0" in msg and f"supports megatron-core {VERSION} only" in msg
    assert "check out a commit whose files match" in msg and "local edits" not in msg and "gdn-cp release" not in msg


@pytest.mark.megatron
def test_detect_pin_and_describe_tree(layout):
    assert patching.detect_pin(layout.root).version == VERSION
    apply_patch(layout.root)
    assert patching.detect_pin(layout.root).version == VERSION
    layout.path(GDN).write_bytes(b"# another release\n")
    assert patching.detect_pin(layout.root) is None
    assert f"its target files (by sha256) are not the megatron-core {VERSION} release's, patched or not" in patching.describe_tree(
        layout.root)


@pytest.mark.megatron
def test_shipped_patch_folder_is_what_build_patch_files_makes(pristine_megatron, tmp_path):
    """The vendored diffs and manifest are regenerated, byte for byte, from pristine + patched trees."""
    patched = Layout("site-packages", tmp_path, pristine_megatron)
    apply_patch(patched.root)
    out = patching.build_patch_files(pristine_megatron, patched.root, list(TARGETS), out_dir=tmp_path / "rebuilt")
    shipped = patching.patch_dir()
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(p.name for p in Path(str(shipped)).iterdir() if p.is_file())
    for name in names:
        assert (out / name).read_bytes() == (shipped / name).read_bytes(), name


@pytest.mark.megatron
def test_site_packages_inside_a_git_work_tree_is_not_a_checkout(pristine_megatron, tmp_path):
    """A virtual environment inside a repository (CI's .venv in a clone): its site-packages is an
    installed megatron-core, not a checkout: no exclude lines in that repository, no `git checkout`
    advice for files git does not track."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    _git(tmp_path, "init", "-q")
    site = Layout("site-packages", tmp_path, pristine_megatron)
    exclude = tmp_path / ".git" / "info" / "exclude"
    before = exclude.read_text() if exclude.exists() else ""
    res = apply_patch(site.root)
    assert res.action == "applied" and (exclude.read_text() if exclude.exists() else "") == before
    revert_patch(site.root)
    site.path(GDN).write_bytes(site.path(GDN).read_bytes() + b"# a local change\n")
    with pytest.raises(PatchError) as ei:
        apply_patch(site.root)
    assert "git checkout" not in str(ei.value) and "reinstall" in str(ei.value), str(ei.value)
