"""`gdn-cp doctor`: what is installed, whether Megatron-Core is patched, and which mode fits.

Reads versions without importing megatron.core (its import is slow and noisy), finds the
patch state and the release the files match (by sha256) through :mod:`gdn_cp.megatron.patching`,
and for a head shape lists the ``linear_cp_mode`` values of the registry (:mod:`gdn_cp.modes.
spec`), whether each is legal and what ``auto`` picks, with reasons.
"""

from __future__ import annotations

import importlib.metadata
from typing import Callable, Optional

from .config import AUTO, explain_linear_cp_modes
from .pins import PINS

__all__ = ["collect_report", "run_doctor"]


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def collect_report(heads=None, tp: int = 1, cp: int = 1, path=None) -> dict:
    import torch

    from .. import __version__
    from . import patching

    report: dict = {
        "versions": {
            "gdn-cp": __version__,
            "torch": torch.__version__,
            "megatron-core": _version("megatron-core"),
            "megatron-core pins": ", ".join(PINS),
            "flash-linear-attention": _version("flash-linear-attention"),
            "fla-core": _version("fla-core"),
            "triton": _version("triton"),
        },
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else [],
    }
    if report["gpus"]:  # FLA's kernels import only with CUDA: probing them on a CPU machine says nothing
        from ..ops.fla import fla_collective_backends, stack_report

        report["fla_stack"] = stack_report()
        report["fla_stack"]["cp context groups"] = fla_collective_backends()
    try:
        root = patching.find_megatron_root(path)
        states = patching.check_patch(root)
        report["patch"] = {
            "root": str(root), "state": patching.overall_state(states), "files": states,
            "tree": patching.describe_tree(root),
        }
    except Exception as err:  # report, do not crash the doctor
        report["patch"] = {"root": None, "state": "unavailable", "error": str(err)}
    if heads is not None:
        if len(heads) != 2:
            raise ValueError(f"--heads takes two numbers K,V (key heads, value heads), got {heads}")
        report["modes"] = explain_linear_cp_modes(num_key_heads=heads[0], num_value_heads=heads[1], tp=tp, cp=cp)
        report["shape"] = {"num_key_heads": heads[0], "num_value_heads": heads[1], "tp": tp, "cp": cp}
    return report


def run_doctor(heads=None, tp: int = 1, cp: int = 1, path=None, echo: Callable[[str], None] = print,
               error_echo: Optional[Callable[[str], None]] = None) -> int:
    """Print the report. Exit code 0: all is well; 1: the patch is in a foreign or partial state,
    the ``path`` asked for holds no megatron-core, or no mode is legal for ``heads``; 2: bad
    arguments (an error through ``error_echo``, default ``echo``, and no report)."""
    try:
        report = collect_report(heads, tp, cp, path)
    except ValueError as err:
        (error_echo or echo)(f"gdn-cp doctor: error: {err}")
        return 2
    echo("versions:")
    for name, version in report["versions"].items():
        echo(f"  {name:<24} {version}")
    echo(f"GPUs: {', '.join(report['gpus']) if report['gpus'] else 'none (CPU: reference backend, gloo)'}")
    if "fla_stack" in report:
        stack = report["fla_stack"]
        echo(f"FLA stack: {stack['stack']} (what the FLA backend uses of it, chosen once per process and logged):")
        for name, text in stack["choices"].items():
            echo(f"  {name:<20} {text}")
        groups = ", ".join(f"{b} ({why})" for b, why in stack["cp context groups"].items())
        echo(f"  {'cp context groups':<20} {groups}")
    patch = report["patch"]
    if patch["root"] is None:
        echo(f"megatron-core patch: unavailable ({patch.get('error')})")
    else:
        echo(f"megatron-core patch at {patch['root']}: {patch['state']}")
        echo(f"  {patch['tree']}")
        for file, state in patch["files"].items():
            echo(f"  {state:<9} {file}")
    echo(
        "FLA/Triton hazard check: run `gdn-cp selftest --gpu` on the GPU machine "
        "(FLA >= 0.5 with Triton < 3.7.1 on Hopper miscomputes or refuses the GDN backward)"
    )
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
    problems = []
    if patch["state"] not in ("pristine", "patched", "unavailable"):
        problems.append(f"the megatron-core patch is {patch['state']} (see `gdn-cp patch check`)")
    if patch["root"] is None and path is not None:
        problems.append(f"{path} holds no megatron-core the patch tool can use")
    if "modes" in report and not report["modes"][AUTO]["legal"]:
        problems.append("no linear_cp_mode is legal for these heads")
    for problem in problems:
        echo(f"problem: {problem}")
    return 1 if problems else 0
