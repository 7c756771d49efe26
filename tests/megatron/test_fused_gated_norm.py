"""The Megatron glue's fused gated norm: a backend offering ``fused_gated_rms_norm`` (FLA's
``rms_norm_gated`` on CUDA) replaces ``out_norm(o) * silu(z)`` where out_norm is torch's RMSNorm and
the activation SiLU, gives the same numbers, and the choice is logged once per layer. Here a plain
torch stand-in plays FLA's kernel on CPU gloo ranks (the real kernel runs in the GPU suite)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F


def _gated_rms_norm(x, z, weight, eps):
    xf = x.double() if x.dtype == torch.float64 else x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight * F.silu(z.to(xf.dtype))
    return y.to(x.dtype)


_FUSED_CALLS = []


def _fused_reference():
    """The reference backend plus a fused gated norm that counts its calls (in :data:`_FUSED_CALLS`)."""
    from gdn_cp.ops import get_backend

    def fn(x, z, weight, eps):
        _FUSED_CALLS.append(1)
        return _gated_rms_norm(x, z, weight, eps)

    return replace(get_backend("reference"), fused_gated_rms_norm=lambda: fn)


def _with_fused_norm(ctx):
    import logging

    import gdn_cp.megatron.layer as glue
    from gdn_cp_testing.megatron.parity import parity_case

    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("gdn_cp.megatron").addHandler(handler)
    logging.getLogger("gdn_cp.megatron").setLevel(logging.INFO)
    original = glue.choose_backend
    fused = _fused_reference()
    glue.choose_backend = lambda settings, layer, device: fused
    try:
        errs = parity_case(ctx.rank, ctx.world_size, "thd", torch.float64, ("chunkwise", "headwise"))
    finally:
        glue.choose_backend = original
    return {"errors": errs, "calls": len(_FUSED_CALLS), "log": [m for m in records if "gated norm" in m]}


@pytest.mark.megatron
def test_fused_gated_norm_replaces_out_norm(patched_megatron, rank_pool):
    for rank, res in enumerate(rank_pool(2).run(_with_fused_norm)):
        assert res["calls"] >= 2, res  # both modes' forwards used it
        assert any("fused RMSNorm" in m for m in res["log"]), res["log"]
        for mode, errs in res["errors"].items():
            assert max(errs.values()) < 1e-10, (rank, mode, errs)


# ----------------------------------------------------------------------------------------------
# TransformerEngine's RMSNorm (Megatron's TENorm with normalization="RMSNorm"), on the CPU: a
# stand-in with TE's class module and qualname, attributes and forward formula (TE 2.20's
# transformer_engine/pytorch/module/rmsnorm.py over ops/basic/rmsnorm.py); TE itself is not
# installable here, and gdn-cp recognises the class without importing TE.
# ----------------------------------------------------------------------------------------------
class RMSNorm(torch.nn.Module):
    """TE 2.20's RMSNorm as gdn-cp sees it: ``weight`` (a parameter of ``normalized_shape``, zeros
    when ``zero_centered_gamma`` else ones), ``eps``, ``zero_centered_gamma``, the legacy
    ``sequence_parallel`` flag tagged on the weight; forward ``x * rsqrt(mean(x^2) + eps) * (weight + 1
    if zero_centered_gamma else weight)`` in the weight's dtype."""

    def __init__(self, normalized_shape, eps=1e-5, sequence_parallel=None, zero_centered_gamma=False,
                 dtype=torch.float64):
        super().__init__()
        self.eps, self.zero_centered_gamma, self.sequence_parallel = eps, zero_centered_gamma, sequence_parallel
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        init = torch.zeros if zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(shape, dtype=dtype))
        if sequence_parallel is not None:
            self.weight.sequence_parallel = sequence_parallel

    def forward(self, x):
        w = self.weight + 1 if self.zero_centered_gamma else self.weight
        x = x.to(self.weight.dtype)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w


class LayerNorm(RMSNorm):
    """TE's LayerNorm (``normalization="LayerNorm"``), by name: gdn-cp must not take it for an RMSNorm."""


