"""`gdn-cp patch apply|check|revert`: exit codes and messages on real sources."""

from __future__ import annotations

import pytest

from gdn_cp.cli import main as cli_main
from gdn_cp.patch import BACKUP_SUFFIX

from .sources import GDN, VERSION


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
        with pytest.raises(SystemExit) as exit_:
            cli_main(["patch", action, str(layout.root / "nowhere")])
        cap = capsys.readouterr()
        assert exit_.value.code == 2 and cap.out == "" and cap.err.startswith(f"gdn-cp patch {action}: error: ")
        assert "nowhere does not exist; pass a Megatron-LM checkout" in cap.err, cap.err  # issue #41: and the fix
    assert cli_main(["patch", "apply", str(layout.root.parent)]) == 2  # exists, holds no megatron-core
    assert "neither a Megatron-LM checkout" in capsys.readouterr().err


def _printed_diffs(out: str) -> dict[str, str]:
    """The unified diffs a dry run printed, by target file."""
    import re

    parts = re.split(r"(?m)^(?=--- a/)", out)[1:]
    return {part.split("\n", 1)[0][len("--- a/"):]: part for part in parts}


def _diffs(before: dict[str, str], root) -> dict[str, str]:
    import difflib

    out = {}
    for target, text in before.items():
        after = (root / target).read_text()
        if after != text:
            out[target] = "".join(difflib.unified_diff(text.splitlines(True), after.splitlines(True), f"a/{target}",
                                                       f"b/{target}"))
    return out


@pytest.mark.megatron
def test_dry_run_prints_what_the_action_then_changes_and_writes_nothing(layout, capsys):
    """Issue #41: `patch` could not show what it would change. `apply --dry-run` / `revert --dry-run` print,
    per file, the diff that the action then writes, and write nothing (no file, no backup); where the
    action would refuse, the dry run refuses with its message, naming the tree (not the copy it ran on)."""
    from gdn_cp.patch import load_manifest

    p = str(layout.root)
    targets = [t.target for t in load_manifest().files]
    texts = {t: layout.path(t).read_text() for t in targets}
    assert cli_main(["patch", "apply", "--dry-run", p]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"gdn-cp patch apply --dry-run: would patch {len(targets)} files of megatron-core at "
                          f"{layout.root} (nothing was written"), out
    assert layout.digest() == layout.pristine and layout.stray() == []
    assert cli_main(["patch", "apply", p]) == 0
    capsys.readouterr()
    assert _printed_diffs(out) == _diffs(texts, layout.root) and len(_printed_diffs(out)) == len(targets)

    patched = {t: layout.path(t).read_text() for t in targets}
    digest = layout.digest()
    assert cli_main(["patch", "revert", "--dry-run", p]) == 0
    out = capsys.readouterr().out
    assert "would restore" in out and layout.digest() == digest
    assert cli_main(["patch", "apply", "--dry-run", p]) == 0
    assert "already patched" in capsys.readouterr().out and layout.digest() == digest
    assert cli_main(["patch", "revert", p]) == 0
    capsys.readouterr()
    assert _printed_diffs(out) == _diffs(patched, layout.root)

    layout.path(GDN).write_bytes(layout.path(GDN).read_bytes() + b"#\n")  # a local edit: apply refuses
    assert cli_main(["patch", "apply", p]) == 1
    real = capsys.readouterr().err
    assert cli_main(["patch", "apply", "--dry-run", p]) == 1
    dry = capsys.readouterr().err
    assert dry == real and "cannot apply" in dry and str(layout.root) in dry, (dry, real)
