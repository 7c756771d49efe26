"""The Megatron glue's fused gated norm: a backend offering ``fused_gated_rms_norm`` (FLA's
``rms_norm_gated`` on CUDA) replaces ``out_norm(o) * silu(z)`` where out_norm is torch's RMSNorm and
the activation SiLU, gives the same numbers, and the choice is logged once per layer. Here a plain
torch stand-in plays FLA's kernel on CPU gloo ranks (the real kernel runs in the GPU suite)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


def _gated_rms_norm(x, z, weight, eps):
    xf = x.double() if x.dtype == torch.float64 else x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight * F.silu(z.to(xf.dtype))
    return y.to(x.dtype)


class _FusedReference:
    """The reference backend plus a fused gated norm that counts its calls."""

    __name__ = "fused_reference"
    calls = 0

    def __getattr__(self, name):
        from gdn_cp.ops import get_backend

        return getattr(get_backend("reference"), name)

    def fused_gated_rms_norm(self):
        def fn(x, z, weight, eps):
            _FusedReference.calls += 1
            return _gated_rms_norm(x, z, weight, eps)
        return fn


def _with_fused_norm(ctx):
    import logging

    import gdn_cp.megatron.gdn as glue
    from gdn_cp.testing.megatron_parity import parity_case

    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger(glue.__name__).addHandler(handler)
    logging.getLogger(glue.__name__).setLevel(logging.INFO)
    original = glue.choose_backend
    glue.choose_backend = lambda module, device: _FusedReference()
    try:
        errs = parity_case(ctx.rank, ctx.world_size, "thd", torch.float64, ("chunkwise", "headwise"))
    finally:
        glue.choose_backend = original
    return {"errors": errs, "calls": _FusedReference.calls, "log": [m for m in records if "gated norm" in m]}


@pytest.mark.megatron
def test_fused_gated_norm_replaces_out_norm(patched_megatron, rank_pool):
    for rank, res in enumerate(rank_pool(2).run(_with_fused_norm)):
        assert res["calls"] >= 2, res  # both modes' forwards used it
        assert any("fused RMSNorm" in m for m in res["log"]), res["log"]
        for mode, errs in res["errors"].items():
            assert max(errs.values()) < 1e-10, (rank, mode, errs)
