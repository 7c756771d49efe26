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
        assert cli_main(["patch", action, str(layout.root / "nowhere")]) == 2
        cap = capsys.readouterr()
        assert cap.out == "" and cap.err.startswith(f"gdn-cp patch {action}: error: ") and "does not exist" in cap.err
    assert cli_main(["patch", "apply", str(layout.root.parent)]) == 2  # exists, holds no megatron-core
    assert "neither a Megatron-LM checkout" in capsys.readouterr().err
