"""tests/constraints.txt pins every package the test install (tests/install_deps.sh) pulls (issue #49: an
unpinned `triton` brought 3.9.0, which nothing had tested): each line one `name==version`; the packages the
script names, gdn-cp's own dependencies and test extras, and everything those require here, are all in it."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PINS = ROOT / "tests" / "constraints.txt"


def pins() -> dict[str, str]:
    found = {}
    for line in PINS.read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)==([0-9][A-Za-z0-9.+]*)", line)
        assert m, f"tests/constraints.txt: {line!r} is not name==version"
        name = canonicalize_name(m.group(1))
        assert name not in found, f"{name} pinned twice"
        found[name] = m.group(2)
    return found


def _roots() -> set[str]:
    """What the script asks pip for by name, and gdn-cp's own requirements (its dependencies, [test])."""
    script = (ROOT / "tests" / "install_deps.sh").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    named = {"torch", "triton", "megatron-core", "packaging", "numpy"}
    for name in named:
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", script), f"tests/install_deps.sh no longer installs {name}"
    reqs = project["dependencies"] + project["optional-dependencies"]["test"]
    return named | {canonicalize_name(Requirement(r).name) for r in reqs}


def test_every_package_the_test_install_names_is_pinned():
    missing = sorted(_roots() - set(pins()))
    assert not missing, f"tests/constraints.txt lacks {missing}"
    assert pins()["triton"] == "3.7.1"  # the Triton torch 2.13.0's Linux wheels require: either build, one Triton


def test_what_each_pinned_package_requires_here_is_pinned_too():
    """The closure over the installed packages' own requirements (markers evaluated here, no extras). The
    CUDA packages of torch's CUDA build (nvidia-*, cuda-*) are torch's to pin (tests/constraints.txt says so)."""
    pinned = pins()
    env = {**default_environment(), "extra": ""}
    unpinned = set()
    for name in pinned:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here (e.g. a GPU image's own torch stack): nothing to follow
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            dep = canonicalize_name(req.name)
            if dep not in pinned and not dep.startswith(("nvidia-", "cuda-")):
                unpinned.add(f"{dep} (required by {name})")
    assert not unpinned, f"tests/constraints.txt lacks {sorted(unpinned)}"


def test_every_pip_call_of_the_script_installs_under_the_pins():
    script = (ROOT / "tests" / "install_deps.sh").read_text()
    assert 'PINS=tests/constraints.txt' in script
    calls = re.findall(r'"\$PY" -m pip install ([^\n]*)', script)
    assert len(calls) >= 3, calls
    for call in calls:  # the CPU index's torch alone (--no-deps) is the one call the pins do not need
        assert '-c "$PINS"' in call or call.startswith('-q --no-deps "torch==$TORCH" --index-url'), call
