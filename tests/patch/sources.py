"""Pristine megatron-core 0.19.2 sources for the patch tool's tests, and the trees built from them.

Sources: the megatron-core 0.19.2 sdist (``$GDN_CP_MEGATRON_SDIST`` if set, else ``pip download``),
else the installed megatron-core (reverted in a copy when it is patched; the manifest's pristine
hashes are the oracle either way). Tests needing them are marked ``megatron``; when no source can
be had they FAIL with the reason, unless ``GDN_CP_ALLOW_SKIP_MEGATRON=1`` is set.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from gdn_cp.patch import (
    BACKUP_SUFFIX,
    PATCHED,
    PINNED_VERSION,
    PRISTINE,
    PatchError,
    check_patch,
    find_megatron_root,
    load_manifest,
    revert_patch,
)

REPO = Path(__file__).resolve().parents[2]
VERSION = PINNED_VERSION
GDN = "megatron/core/ssm/gated_delta_net/gdn.py"
CFG = "megatron/core/transformer/transformer_config.py"
UTILS = "megatron/core/utils.py"  # get_batch_on_this_cp_rank records its THD split
ARGS = "megatron/training/arguments.py"  # validate_args sets --linear-cp-thd-split from the data flags
COMMON = "megatron/core/ssm/gated_delta_net/common.py"  # GDN conv1d drawn from the model-parallel RNG stream
TARGETS = (CFG, GDN, COMMON, UTILS, ARGS)
INFO = "megatron/core/package_info.py"
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*" + BACKUP_SUFFIX, "*.gdn_cp.tmp")


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


def start_download(base: Path) -> subprocess.Popen:
    """``pip download`` of the megatron-core sdist into ``base/download`` (~4 s: pip prepares its metadata in a build
    environment), started now: the session starts it when it collects a test that needs the sources."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-binary", "megatron-core", "--no-deps",
        "--ignore-requires-python", f"megatron-core=={VERSION}", "-d", str(base / "download"),
    ]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)


def pristine_sources(base: Path, download: subprocess.Popen | None = None) -> Path:
    """A folder under ``base`` holding a pristine megatron-core 0.19.2 ``megatron/`` package (``download``: a
    :func:`start_download` into ``base`` already running)."""
    tried = []
    sdist = os.environ.get("GDN_CP_MEGATRON_SDIST")
    if sdist:
        root = _extract(Path(sdist), base / "given")
        if _all_pristine(root):
            return root
        tried.append(f"GDN_CP_MEGATRON_SDIST={sdist}: not pristine 0.19.2 ({check_patch(root)})")

    try:
        r = download or start_download(base)
        stderr = r.communicate(timeout=600)[1]
        tars = sorted((base / "download").glob("megatron_core-*.tar.gz"))
        if r.returncode == 0 and tars:
            root = _extract(tars[0], base / "sdist")
            if _all_pristine(root):
                return root
            tried.append(f"pip download: sdist not pristine ({check_patch(root)})")
        else:
            tried.append(f"pip download failed (rc={r.returncode}): {stderr.strip()[-500:]}")
    except (OSError, subprocess.TimeoutExpired) as e:
        tried.append(f"pip download failed: {e!r}")

    try:
        installed = find_megatron_root()
        root = base / "installed"
        shutil.copytree(installed / "megatron", root / "megatron", ignore=IGNORE)
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


def _copy_tree(src: Path, dst: Path) -> None:
    """``src`` (a ``megatron/`` package) copied to ``dst``: the files a test or the patch tool writes (the
    patch's targets, the version file) as copies, every other file as a hard link to the session's pristine
    source (a third of a second less per tree, ~60 trees a session). The patch tool replaces a file by
    renaming a new one over it, never writing into it; were it to write into a linked file, the tree's digest
    would show the change (and the shared source would too, failing the tests after it loudly)."""
    manifest = load_manifest()
    written = {f.target for f in manifest.files} | {manifest.version_file}

    def copy(s: str, d: str) -> None:
        rel = Path(d).relative_to(dst.parent).as_posix()
        if rel in written:
            shutil.copy2(s, d)
            return
        try:
            os.link(s, d)
        except OSError:  # another file system
            shutil.copy2(s, d)

    shutil.copytree(src, dst, ignore=IGNORE, copy_function=copy)


class Layout:
    """A pristine megatron tree laid out as a Megatron-LM checkout or as site-packages."""

    def __init__(self, kind: str, base: Path, src: Path):
        self.kind = kind
        if kind == "checkout":
            self.root = base / "Megatron-LM"
            _copy_tree(src / "megatron", self.root / "megatron")
            (self.root / "pretrain_gpt.py").write_text("# placeholder\n")
            (self.root / "pyproject.toml").write_text("[project]\nname = 'megatron-core'\n")
        else:
            self.root = base / "lib" / "python3" / "site-packages"
            _copy_tree(src / "megatron", self.root / "megatron")
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


def git(cwd: Path, *args: str) -> str:
    env = dict(os.environ, GIT_CONFIG_NOSYSTEM="1", HOME=str(cwd), GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t")  # fmt: skip
    r = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"git {args}: {r.stdout}{r.stderr}"
    return r.stdout


def megatron_lm_repo(base: Path, src: Path, patch_level: int = 1) -> Path:
    """A git repository laid out like a Megatron-LM checkout whose ``package_info.py`` reports
    0.19.<patch_level> (tag core_v0.19.0 reports 0.19.1) while its target files are 0.19.2's."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    root = base / "Megatron-LM"
    for rel in (*TARGETS, INFO):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / rel, root / rel)
    info = root / INFO
    text = info.read_text()
    assert "PATCH = 2\n" in text
    info.write_text(text.replace("PATCH = 2\n", f"PATCH = {patch_level}\n"))
    (root / "pretrain_gpt.py").write_text("# placeholder\n")
    (root / ".gitignore").write_text("__pycache__/\n")
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "megatron-lm")
    return root


def git_status(root: Path) -> list[str]:
    return sorted(git(root, "status", "--porcelain", "--untracked-files=all").splitlines())
