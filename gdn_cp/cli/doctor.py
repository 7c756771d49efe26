"""`gdn-cp doctor`: what is installed, whether Megatron-Core is patched, and which mode fits.

Reads versions from package metadata without importing megatron.core (its import is slow and
noisy), TransformerEngine, FlashQLA / TileLang or torch (the doctor must also run, and say so, where torch is missing);
on a GPU machine each backend's stack lines say what it uses of its stack (FLA's: which gated norm a layer
takes). The backends' packages, verdicts and stack lines come from the registry (each ``BackendSpec``), so
the doctor names no backend. Finds the patch
state and the release the files match (by sha256) through the patch tool (:mod:`gdn_cp.patch`), and
for a head shape lists the ``linear_cp_mode`` values of the registry (:mod:`gdn_cp.modes.spec`),
whether each is legal and what ``auto`` picks, with reasons.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Callable, Optional

from .. import __version__, env, patch
from ..megatron.config import AUTO, explain_linear_cp_modes
from ..pins import PINS, get_pin
from ..ops.installed import dist_version
from ..ops.registry import BACKENDS

__all__ = ["check_doctor_args", "collect_report", "environment_report", "problems", "run_doctor"]

def python_verdict(version: tuple) -> str:
    """This Python's version, and on one older than the pinned megatron-core's floor, what that means."""
    text = ".".join(map(str, version))
    pin = get_pin()
    if tuple(version[:2]) >= pin.python_floor:
        return text
    floor = ".".join(map(str, pin.python_floor))
    return (f"{text} (megatron-core {pin.version} declares Python >= {floor}: pip refuses it here; use a {floor} "
            f"environment, or install its sources as docs/megatron.md says for 3.11)")


def _version(dist: str) -> str:
    return dist_version(dist) or "not installed"


# TransformerEngine's distributions: the meta package, its CUDA builds, its torch extension
_TE_DISTS = ("transformer-engine", "transformer-engine-cu13", "transformer-engine-cu12", "transformer-engine-torch")


def _te_version() -> str:
    """TransformerEngine's version from package metadata (never imported: on a CPU machine its
    import is slow or fails), naming the distribution when it is not the meta package."""
    for dist in _TE_DISTS:
        version = _version(dist)
        if version != "not installed":
            return version if dist == _TE_DISTS[0] else f"{version} ({dist})"
    return "not installed"


def _gpus() -> tuple[list[str], Optional[str]]:
    """(GPU names, why they are unknown or None)."""
    try:
        import torch
    except ImportError as err:
        return [], f"unknown: torch does not import ({err}); install torch (pip install torch)"
    if not torch.cuda.is_available():
        return [], None
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())], None


_READERS = {
    "gdn_cp": "gdn-cp's setting",
    "tests": "the tests' (a clone's test suite reads it; gdn-cp does not)",
    "benchmarks": "the benchmarks' (a clone's benchmarks/gpu_suite.sh reads it; gdn-cp does not)",
}


def environment_report(environ=None) -> list[dict]:
    """Every ``GDN_CP_*`` variable set: its value and who reads it (:func:`gdn_cp.env.who_reads`), with a
    note saying what that means (a name nothing reads: unset it)."""
    environ = os.environ if environ is None else environ
    rows = []
    for name in env.set_names(environ):
        reader = env.who_reads(name)
        note = _READERS.get(reader) or "read by nothing: unset it (gdn-cp's settings: `python3 -m gdn_cp.env`)"
        rows.append({"name": name, "value": environ[name], "read_by": reader, "note": note})
    return rows


def check_doctor_args(heads=None, tp: Optional[int] = None, cp: Optional[int] = None, path=None):
    """ValueError naming the flag, the value and the fix, before anything is printed: ``--tp`` /
    ``--cp`` without ``--heads`` (they only matter for the mode table), heads that do not group,
    a ``--path`` with no megatron-core. Returns the megatron root of ``path`` (None without)."""
    if heads is None and (tp is not None or cp is not None):
        given = " ".join(f"{flag} {v}" for flag, v in (("--tp", tp), ("--cp", cp)) if v is not None)
        raise ValueError(f"{given}: the TP / CP sizes only choose the linear_cp_mode table, which needs the heads "
                         f"too; add --heads K,V (e.g. --heads 16,32 {given})")
    if heads is not None:
        if len(heads) != 2:
            raise ValueError(f"--heads takes two numbers K,V (key heads, value heads), got {heads}")
        k, v = heads
        if v % k:
            raise ValueError(f"--heads {k},{v}: the value heads ({v}) must be a multiple of the key heads ({k}) "
                             f"(value head h reads key head h // (V/K)), e.g. --heads {k},{2 * k}")
    if path is None:
        return None
    try:
        return patch.find_megatron_root(path)
    except patch.MegatronNotFound as err:
        raise ValueError(f"--path {path}: {err}") from None


def collect_report(heads=None, tp: Optional[int] = None, cp: Optional[int] = None, path=None) -> dict:
    """The doctor's findings as a dict (see :func:`run_doctor`); ValueError for bad arguments."""
    root = check_doctor_args(heads, tp, cp, path)
    gpus, gpu_note = _gpus()
    report: dict = {
        "versions": {
            "python": python_verdict(sys.version_info[:3]),
            "gdn-cp": __version__,
            "torch": _version("torch"),
            "megatron-core": _version("megatron-core"),
            "megatron-core pins": ", ".join(PINS),
            **{package: _version(package) for spec in BACKENDS.values() for package in spec.packages},  # the registry's
            "transformer-engine": _te_version(),
        },
        "gpus": gpus,
        "gpu_note": gpu_note,
        "verdicts": dict(spec.verdict() for spec in BACKENDS.values() if spec.verdict is not None),
        "environment": environment_report(),
    }
    if report["gpus"]:  # the CUDA backends' kernels import only with CUDA: probing them on a CPU machine says nothing
        from ..ops.registry import resolve_backend

        report["stacks"] = {name: spec.stack_report() for name, spec in BACKENDS.items() if spec.stack_report is not None}
        report["backend_auto"] = resolve_backend("auto", "cuda", head_dims=(128, 128), dtype="bfloat16")
    try:
        root = root or patch.find_megatron_root(None)
        states = patch.check_patch(root)
        state = patch.overall_state(states)
        report["patch"] = {
            "root": str(root), "state": state, "files": states, "tree": patch.describe_tree(root),
            "meaning": patch.describe_state(state),
        }
    except Exception as err:  # report, do not crash the doctor
        report["patch"] = {"root": None, "state": "unavailable", "error": str(err)}
    if heads is not None:
        tp, cp = tp or 1, cp or 1
        report["modes"] = explain_linear_cp_modes(num_key_heads=heads[0], num_value_heads=heads[1], tp=tp, cp=cp)
        report["shape"] = {"num_key_heads": heads[0], "num_value_heads": heads[1], "tp": tp, "cp": cp}
    return report


