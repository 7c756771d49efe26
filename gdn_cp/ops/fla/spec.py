"""The FLA backend's facts (torch-free): devices, head dims, what its native cores need."""

from __future__ import annotations

from typing import Optional

from ..contract import BackendSpec, SelftestCase
from ..installed import dist_version

FLA_COLLECTIVE_BACKENDS = ("nccl",)
"""torch.distributed backends whose groups take FLA's cp context collectives as FLA calls them (an
``all_gather_into_tensor`` into a ``[world, n, ...]`` output: NCCL; gloo wants it flat). Read at each call
(``native_cp.runs_on``): a test harness that adapts FLA's collectives for gloo ranks adds gloo here, and says so."""

__all__ = ["FLA_COLLECTIVE_BACKENDS", "FLA_MAX_HEAD_K_DIM", "FLA_MIN_HEAD_DIM", "FLA_VS_FP64_REL_L2", "SPEC", "TESTED_FLA_STACKS",
           "fla_stack_verdict", "head_dims_problem", "version_at_least"]

# chunk_gated_delta_rule_fwd_h asserts K <= 256 (FLA 0.4.2 .. 0.6); tl.dot needs every block dim >= 16.
FLA_MAX_HEAD_K_DIM = 256
FLA_MIN_HEAD_DIM = 16


def head_dims_problem(head_k_dim: int, head_v_dim: int) -> Optional[str]:
    """Why FLA's GDN kernels cannot take these head dims, with the fix; None when they can."""
    if not (FLA_MIN_HEAD_DIM <= head_k_dim <= FLA_MAX_HEAD_K_DIM):
        return (f"head_k_dim={head_k_dim} is outside what FLA's GDN kernels support "
                f"[{FLA_MIN_HEAD_DIM}, {FLA_MAX_HEAD_K_DIM}]. Fix: use a key head dim in that range, or the "
                "reference backend.")
    if head_v_dim < FLA_MIN_HEAD_DIM:
        return (f"head_v_dim={head_v_dim} is below FLA's minimum {FLA_MIN_HEAD_DIM}. Fix: use a value head dim "
                ">= 16, or the reference backend.")
    return None


FLA_VS_FP64_REL_L2 = {"float32": 5e-3, "bfloat16": 1e-2}
"""FLA's kernels vs the fp64 reference (rel_l2), per compute dtype. FLA's fp32 path uses TF32 dots
(~1.5e-3 seen at head dim 64); bf16 rounds inputs and outputs at 8 bits."""


TESTED_FLA_STACKS = {
    "fla": ("0.6.0", "3.7.1"),
    "fla042": ("0.4.2", "3.6.0"),
}
"""The FLA stacks the GPU suite ran on (README "Tested versions"): pyproject extra -> (fla-core, Triton).
Each extra pins its fla-core exactly; Triton comes with torch and no extra pins it (pip would replace a
CUDA torch to satisfy a Triton pin): ``constraints/<extra>.txt`` pins the torch and Triton of the
stack for a fresh environment, and ``gdn-cp doctor`` says whether the installed pair is one of these
(``tests/cli/test_doctor.py`` keeps this table, pyproject.toml, constraints/ and the README equal)."""


def fla_stack_verdict(fla: Optional[str], triton: Optional[str]) -> str:
    """One line: the installed FLA + Triton, and whether the GPU suite ran on that pair."""
    tested = ", ".join(f"fla {f} + triton {t} ([{extra}])" for extra, (f, t) in TESTED_FLA_STACKS.items())
    if fla is None:
        return (f"not installed (CUDA only: pip install -e '.[fla]'; tested stacks: {tested})")
    if (fla, triton) in TESTED_FLA_STACKS.values():
        return f"fla {fla} + triton {triton}: a tested stack"
    hazard = ""
    if version_at_least(fla, (0, 5)) and triton is not None and not version_at_least(triton, (3, 7, 1)):
        hazard = "; FLA >= 0.5 with Triton < 3.7.1 refuses or miscomputes the GDN backward on Hopper (FLA issue #640)"
    return (f"fla {fla} + triton {triton}: untested (tested: {tested}){hazard}; "
            "check it with `gdn-cp selftest --gpu` on the GPU machine")


def version_at_least(version: str, floor: tuple) -> bool:
    """``version`` (e.g. ``3.7.1+git``) >= ``floor``, read on its leading numbers; unreadable: True."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return not parts or tuple(parts) >= floor


def _verdict() -> tuple[str, str]:
    return "FLA + Triton", fla_stack_verdict(dist_version("fla-core", "flash-linear-attention"), dist_version("triton"))


def _versions() -> dict:
    from .detect import fla_version  # also finds a source checkout without package metadata

    return {"fla": fla_version()}


def _stack_report() -> dict:
    from .detect import stack_report

    report = stack_report()
    report["choices"]["cp context groups"] = ", ".join(f"{b} (takes FLA's collectives as FLA calls them)"
                                                        for b in FLA_COLLECTIVE_BACKENDS)
    return report


def _selftest_notes(versions: dict) -> list:
    """FLA's known hazard on this stack (FLA issue #640), and what an FLA without a cp context cannot do."""
    notes = []
    fla, triton, cap = versions.get("fla"), versions.get("triton"), versions.get("capability") or ""
    if (fla and triton and version_at_least(fla, (0, 5)) and version_at_least(triton, (3, 4))
            and not version_at_least(triton, (3, 7, 1)) and cap.startswith("9.")):
        notes.append(f"FLA {fla} with Triton {triton} on Hopper (sm_{cap.replace('.', '')}): FLA refuses or "
                     "miscomputes the GDN backward here (FLA issue #640). Fix: Triton >= 3.7.1, tilelang, or FLA 0.4.2.")
    from .detect import fla_available, has_cp_context

    if fla_available() and not has_cp_context():
        notes.append(f"FLA {fla} has no cp_context: linear_cp_mode='chunkwise' cannot use the FLA backend")
    return notes


def _problem() -> Optional[str]:
    from .detect import fla_import_error  # FLA-free until asked; then probed once per process

    return fla_import_error()


SPEC = BackendSpec(
    name="fla", title="FLA", devices=("cuda",), devices_why="FLA's Triton kernels run on CUDA tensors only",
    preference=1, problem=_problem, tf32_dots=True, head_dims=head_dims_problem,
    native_cp="a CUDA GPU with flash-linear-attention >= 0.4.2",
    packages=("flash-linear-attention", "fla-core", "triton"), versions=_versions, tolerances=FLA_VS_FP64_REL_L2,
    selftest=tuple(SelftestCase(kind, dtype) for dtype in ("float32", "bfloat16") for kind in ("conv", "gdn")),
    verdict=_verdict, stack_report=_stack_report, selftest_notes=_selftest_notes,
)
