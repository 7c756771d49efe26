"""`gdn-cp doctor`: the modes it lists come from the registry; bad input is an error, not a crash."""

from __future__ import annotations

from gdn_cp import cli
from gdn_cp.megatron.doctor import run_doctor
from gdn_cp.modes.spec import MODE_NAMES


def _run(**kw):
    lines = []
    code = run_doctor(echo=lines.append, **kw)
    return code, "\n".join(lines)


def test_doctor_lists_every_mode_and_what_auto_picks():
    code, out = _run(heads=[2, 4], tp=1, cp=4)
    assert code in (0, 1)  # 1 only when the installed megatron-core is in a foreign state
    for mode in MODE_NAMES:
        assert f"  {mode:<10} " in out, out
    assert "headwise   ILLEGAL  linear_num_key_heads=2 is not divisible by TP*CP=1*4=4" in out
    assert "auto       -> " in out
    assert "megatron-core pins" in out


def test_doctor_reports_a_missing_path_and_bad_heads(tmp_path):
    code, out = _run(path=tmp_path / "nowhere")
    assert "megatron-core patch: unavailable" in out and "does not exist" in out and code == 1
    code, out = _run(heads=[16])
    assert code == 2 and "--heads takes two numbers" in out


def test_cli_refuses_non_positive_sizes(capsys):
    try:
        cli.main(["doctor", "--heads", "16,32", "--cp", "0"])
    except SystemExit as e:
        assert e.code == 2
    assert "argument --cp: 0 must be >= 1" in capsys.readouterr().err
