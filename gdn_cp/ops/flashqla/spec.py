"""The FlashQLA backend's facts (torch-free): devices, head dims, dtypes, what its native core needs."""

from __future__ import annotations

from typing import Optional

from ..contract import BackendSpec, SelftestCase
from ..installed import dist_version

__all__ = ["AUTO_CP_ENV", "FLASHQLA_VS_FP64_REL_L2", "TESTED_FLASHQLA_STACK", "flashqla_verdict", "FLASHQLA_HEAD_DIM",
           "SPEC", "head_dims_problem", "padded_value_heads", "value_heads_problem"]

AUTO_CP_ENV = "GDN_CP_FLASHQLA_AUTO_CP"
"""FlashQLA's ``auto_cp`` (its own split of a long sequence into pieces run side by side on one GPU,
with the pieces' states corrected afterwards; FlashQLA's default, and where its speed at few heads
comes from): 1 (default) on, 0 off. Read with gdn-cp's other settings, handed to :func:`load`."""

FLASHQLA_HEAD_DIM = 128
"""The key and value head dim FlashQLA's kernels take (a value head dim that is a multiple of it
runs as one call per block)."""


def head_dims_problem(head_k_dim: int, head_v_dim: int) -> Optional[str]:
    """Why FlashQLA's kernels cannot take these head dims, with the fix; None when they can."""
    if head_k_dim != FLASHQLA_HEAD_DIM or head_v_dim % FLASHQLA_HEAD_DIM or head_v_dim < FLASHQLA_HEAD_DIM:
        return (f"head_k_dim={head_k_dim}, head_v_dim={head_v_dim}: FlashQLA's kernels take head dims of "
                f"{FLASHQLA_HEAD_DIM} only (a value head dim that is a multiple of {FLASHQLA_HEAD_DIM} runs in blocks). "
                "Fix: linear_cp_backend='fla' (FLA takes key head dims 16..256), or 'auto' (FlashQLA where it fits).")
    return None


def value_heads_problem(v_heads: int) -> Optional[str]:
    """Why FlashQLA 0.1.3's kernels cannot compile a call with ``v_heads`` value heads; None when they can.

    Its ``chunk_local_cumsum`` holds the gates of every value head of a 64-row chunk in one fragment
    ``[Hv, 64]`` over 128 threads, and TileLang finds no layout for it unless ``Hv * 64`` is a multiple of
    128 (seen on an H200: 1 key / 3 value heads per rank fails inside the first forward, ``no available
    layout found``); every other kernel works per head."""
    if v_heads % 2:
        return f"{v_heads} value heads: FlashQLA's chunk_local_cumsum compiles an even number of value heads only"
    return None


def padded_value_heads(k_heads: int, v_heads: int) -> int:
    """The value heads a FlashQLA call runs for a layer's ``k_heads`` / ``v_heads`` (per rank): the layer's own
    where FlashQLA compiles them, else the fewest more that it does and that stay a multiple of ``k_heads``
    (zero heads added to each key head's group: :func:`gdn_cp.ops.flashqla.kernels.pad_value_heads`)."""
    ratio = v_heads // k_heads
    while value_heads_problem(k_heads * ratio) is not None:
        ratio += 1
    return k_heads * ratio


def first_use_note() -> str:
    """What FlashQLA's first call costs, and where its compiled kernels are kept (``TILELANG_CACHE_DIR``)."""
    import os

    cache = os.environ.get("TILELANG_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".tilelang", "cache")
    return ("FlashQLA compiles its TileLang kernels on first use, per head count and dtype: about 2-4 minutes cold "
            "for each (seen on an H200 and an H100; a CP=2 `gdn-cp run` of three modes compiles several: over 5 "
            f"minutes), seconds once they are in TileLang's cache ({cache}; TILELANG_CACHE_DIR moves it)")


FLASHQLA_VS_FP64_REL_L2 = {"bfloat16": 1e-2}
"""FlashQLA's kernels (bf16 only) vs the fp64 reference (rel_l2): bf16 rounds inputs and outputs at 8 bits."""


TESTED_FLASHQLA_STACK = ("0.1.3", "0.1.15")
"""The FlashQLA stack of the ``[flashqla]`` extra: (flash-qla, tilelang)."""


def flashqla_verdict(flash_qla: Optional[str], tilelang: Optional[str]) -> str:
    """One line: the installed FlashQLA + TileLang, and whether it is the stack of the [flashqla] extra."""
    want = f"flash-qla {TESTED_FLASHQLA_STACK[0]} + tilelang {TESTED_FLASHQLA_STACK[1]} ([flashqla])"
    if flash_qla in (None, "not installed"):
        return f"not installed (sm_90+ GPU only: pip install -e '.[flashqla]'; the pinned stack: {want})"
    if (flash_qla, tilelang) == TESTED_FLASHQLA_STACK:
        return f"flash-qla {flash_qla} + tilelang {tilelang}: the [flashqla] stack"
    return (f"flash-qla {flash_qla} + tilelang {tilelang}: not the pinned stack ({want}); check it with "
            "`gdn-cp selftest --gpu` on the GPU machine")


def _verdict() -> tuple[str, str]:
    return "FlashQLA + TileLang", flashqla_verdict(dist_version("flash-qla", "flash_qla"), dist_version("tilelang"))


def _versions() -> dict:
    return {"flash_qla": dist_version("flash-qla", "flash_qla"), "tilelang": dist_version("tilelang")}


def _stack_report() -> dict:
    from .detect import stack_report

    return stack_report()


def _problem() -> Optional[str]:
    from .detect import flashqla_problem  # FlashQLA-free until asked; then probed once per process

    return flashqla_problem()


SPEC = BackendSpec(
    name="flashqla", title="FlashQLA", devices=("cuda",),
    devices_why="FlashQLA's TileLang kernels run on NVIDIA sm_90+ GPUs only", preference=0, problem=_problem,
    dtypes=("bfloat16", "float16"), head_dims=head_dims_problem, narrow=True,
    native_cp="an sm_90+ GPU with flash-qla >= 0.1.3 and FLA's cp context (the conv)", settings=(AUTO_CP_ENV,),
    first_use=first_use_note, packages=("flash-qla", "tilelang"), versions=_versions, tolerances=FLASHQLA_VS_FP64_REL_L2,
    selftest=(SelftestCase("conv", "bfloat16"), SelftestCase("gdn", "bfloat16", (FLASHQLA_HEAD_DIM, FLASHQLA_HEAD_DIM))),
    verdict=_verdict, stack_report=_stack_report,
)
