"""A Megatron-LM git checkout: version strings differ from the release, files decide; git status stays
clean (the backups go to info/exclude), and an installed package inside a work tree is no checkout."""

from __future__ import annotations

import shutil

import pytest

from gdn_cp.cli import main as cli_main
from gdn_cp.patch import BACKUP_SUFFIX, PatchError, apply_patch, git_exclude_file, load_manifest, revert_patch

from .sources import GDN, INFO, TARGETS, VERSION, Layout, git, git_status, megatron_lm_repo


@pytest.mark.megatron
def test_megatron_lm_checkout_goes_by_files_and_keeps_git_status_clean(pristine_megatron, tmp_path, capsys):
    root = megatron_lm_repo(tmp_path, pristine_megatron)
    exclude = root / ".git" / "info" / "exclude"
    exclude_before = exclude.read_text()
    assert git_status(root) == []

    assert cli_main(["patch", "apply", str(root)]) == 0
    out = capsys.readouterr().out
    assert "megatron-core 0.19.1 according to megatron/core/package_info.py" in out, out
    assert f"its target files (by sha256) are the megatron-core {VERSION} release's with the gdn-cp patch" in out, out
    assert str(exclude) in out
    assert git_status(root) == sorted(f" M {t}" for t in TARGETS)  # the backups are excluded, not listed
    assert (root / (GDN + BACKUP_SUFFIX)).is_file()
    assert ".gitignore" not in git(root, "status", "--porcelain")  # the user's tracked ignore file untouched

    assert cli_main(["patch", "check", "--expect", "patched", str(root)]) == 0
    assert "0.19.1" in capsys.readouterr().out

    assert cli_main(["patch", "revert", str(root)]) == 0
    assert "0.19.1" in capsys.readouterr().out
    assert git_status(root) == [] and exclude.read_text() == exclude_before
    assert not list(root.rglob("*" + BACKUP_SUFFIX))


@pytest.mark.megatron
def test_git_worktree_of_a_checkout_uses_the_common_exclude(pristine_megatron, tmp_path):
    main = megatron_lm_repo(tmp_path, pristine_megatron)
    git(main, "worktree", "add", "-q", str(tmp_path / "wt"))
    wt = tmp_path / "wt"
    assert (wt / ".git").is_file()
    assert git_exclude_file(wt) == (main / ".git" / "info" / "exclude").resolve()
    apply_patch(wt)
    assert git_status(wt) == sorted(f" M {t}" for t in TARGETS) and git_status(main) == []
    revert_patch(wt)
    assert git_status(wt) == [] and f"*{BACKUP_SUFFIX}" not in (main / ".git" / "info" / "exclude").read_text()


@pytest.mark.megatron
def test_checkout_messages_name_the_checkouts_own_version(pristine_megatron, tmp_path):
    root = megatron_lm_repo(tmp_path, pristine_megatron)
    (root / GDN).write_text((root / GDN).read_text() + "# a local change\n")
    with pytest.raises(PatchError) as ei:
        apply_patch(root)
    msg = str(ei.value)
    assert "This tree reports megatron-core 0.19.1" in msg and f"the megatron-core {VERSION} release's, so these are local edits" in msg
    assert f"restore them: `git checkout -- {GDN}`" in msg and "Nothing was changed" in msg
    assert f"megatron-core {VERSION} according" not in msg
    assert "gdn-cp release" not in msg and "0.19.1 release" not in msg  # no release to point to but the pin
    assert git_status(root) == [f" M {GDN}"]  # nothing written, not even the exclude lines

    info = root / INFO  # another release: other version string, other files (none is the pin's)
    info.write_text(info.read_text().replace("MINOR = 19\n", "MINOR = 20\n").replace("PATCH = 1\n", "PATCH = 0\n"))
    for t in load_manifest().files:  # every target differs from the pin's
        (root / t.target).write_text((root / t.target).read_text() + "# another release\n")
    with pytest.raises(PatchError) as ei:
        apply_patch(root)
    msg = str(ei.value)
    assert "This tree reports megatron-core 0.20.0" in msg and f"supports megatron-core {VERSION} only" in msg
    assert "check out a commit whose files match" in msg and "local edits" not in msg and "gdn-cp release" not in msg