RMSNorm.__module__ = "transformer_engine.pytorch.module.rmsnorm"
LayerNorm.__module__ = "transformer_engine.pytorch.module.layernorm"


class _Subclass(RMSNorm):
    __module__ = "transformer_engine.pytorch.module.rmsnorm"  # same module, another qualname


def test_te_rmsnorm_recognised_by_name_and_refused_with_the_reason():
    from gdn_cp.pins import megatron_core_0_19_2 as pin

    assert pin.TE_RMSNORM == (RMSNorm.__module__, RMSNorm.__qualname__)
    problem = pin.fused_rms_norm_problem
    for zcg in (False, True):
        assert problem(RMSNorm(8, zero_centered_gamma=zcg), 8) is None
    assert problem(RMSNorm(8, sequence_parallel=True), 8) is None
    assert problem(torch.nn.RMSNorm(8), 8) is None

    with_bias = RMSNorm(8)
    with_bias.bias = torch.nn.Parameter(torch.zeros(8))
    mismatched = RMSNorm(8, sequence_parallel=True)
    mismatched.weight = torch.nn.Parameter(torch.ones(8))  # replaced behind TE's back: no tag
    hooked = RMSNorm(8)
    hooked.register_forward_pre_hook(lambda module, args: None)
    refused = {
        "LayerNorm": (LayerNorm(8), "out_norm is transformer_engine.pytorch.module.layernorm.LayerNorm, neither"),
        "subclass": (_Subclass(8), "out_norm is transformer_engine.pytorch.module.rmsnorm._Subclass, neither"),
        "torch LayerNorm": (torch.nn.LayerNorm(8), "out_norm is torch.nn.modules.normalization.LayerNorm, neither"),
        "bias": (with_bias, "has a bias"),
        "2-D weight": (RMSNorm((2, 4)), "has weight Parameter of shape (2, 4), not a parameter of shape (8,)"),
        "other dim": (RMSNorm(4), "of shape (4,), not a parameter of shape (8,)"),
        "eps": (RMSNorm(8, eps=0.0), "has eps=0.0, not a positive number"),
        "zero_centered_gamma": (RMSNorm(8, zero_centered_gamma=1), "zero_centered_gamma=1, not a bool"),
        "sequence_parallel": (mismatched, "has sequence_parallel=True but its weight is tagged sequence_parallel=None"),
        "hooks": (hooked, "out_norm has forward hooks"),
    }
    for name, (norm, reason) in refused.items():
        got = problem(norm, 8)
        assert got is not None and reason in got, (name, got)


def test_zero_centered_weight_is_weight_plus_one_in_the_graph():
    from gdn_cp.pins.megatron_core_0_19_2 import fused_rms_norm_eps, fused_rms_norm_weight

    norm = RMSNorm(8, eps=1e-6, zero_centered_gamma=True, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.1, 0.1, 8))
    w = fused_rms_norm_weight(norm)
    assert w.dtype == torch.float32 and torch.equal(w, norm.weight.float() + 1)  # +1 in fp32, as TE adds it
    w.sum().backward()
    assert torch.equal(norm.weight.grad, torch.ones(8, dtype=torch.bfloat16))
    assert fused_rms_norm_eps(norm) == 1e-6
    plain = RMSNorm(8)
    assert fused_rms_norm_weight(plain) is plain.weight


def _exact_gated_norm(module):
    """Megatron's ``_apply_gated_norm`` (out_norm, then ``* act(z)``) without its ``gate.float()``,
    which in an fp64 model rounds z to fp32: the layer's own TE-formula norm, exact in fp64."""
    def apply(x, gate):
        y = module.out_norm(x.reshape(-1, x.shape[-1]))
        return (y * module.act_fn(gate.reshape(-1, gate.shape[-1]))).to(x.dtype)
    return apply


