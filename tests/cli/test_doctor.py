"""`gdn-cp doctor`: the modes it lists come from the registry; bad input is an error, not a crash."""

from __future__ import annotations

from gdn_cp import cli
from gdn_cp.cli.doctor import run_doctor
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


def test_doctor_refuses_bad_arguments_before_printing(tmp_path, capsys):
    """A --path without megatron-core, heads that do not group, --tp / --cp without --heads: exit 2,
    one line naming the flag, nothing on stdout (the rule of every command)."""
    (tmp_path / "empty").mkdir()
    cases = [
        (["--path", str(tmp_path / "empty")], "--path"),
        (["--heads", "4,6"], "--heads 4,6"),
        (["--tp", "2", "--cp", "4"], "--tp 2 --cp 4: the TP / CP sizes only choose the linear_cp_mode table"),
        (["--cp", "4"], "add --heads K,V"),
    ]
    for argv, expected in cases:
        assert cli.main(["doctor", *argv]) == 2, argv
        cap = capsys.readouterr()
        assert cap.out == "" and cap.err.startswith("gdn-cp doctor: error: ") and expected in cap.err, (argv, cap)
        assert len(cap.err.strip().splitlines()) == 1


def test_doctor_names_the_modified_files_not_the_patch(monkeypatch):
    from gdn_cp import patch

    monkeypatch.setattr(patch, "check_patch", lambda root=None, pin=None: {"a.py": "modified", "b.py": "pristine"})
    code, out = _run()
    assert code == 1
    assert "its target files (by sha256) are not the megatron-core 0.19.2 release's, patched or not" in out
    assert "patch is modified" not in out


def test_doctor_runs_without_torch():
    """No torch: the report says so instead of a ModuleNotFoundError traceback."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None\n"
            "from gdn_cp.cli import main\n"
            "sys.exit(main(['doctor', '--heads', '16,32', '--tp', '2']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode in (0, 1), r.stdout + r.stderr  # 1 only when the installed megatron-core is foreign
    assert "Traceback" not in r.stderr, r.stderr
    assert "GPUs: unknown: torch does not import" in r.stdout and "chunkwise  legal" in r.stdout, r.stdout


def test_cli_refuses_non_positive_sizes(capsys):
    try:
        cli.main(["doctor", "--heads", "16,32", "--cp", "0"])
    except SystemExit as e:
        assert e.code == 2
    err = capsys.readouterr().err
    assert "argument --cp: 0 must be >= 1;" in err and "largest" not in err  # issue #32: no "largest CP group" for 0


def test_doctor_says_whether_transformer_engine_is_there(monkeypatch):
    """TransformerEngine's version from package metadata, never imported ("not installed" without)."""
    import importlib.metadata
    import sys

    real = importlib.metadata.version
    installed = {}

    def version(dist):
        if dist in installed:
            return installed[dist]
        if dist.startswith("transformer-engine"):
            raise importlib.metadata.PackageNotFoundError(dist)
        return real(dist)

    monkeypatch.setattr(importlib.metadata, "version", version)  # what every version lookup reads
    assert "  transformer-engine       not installed" in _run()[1]
    installed["transformer-engine-cu13"] = "2.20.2"
    assert "  transformer-engine       2.20.2 (transformer-engine-cu13)" in _run()[1]
    installed["transformer-engine"] = "2.20.2"
    assert "  transformer-engine       2.20.2\n" in _run()[1]
    assert "transformer_engine" not in sys.modules


def test_the_extras_install_exactly_the_tested_fla_stacks():
    """Issue #25: `pip install -e '.[fla]'` resolved whatever FLA was newest (and transformers with it).
    Each extra pins the fla-core of one tested stack; the README's "Tested versions" names the pair."""
    import re
    import tomllib
    from pathlib import Path

    from gdn_cp.ops.fla.spec import TESTED_FLA_STACKS

    root = Path(__file__).resolve().parents[2]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, (fla, triton) in TESTED_FLA_STACKS.items():
        assert extras[extra] == [f"fla-core=={fla}"], (extra, extras[extra])
        rows = [line for line in (root / "README.md").read_text().splitlines()
                if line.startswith("| 1x H200 |") and f"Triton {triton}" in line and re.search(rf"\b{re.escape(fla)}\b", line)]
        assert rows, f"README 'Tested versions' has no row with FLA {fla} and Triton {triton}"