def problems(report: dict) -> list[str]:
    """What makes the doctor exit 1: the patch in a foreign or partial state, no mode legal for the heads."""
    found = []
    patch_state = report["patch"]
    if patch_state["state"] not in ("pristine", "patched", "unavailable"):
        found.append(f"megatron-core at {patch_state['root']}: {patch_state['meaning']}")
    if "modes" in report and not report["modes"][AUTO]["legal"]:
        found.append("no linear_cp_mode is legal for these heads")
    return found


def run_doctor(heads=None, tp: Optional[int] = None, cp: Optional[int] = None, path=None,
               echo: Callable[[str], None] = print, as_json: bool = False) -> int:
    """Print the report (``as_json``: one JSON object, with ``problems``); return 0 when all is well, 1
    when the patch is in a foreign or partial state or no mode is legal for ``heads``. Bad arguments:
    ValueError before anything is printed."""
    report = collect_report(heads, tp, cp, path)
    found = problems(report)
    if as_json:
        echo(json.dumps({**report, "problems": found}, indent=2, default=str))
        return 1 if found else 0
    echo("versions:")
    for name, version in report["versions"].items():
        echo(f"  {name:<24} {version}")
    gpus = ", ".join(report["gpus"]) or report["gpu_note"] or "none (CPU: reference backend, gloo)"
    echo(f"GPUs: {gpus}")
    variables = report["environment"]
    if not variables:
        echo(f"environment: no {env.PREFIX}* variable set")
    else:
        echo(f"environment ({env.PREFIX}* variables set, and who reads them):")
        width = max(len(f"{v['name']}={v['value']}") for v in variables)
        for v in variables:
            echo(f"  {v['name'] + '=' + v['value']:<{width}}  {v['note']}")
    for backend, stack in report.get("stacks", {}).items():
        echo(f"{BACKENDS[backend].title} stack: {stack['stack']} (what the {backend} backend uses of it, chosen once "
             "per process and logged):")
        for name, text in stack["choices"].items():
            echo(f"  {name:<20} {text}")
    if "backend_auto" in report:
        name, why = report["backend_auto"]
        echo(f"linear_cp_backend auto for head dims 128, bf16 (Qwen3.5's GDN layers) on this GPU -> {name}: {why}")
    patch = report["patch"]
    if patch["root"] is None:
        echo(f"megatron-core patch: unavailable ({patch.get('error')})")
    else:
        echo(f"megatron-core patch at {patch['root']}: {patch['state']}")
        echo(f"  {patch['tree']}")
        for file, state in patch["files"].items():
            echo(f"  {state:<9} {file}")
    for label, line in report["verdicts"].items():
        echo(f"{label}: {line}")
    if "modes" in report:
        s = report["shape"]
        echo(
            f"linear_cp_mode for linear_num_key_heads={s['num_key_heads']}, "
            f"linear_num_value_heads={s['num_value_heads']}, TP={s['tp']}, CP={s['cp']}:"
        )
        for mode, info in report["modes"].items():
            if mode != AUTO:
                echo(f"  {mode:<10} {'legal  ' if info['legal'] else 'ILLEGAL'}  {info['reason']}")
        auto = report["modes"][AUTO]
        echo(f"  {AUTO:<10} -> {auto['resolved'] or 'nothing legal'}: {auto['reason']}")
    for problem in found:
        echo(f"problem: {problem}")
    return 1 if found else 0