@pytest.mark.megatron
def test_a_checkout_without_git_gets_advice_that_applies_there(pristine_megatron, tmp_path):
    """Issue #32: a Megatron-LM checkout unpacked from an archive (no git) with an edited target file was
    told to reinstall megatron-core with pip, which never touches the checkout's own files (its scripts
    import them). The advice now is to copy the file from the release's sources; following it (the
    pristine sources stand for the unpacked sdist) lets the patch apply."""
    import re

    root = megatron_lm_repo(tmp_path, pristine_megatron)
    shutil.rmtree(root / ".git")
    (root / GDN).write_text((root / GDN).read_text() + "# a local change\n")
    with pytest.raises(PatchError) as ei:
        apply_patch(root)
    msg = str(ei.value)
    assert "git checkout" not in msg and "pip install" not in msg and "reinstall" not in msg, msg
    found = re.search(r"`python -m pip download --no-deps --no-binary megatron-core megatron-core==([\d.]+)`, "
                      r"unpack the megatron_core-\1\.tar\.gz it writes, and copy (\S+) from its folder into (\S+?)\. Nothing", msg)
    assert found and found.group(1) == VERSION and found.group(2) == GDN and found.group(3) == str(root), msg
    shutil.copy(pristine_megatron / GDN, root / GDN)  # what the advice says, from the release's sources
    assert apply_patch(root).action == "applied"

@pytest.mark.megatron
def test_site_packages_inside_a_git_work_tree_is_not_a_checkout(pristine_megatron, tmp_path):
    """A virtual environment inside a repository (CI's .venv in a clone): its site-packages is an
    installed megatron-core, not a checkout: no exclude lines in that repository, no `git checkout`
    advice for files git does not track."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    git(tmp_path, "init", "-q")
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


@pytest.mark.megatron
@pytest.mark.parametrize("tree", ["git checkout", "checkout without git", "site-packages"])
@pytest.mark.parametrize("damage", ["modified", "missing"])
def test_check_gives_the_fix_apply_gives_for_the_same_tree(pristine_megatron, tmp_path, capsys, tree, damage):
    """Issue #49: on a Megatron-LM checkout (git or not) with an edited or missing target file, `patch check`
    advised `pip install --force-reinstall ... megatron-core==...`, which never touches a checkout's files,
    while `patch apply` on the same tree said how to restore them there. Both now give the same fix."""
    if tree == "site-packages":
        root = Layout("site-packages", tmp_path, pristine_megatron).root
    else:
        root = megatron_lm_repo(tmp_path, pristine_megatron)
        if tree == "checkout without git":
            shutil.rmtree(root / ".git")
    target = root / GDN
    if damage == "modified":
        target.write_text(target.read_text() + "# a local change\n")
    else:
        target.unlink()
    with pytest.raises(PatchError) as ei:
        apply_patch(root)
    apply_fix = str(ei.value).split(" Fix: ")[1].removesuffix(" Nothing was changed.").removesuffix(".")
    assert cli_main(["patch", "check", str(root)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"; {apply_fix}, then `gdn-cp patch apply {root}`" in err, (err, apply_fix)
    expected = {"git checkout": f"`git checkout -- {GDN}` in {root}", "checkout without git": "pip download",
                "site-packages": "--force-reinstall"}[tree]
    assert expected in err, err
    if tree != "site-packages":
        assert "reinstall" not in err and "pip install" not in err, err
    assert cli_main(["patch", "check", "--expect", "patched", str(root)]) == 1  # --expect says the same fix
    assert f"; {apply_fix}" in capsys.readouterr().err