def test_each_tested_stack_installs_from_one_line_that_keeps_a_users_torch_unless_asked():
    """Issue #32: `pip install -e '.[megatron,fla]'` in a fresh environment resolved torch 2.14.1 and
    Triton 3.8.0, an untested stack. Each tested stack is one extra plus constraints/<extra>.txt, which
    pins that stack's Triton and a torch; no extra (nor gdn-cp's own dependencies) pins torch or Triton,
    so without the constraints file pip keeps an installed torch. The README and docs/megatron.md give
    the line. (The resolution itself was checked with pip against the package index: see the files.)"""
    import re
    import tomllib
    from pathlib import Path

    from gdn_cp.ops.fla.spec import TESTED_FLA_STACKS

    root = Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    every = list(project["dependencies"]) + [d for ds in project["optional-dependencies"].values() for d in ds]
    for dep in every:
        name = re.match(r"[A-Za-z0-9_.-]+", dep).group(0).lower()
        assert name not in ("triton",) and not (name == "torch" and re.search(r"==|<|~=", dep)), dep
    readme = " ".join((root / "README.md").read_text().split())
    docs = " ".join((root / "docs" / "megatron.md").read_text().split())
    assert sorted(p.stem for p in (root / "constraints").glob("*.txt")) == sorted(TESTED_FLA_STACKS)
    for extra, (fla, triton) in TESTED_FLA_STACKS.items():
        lines = [ln.split("#")[0].strip() for ln in (root / "constraints" / f"{extra}.txt").read_text().splitlines()]
        pins = dict(ln.split("==") for ln in lines if ln)
        assert set(pins) == {"torch", "triton"} and pins["triton"] == triton, (extra, pins)
        line = rf"'?\.\[megatron,{extra}\]'? -c constraints/{extra}\.txt"
        assert re.search(line, docs) and re.search(line, readme), extra
        row = f"| `.[megatron,{extra}]` `-c constraints/{extra}.txt` | {fla} | {triton} | {pins['torch']} |"
        assert row in docs, row
        assert f"Triton {triton}, torch {pins['torch']}" in readme, (extra, pins)

def test_doctor_says_whether_the_installed_fla_stack_was_tested(monkeypatch):
    from gdn_cp.ops.fla import spec

    assert spec.fla_stack_verdict("0.6.0", "3.7.1") == "fla 0.6.0 + triton 3.7.1: a tested stack"
    assert spec.fla_stack_verdict("0.4.2", "3.6.0").endswith("a tested stack")
    untested = spec.fla_stack_verdict("0.6.0", "3.9.0")
    assert untested.startswith("fla 0.6.0 + triton 3.9.0: untested (tested: fla 0.6.0 + triton 3.7.1 ([fla]), "
                               "fla 0.4.2 + triton 3.6.0 ([fla042]))") and "#640" not in untested, untested
    assert "refuses or miscomputes the GDN backward on Hopper" in spec.fla_stack_verdict("0.5.2", "3.6.0")
    assert spec.fla_stack_verdict(None, "3.9.0").startswith("not installed")
    versions = {"fla-core": "0.6.0", "triton": "3.5.0"}
    monkeypatch.setattr(spec, "dist_version", lambda *names: next((versions[n] for n in names if n in versions), None))
    code, out = _run()
    assert "FLA + Triton: fla 0.6.0 + triton 3.5.0: untested" in out, out



def test_doctor_says_when_this_python_cannot_take_megatron_core():
    """Issue #32: on Python 3.11 `pip install -e '.[megatron,fla]'` fails with pages of version listings;
    the doctor (which installs there) says in its python line what that means and what to do."""
    from gdn_cp.cli.doctor import python_verdict

    assert python_verdict((3, 12, 3)) == "3.12.3"
    line = python_verdict((3, 11, 7))
    assert line.startswith("3.11.7 (megatron-core 0.19.2 declares Python >= 3.12: pip refuses it here") and "3.12" in line
    import importlib.metadata

    try:
        declared = importlib.metadata.metadata("megatron-core")["Requires-Python"]
    except importlib.metadata.PackageNotFoundError:
        return
    assert declared.replace(" ", "") == ">=3.12", declared  # the floor the doctor and the README state


def test_flashqla_extra_pins_the_stack_the_doctor_names():
    """The [flashqla] extra pins flash-qla and TileLang at the versions doctor calls the pinned stack
    (with TileLang's own dependencies at the versions that ran beside them); doctor reads the installed
    ones from package metadata and says whether they are that stack."""
    import tomllib
    from pathlib import Path

    from gdn_cp.ops.flashqla import spec

    root = Path(__file__).resolve().parents[2]
    extra = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]["flashqla"]
    flash_qla, tilelang = spec.TESTED_FLASHQLA_STACK
    assert extra[:2] == [f"flash-qla=={flash_qla}", f"tilelang=={tilelang}"] and all("==" in p for p in extra), extra
    assert spec.flashqla_verdict(flash_qla, tilelang).endswith("the [flashqla] stack")
    assert "not the pinned stack" in spec.flashqla_verdict("0.1.2", "0.1.9")
    assert spec.flashqla_verdict("not installed", "not installed").startswith("not installed")
