"""The FLA backend's facts (torch-free): devices, head dims, what its native cores need."""

from __future__ import annotations

from typing import Optional

from ..contract import BackendSpec

__all__ = ["FLA_MAX_HEAD_K_DIM", "FLA_MIN_HEAD_DIM", "SPEC", "head_dims_problem"]

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


def _problem() -> Optional[str]:
    from .detect import fla_import_error  # FLA-free until asked; then probed once per process

    return fla_import_error()


SPEC = BackendSpec(
    name="fla", title="FLA", devices=("cuda",), devices_why="FLA's Triton kernels run on CUDA tensors only",
    preference=1, problem=_problem, tf32_dots=True, head_dims=head_dims_problem,
    native_cp="a CUDA GPU with flash-linear-attention >= 0.4.2",
)
