"""apply / check / revert on real sources: all files or none, byte-identical round trips, and every
refusal leaves the tree as it was."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from gdn_cp.patch import (
    BACKUP_SUFFIX,
    MISSING,
    MODIFIED,
    PARTIAL,
    PATCHED,
    PRISTINE,
    PatchError,
    apply_patch,
    atomic,
    check_patch,
    load_manifest,
    megatron_version,
    overall_state,
    revert_patch,
)

from .sources import CFG, GDN, TARGETS, VERSION


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
    assert check_patch(layout.root) == {**dict.fromkeys(TARGETS, PRISTINE), GDN: MODIFIED}
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
    cfg.write_bytes(patched.replace(b'linear_cp_mode: str = "auto"', b'linear_cp_mode: str = "chunkwise"'))  # a user's edit
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
    assert check_patch(layout.root) == {**dict.fromkeys(TARGETS, PATCHED), GDN: PRISTINE}
    assert overall_state(check_patch(layout.root)) == PARTIAL
    before = layout.digest()
    with pytest.raises(PatchError, match="partially patched.*gdn-cp patch revert"):
        apply_patch(layout.root)
    assert layout.digest() == before
    res = revert_patch(layout.root)
    assert res.action == "reverted" and res.changed == tuple(t for t in TARGETS if t != GDN)
    assert layout.digest() == layout.pristine


@pytest.mark.megatron
def test_missing_target(layout):
    layout.path(GDN).unlink()
    assert check_patch(layout.root) == {**dict.fromkeys(TARGETS, PRISTINE), GDN: MISSING}
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
    assert megatron_version(layout.root) == "0.18.0"
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
            atomic.os, "access", lambda p, mode: False if Path(p) == gdn_dir else real_access(p, mode)
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
    real_write = atomic._write_file

    def failing_write(path, data, mode):
        if path.name.startswith("gdn.py"):
            raise PermissionError(13, "Permission denied", str(path))
        real_write(path, data, mode)

    monkeypatch.setattr(atomic, "_write_file", failing_write)
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

    monkeypatch.setattr(atomic.os, "replace", failing_replace)
    with pytest.raises(PatchError, match="originals were restored"):
        apply_patch(layout.root)
    assert calls[0] == "transformer_config.py"  # the first file had been replaced already
    assert layout.digest() == layout.pristine and layout.stray() == []


@pytest.mark.megatron
def test_a_tree_another_gdn_cp_version_patched_is_reverted_from_its_backups(layout, capsys):
    """Upgrading gdn-cp: the files carry another version's patch (not this one's), with the release's
    originals backed up beside them. apply refuses and names revert; revert restores the originals."""
    apply_patch(layout.root)
    for t in (CFG, GDN):  # what another version's patch would look like: patched, then changed
        layout.path(t).write_bytes(layout.path(t).read_bytes() + b"# another gdn-cp version\n")
    assert check_patch(layout.root)[CFG] == MODIFIED
    before = layout.digest()
    with pytest.raises(PatchError, match=r"another gdn-cp version's patch.*gdn-cp patch revert --from-backups"):
        apply_patch(layout.root)
    with pytest.raises(PatchError, match="--from-backups"):  # edits are never thrown away unasked
        revert_patch(layout.root)
    assert layout.digest() == before
    from gdn_cp.cli import main as cli_main

    assert cli_main(["patch", "check", str(layout.root)]) == 1
    assert "gdn-cp patch revert --from-backups" in capsys.readouterr().err  # the command that fixes it
    res = revert_patch(layout.root, from_backups=True)
    assert res.action == "reverted" and set(res.changed) == set(TARGETS)
    assert layout.digest() == layout.pristine
    assert apply_patch(layout.root).action == "applied"