def _te_stand_in_cases(ctx):
    """At CP=1 THD (gdn-cp's path), fp64: a GatedDeltaNet whose out_norm is the TE stand-in (with and
    without zero_centered_gamma), run with the reference backend (the layer's own out_norm * act(z):
    exactly in fp64, and as stock's ``_apply_gated_norm`` with z rounded to fp32) and with the fused
    stand-in backend (the fused kernel with the adapter's weight and eps). Then a forward pre-hook on
    out_norm: the layer's own norm again (the hook runs), and fused once removed."""
    import logging

    import gdn_cp.megatron.layer as glue
    from gdn_cp_testing.inputs import hidden_inputs
    from gdn_cp_testing.megatron.layer import build_gdn, make_config, rank_groups, run_layer, thd_params
    from gdn_cp.ops.accuracy import max_rel

    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("gdn_cp.megatron").addHandler(handler)
    logging.getLogger("gdn_cp.megatron").setLevel(logging.INFO)
    cu = [0, 7, 7, 20, 32]
    out = {}
    original = glue.choose_backend
    try:
        for zcg in (False, True):
            module = build_gdn(make_config(1, "chunkwise", torch.float64), rank_groups()["self"], seed=3)
            dv = module.value_head_dim
            gen = torch.Generator().manual_seed(11)
            norm = RMSNorm(dv, eps=module.config.layernorm_epsilon, zero_centered_gamma=zcg,
                           sequence_parallel=False)
            with torch.no_grad():
                norm.weight.copy_(0.3 * torch.randn(dv, generator=gen, dtype=torch.float64) + (0 if zcg else 1))
            module.out_norm = norm
            x, dout = hidden_inputs(cu[-1], 1, torch.float64, 21, module.config.hidden_size, "cpu")
            glue.choose_backend = original  # the reference backend: the layer's own TE-formula norm
            glue.reset_settings(module)
            stock = run_layer(module, x, dout, thd_params(cu))
            module._apply_gated_norm = _exact_gated_norm(module)
            want = run_layer(module, x, dout, thd_params(cu))
            del module._apply_gated_norm
            fused = _fused_reference()
            glue.choose_backend = lambda settings, layer, device: fused
            glue.reset_settings(module)
            before = len(_FUSED_CALLS)
            got = run_layer(module, x, dout, thd_params(cu))
            errs = {"out": max_rel(got[0], want[0]), "grad:hidden_states": max_rel(got[1], want[1])}
            errs.update({f"grad:{n}": max_rel(got[2][n], want[2][n]) for n in want[2]})
            stock_errs = [max_rel(got[0], stock[0]), max_rel(got[1], stock[1])]
            stock_errs += [max_rel(got[2][n], stock[2][n]) for n in stock[2]]
            hook_calls = []
            handle = norm.register_forward_pre_hook(lambda m, args: hook_calls.append(1))
            calls = len(_FUSED_CALLS)
            hooked = run_layer(module, x, dout, thd_params(cu))
            hooked_fused = len(_FUSED_CALLS) - calls
            handle.remove()
            calls = len(_FUSED_CALLS)
            run_layer(module, x, dout, thd_params(cu))
            out[zcg] = {"errors": errs, "stock": max(stock_errs), "fused_calls": calls - before, "hooked": (hooked_fused, len(hook_calls)),
                        "hooked_out": max_rel(hooked[0], stock[0]), "unhooked_fused": len(_FUSED_CALLS) - calls}
    finally:
        glue.choose_backend = original
    out["log"] = [m for m in records if "gated norm" in m]
    return out


@pytest.mark.megatron
def test_fused_gated_norm_takes_te_rmsnorm(patched_megatron, rank_pool):
    for rank, res in enumerate(rank_pool(2).run(_te_stand_in_cases)):
        for zcg in (False, True):
            r = res[zcg]
            assert r["fused_calls"] >= 1, (rank, zcg, r)
            over = {k: v for k, v in r["errors"].items() if not v <= 1e-10}
            assert not over and "grad:out_norm.weight" in r["errors"], (rank, zcg, over)
            assert r["stock"] <= 1e-6, (rank, zcg, r["stock"])  # stock's gate.float(): z rounded to fp32
            assert r["hooked"][0] == 0 and r["hooked"][1] >= 1, (rank, zcg, r)  # own norm: the hook ran
            assert r["hooked_out"] == 0 and r["unhooked_fused"] >= 1, (rank, zcg, r)  # the stock norm again
        log = res["log"]
        assert any("fused RMSNorm" in m for m in log), log
        assert any("out_norm has forward hooks" in m for m in log), log
        assert not any("not torch's RMSNorm" in m for m in log), log


