"""benchmarks/fla_levers.py on the CPU: what each stack offers, and the fp64 reference."""

from __future__ import annotations

import torch


# ---------------------------------------------------------------------------------------------
# benchmarks/fla_levers.py: the GPU runs each way; here what each stack offers and the reference
# ---------------------------------------------------------------------------------------------

def test_fla_levers_says_why_a_way_does_not_run(benchmark_module):
    from gdn_cp.ops.fla.detect import FLAFeatures

    levers = benchmark_module("fla_levers")
    fla042 = levers.gdn_ways_offered(FLAFeatures(None, None, fused_gated_norm=True), [])
    assert fla042["expanded"] is None and "grouped value heads" in fla042["grouped"]
    assert fla042["grouped_flash_qla"] is not None
    fla060 = FLAFeatures(None, None, grouped_value_heads=True, gate_in_kernel=True, beta_sigmoid_in_kernel=True,
                         fused_gated_norm=True)
    no_qla = levers.gdn_ways_offered(fla060, [{"name": "flash_qla", "available": False, "enabled": True}])
    assert no_qla["grouped"] is None and no_qla["grouped_gates_in_kernel"] is None
    assert "flash_qla is not importable" in no_qla["grouped_flash_qla"]
    assert levers.gdn_ways_offered(fla060, [{"name": "flash_qla", "available": True, "enabled": True}])[
        "grouped_flash_qla"] is None
    norms = levers.norm_ways_offered(fla060, "no TE")
    assert norms == {"torch": None, "fla_fused": None, "te": "no TE", "te_zero_centered": "no TE",
                     "fla_fused_zero_centered": None}
    assert set(levers.NORM_WAYS) == set(norms) and set(levers.GDN_WAYS) == set(fla042)


def test_fla_levers_fp64_norm_reference(benchmark_module):
    """The reference every norm way is checked against: torch's RMSNorm * silu(z), in fp64, with
    the gradients autograd gives it."""
    levers = benchmark_module("fla_levers")
    gen = torch.Generator().manual_seed(0)
    x, z, do = (torch.randn(12, 16, generator=gen) for _ in range(3))
    w = 1 + (6.4 * torch.randn(16, generator=gen)).round() / 64
    y, grads = levers.norm_fp64(x, z, w, 1e-5, do)
    xx, zz, ww = (t.double().requires_grad_(True) for t in (x, z, w))
    norm = torch.nn.RMSNorm(16, eps=1e-5, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.copy_(ww)
    want = norm(xx) * torch.nn.functional.silu(zz)
    want.backward(do.double())
    assert torch.allclose(y, want.detach(), atol=1e-12)
    assert torch.allclose(grads["dx"], xx.grad, atol=1e-12) and torch.allclose(grads["dz"], zz.grad, atol=1e-12)
    assert torch.allclose(grads["dw"], norm.weight.grad, atol=1e-12)
    assert torch.equal(w.to(torch.bfloat16).double() - 1, (w - 1).to(torch.bfloat16).double())  # exact either way