# ----------------------------------------------------------------------------------------------
# GPU: the real TransformerEngine RMSNorm and FLA's fused kernel
# ----------------------------------------------------------------------------------------------
def _require_te_gpu():
    import importlib.util

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (FLA's fused gated norm, TransformerEngine); the CPU stand-in is "
                    "test_fused_gated_norm_takes_te_rmsnorm")
    if importlib.util.find_spec("fla") is None:
        pytest.skip("needs flash-linear-attention (fla) installed")
    try:
        import transformer_engine.pytorch as te
    except Exception as e:  # noqa: BLE001 - any import failure: not usable here, with the reason
        pytest.skip(f"needs TransformerEngine (transformer_engine.pytorch does not import: {type(e).__name__}: {e})")
    from gdn_cp.ops.fla.norm import fused_gated_rms_norm

    if fused_gated_rms_norm() is None:
        pytest.skip("this FLA has no fused gated RMSNorm (fla.modules.fused_norm_gate.rms_norm_gated)")
    return te


@pytest.mark.gpu
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_fla_fused_gated_norm_equals_te_rmsnorm_gpu(zero_centered_gamma):
    """FLA's fused ``RMSNorm * silu(z)`` with the weight and eps gdn-cp reads from TE's RMSNorm
    against TE's own norm * silu(z) as Megatron's ``_apply_gated_norm`` computes it, bf16, forward
    and backward (x, z and the weight's gradient); both also against the fp64 formula."""
    te = _require_te_gpu()
    from gdn_cp.pins.megatron_core_0_19_2 import fused_rms_norm_eps, fused_rms_norm_problem, fused_rms_norm_weight
    from gdn_cp.ops.fla.norm import fused_gated_rms_norm
    from gdn_cp.ops.accuracy import rel_l2
    from gdn_cp.ops.accuracy import FLA_VS_FP64_REL_L2

    tol = FLA_VS_FP64_REL_L2["bfloat16"]
    n, d, dev = 4096, 128, torch.device("cuda")
    norm = te.RMSNorm(d, eps=1e-6, zero_centered_gamma=zero_centered_gamma, params_dtype=torch.bfloat16, device=dev)
    assert fused_rms_norm_problem(norm, d) is None, fused_rms_norm_problem(norm, d)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        norm.weight.copy_((0.2 * torch.randn(d, generator=gen) + (0.0 if zero_centered_gamma else 1.0)).to(dev))
    x0, z0, dy = (torch.randn(n, d, generator=gen).to(dev, torch.bfloat16) for _ in range(3))

    def run(fn):
        norm.weight.grad = None
        x, z = x0.clone().requires_grad_(True), z0.clone().requires_grad_(True)
        y = fn(x, z)
        y.backward(dy)
        return y.detach(), x.grad, z.grad, norm.weight.grad.clone()

    te_out = run(lambda x, z: (norm(x) * F.silu(z.float())).to(x.dtype))  # Megatron's _apply_gated_norm
    fused = run(lambda x, z: fused_gated_rms_norm()(x, z, fused_rms_norm_weight(norm), fused_rms_norm_eps(norm)))

    w = norm.weight.detach().double() + (1 if zero_centered_gamma else 0)
    x, z = x0.double().requires_grad_(True), z0.double().requires_grad_(True)
    w.requires_grad_(True)
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * w * F.silu(z)
    y.backward(dy.double())
    exact = (y.detach(), x.grad, z.grad, w.grad)
    for i, name in enumerate(("y", "dx", "dz", "dweight")):
        assert rel_l2(fused[i], te_out[i]) <= tol, (name, rel_l2(fused[i], te_out[i]))
        assert rel_l2(fused[i], exact[i]) <= tol and rel_l2(te_out[i], exact[i]) <= tol, (
            name, rel_l2(fused[i], exact[i]), rel_l2(te_out[i], exact[i]))


def _te_layer_cases(ctx, zero_centered_gamma):
    """The patched GatedDeltaNet (FLA backend, bf16, CP=1 THD: gdn-cp's path) with a real TE RMSNorm as
    out_norm: the fused path (logged) against the layer's own TE norm * silu(z) (a backend without
    the fused norm), outputs and every gradient."""
    import logging

    import transformer_engine.pytorch as te

    import gdn_cp.megatron.layer as glue
    from gdn_cp.ops import get_backend
    from gdn_cp_testing.inputs import hidden_inputs
    from gdn_cp_testing.megatron.layer import build_gdn, make_config, rank_groups, run_layer, thd_params
    from gdn_cp_testing.megatron.parity import GPU_CFG
    from gdn_cp.ops.accuracy import rel_l2

    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("gdn_cp.megatron").addHandler(handler)
    logging.getLogger("gdn_cp.megatron").setLevel(logging.INFO)
    cfg = make_config(1, "chunkwise", torch.bfloat16, **GPU_CFG)
    module = build_gdn(cfg, rank_groups()["self"], seed=3, device=ctx.device)
    dv = module.value_head_dim
    norm = te.RMSNorm(dv, eps=cfg.layernorm_epsilon, zero_centered_gamma=zero_centered_gamma,
                      params_dtype=torch.bfloat16, device=ctx.device)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        norm.weight.copy_((0.2 * torch.randn(dv, generator=gen) + (0.0 if zero_centered_gamma else 1.0)).to(ctx.device))
    module.out_norm = norm
    cu = [0, 1000, 1000, 2500, 4096]
    x, dout = hidden_inputs(cu[-1], 1, torch.bfloat16, 7, cfg.hidden_size, ctx.device)
    fla = get_backend("fla")

    unfused = replace(fla, fused_gated_rms_norm=lambda: None)  # the layer's own TE norm * silu(z)
    original = glue.choose_backend
    try:
        glue.choose_backend = lambda settings, layer, device: unfused
        want = run_layer(module, x, dout, thd_params(cu, device=ctx.device))
        glue.choose_backend = lambda settings, layer, device: fla
        glue.reset_settings(module)
        got = run_layer(module, x, dout, thd_params(cu, device=ctx.device))
    finally:
        glue.choose_backend = original
    errs = {"out": rel_l2(got[0], want[0]), "grad:hidden_states": rel_l2(got[1], want[1])}
    errs.update({f"grad:{n}": rel_l2(got[2][n], want[2][n]) for n in want[2]})
    return {"errors": errs, "log": [m for m in records if "gated norm" in m]}


@pytest.mark.gpu
@pytest.mark.megatron
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_layer_with_te_rmsnorm_takes_the_fused_norm_gpu(patched_megatron, rank_pool, zero_centered_gamma):
    _require_te_gpu()
    from gdn_cp.ops.accuracy import MEGATRON_BF16_REL_L2 as BF16_TOL

    for rank, res in enumerate(rank_pool(2, device="cuda").run(_te_layer_cases, zero_centered_gamma)):
        assert any("fused RMSNorm" in m for m in res["log"]), res["log"]
        for name, err in res["errors"].items():
            tol = BF16_TOL["out"] if name == "out" else BF16_TOL["grad"]
            assert err <= tol, (rank, zero_centered_gamma, name, err)


def test_selftest_te_case_on_the_cpu_stand_in():
    """``gdn-cp selftest --gpu``'s TransformerEngine case, run with the stand-in class and the fused
    reference on the CPU: the wiring (weight + 1, eps, gradients to the weight) gives TE's numbers."""
    import types

    from gdn_cp.cli.selftest import compare, te_gated_norm_case

    def make(d, eps, zero_centered_gamma, params_dtype, device):
        return RMSNorm(d, eps=eps, zero_centered_gamma=zero_centered_gamma, dtype=params_dtype).to(device)

    te = types.SimpleNamespace(RMSNorm=make)
    for zcg in (False, True):
        result = compare("te", te_gated_norm_case(te, _fused_reference(), zero_centered_gamma=zcg, device="cpu"), 1e-2)
        assert result.ok and set(result.errors) == {"y", "dx", "dz", "dweight"}, result.line()
