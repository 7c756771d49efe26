"""The fused glue (gdn_cp.ops.fused): the conv + SiLU + q/k/v split + l2 norm step and the gates, against
the reference backend's conv, gdn-cp's split and FLA's l2norm rule done op by op, in fp64, forward and
backward: strided inputs (views of in_proj's output), packed sequences with empty slots, a halo, no rows.
On CUDA the same functions are compiled (tests/gpu/test_fused_glue_gpu.py)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # noqa: F401 - its config module, which tests below patch
import torch.nn.functional as F

from gdn_cp.layout import Boundaries
from gdn_cp.modes.local import conv_split, split_qkv
from gdn_cp.ops import GDNShape, get_backend
from gdn_cp.ops.fused import conv_silu_split, gates, glue
from gdn_cp.ops.reference.gated_delta_rule import l2norm
from gdn_cp_testing.results import REMOVED_GLUE_PATHS

SHAPE = GDNShape(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=6)
W = 4
REFERENCE = get_backend("reference")


def _op_by_op(x, weight, bias, cu, halo, shape, qk_l2norm):
    y = get_backend("reference").causal_conv1d(x, weight, bias, cu_seqlens=cu, halo=halo, activation="silu")
    q, k, v = split_qkv(y, shape, shape.num_k_heads, shape.num_v_heads)
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q, k, v


@pytest.mark.parametrize("halo", [False, True])
@pytest.mark.parametrize("qk_l2norm", [True, False])
@pytest.mark.parametrize("cu", [[0, 5, 5, 17, 30], [0, 30], [0, 1, 2, 30]])
def test_conv_silu_split_equals_the_ops_one_by_one(cu, halo, qk_l2norm):
    torch.manual_seed(len(cu) + 2 * halo)
    shape = GDNShape(2, 4, 8, 6, qk_l2norm=qk_l2norm)
    t, c = cu[-1], shape.conv_dim
    rows = torch.randn(t, c + 7, dtype=torch.float64)  # x is a strided view, as in the layer
    weight, bias = torch.randn(c, W, dtype=torch.float64), torch.randn(c, dtype=torch.float64)
    h = torch.randn(W - 1, c, dtype=torch.float64) if halo else None
    leaves = [a.requires_grad_(True) for a in (rows, weight, bias) + ((h,) if halo else ())]
    *got, kernel_l2norm = conv_split(rows[:, 3:3 + c], weight, bias, shape=shape, cu_seqlens=Boundaries(cu), halo=h,
                                     backend=REFERENCE, glue="auto")
    assert all(o.is_contiguous() for o in got) and not kernel_l2norm
    want = _op_by_op(rows[:, 3:3 + c], weight, bias, cu, h, shape, qk_l2norm)
    douts = [torch.randn_like(o) for o in want]
    grads_got = torch.autograd.grad(got, leaves, douts)
    grads_want = torch.autograd.grad(want, leaves, douts)
    for a, b in zip(tuple(got) + grads_got, tuple(want) + grads_want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_halo_changes_only_the_first_sequence():
    """The halo feeds the sequence that starts at row 0 and nothing after its end; a wrong mask fails here."""
    torch.manual_seed(1)
    c = SHAPE.conv_dim
    x, weight = torch.randn(12, c, dtype=torch.float64), torch.randn(c, W, dtype=torch.float64)
    positions = Boundaries([0, 5, 12]).positions("cpu")
    kw = dict(k_heads=2, v_heads=4, head_k_dim=8, head_v_dim=6, qk_l2norm=False)
    without = conv_silu_split(x, weight, None, positions, torch.zeros(W - 1, c, dtype=torch.float64), **kw)
    with_halo = conv_silu_split(x, weight, None, positions, torch.randn(W - 1, c, dtype=torch.float64), **kw)
    for a, b in zip(without, with_halo):
        assert not torch.allclose(a[:3], b[:3]) and torch.equal(a[3:], b[3:])  # rows 0-2 read the halo


def test_positions_of_packed_rows():
    cu = Boundaries([0, 3, 3, 7, 8])
    assert cu.positions("cpu").tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    assert cu.positions("cpu").dtype == torch.int32 and cu.positions("cpu") is cu.positions("cpu")


def test_no_rows():
    x = torch.zeros(0, SHAPE.conv_dim, dtype=torch.bfloat16)
    q, k, v, _ = conv_split(x, torch.randn(SHAPE.conv_dim, W), None, shape=SHAPE, cu_seqlens=[0, 0], backend=REFERENCE,
                            glue="auto")
    assert (q.shape, k.shape, v.shape) == ((0, 2, 8), (0, 2, 8), (0, 4, 6)) and q.dtype == torch.bfloat16


@pytest.mark.parametrize("halo", [False, True])
def test_bf16_rounds_where_the_ops_one_by_one_round(halo):
    """bf16 in, bf16 out: the conv in fp32 rounded to bf16 (FLA's conv, stock), then the l2 norm in fp32
    rounded to bf16 (FLA's l2norm): the same bits as the ops one by one, forward and backward. (Rounding
    once instead, from the fp32 conv, moved a bf16 training run of headwise 20% from CP=1's loss by
    iteration 8 while FLA's path stayed within 1e-3: tiny systematic differences add up.)"""
    torch.manual_seed(2)
    c = SHAPE.conv_dim
    leaves = [torch.randn(40, c).bfloat16(), torch.randn(c, W).bfloat16(), torch.randn(c).bfloat16()]
    leaves += [torch.randn(W - 1, c).bfloat16()] if halo else []
    leaves = [t.requires_grad_(True) for t in leaves]
    h = leaves[3] if halo else None
    cu = [0, 17, 40]
    got = conv_split(leaves[0], leaves[1], leaves[2], shape=SHAPE, cu_seqlens=cu, halo=h, backend=REFERENCE,
                     glue="auto")[:3]
    want = _op_by_op(leaves[0], leaves[1], leaves[2], cu, h, SHAPE, True)
    douts = [torch.randn_like(o) for o in want]
    for a, b in zip(tuple(got) + torch.autograd.grad(got, leaves, douts), tuple(want) + torch.autograd.grad(want, leaves, douts)):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_gates_round_exp_a_log_as_stock():
    """``-exp(A_log)`` in A_log's dtype (bf16 in a bf16 model), as stock computes it."""
    a_log = torch.tensor([0.3, 1.7, 2.9, 0.01], dtype=torch.bfloat16)
    alpha = torch.ones(3, 4, dtype=torch.bfloat16)
    g, _ = gates(alpha, alpha, a_log, torch.zeros(4, dtype=torch.bfloat16))
    assert torch.equal(g, -a_log.exp() * F.softplus(alpha.float()))
    assert not torch.equal(g, -a_log.float().exp() * F.softplus(alpha.float()))


def test_gates_are_stocks_expression():
    torch.manual_seed(3)
    rows = torch.randn(9, 20, dtype=torch.bfloat16, requires_grad=True)
    a_log = torch.rand(4, dtype=torch.bfloat16, requires_grad=True)
    dt_bias = torch.randn(4, dtype=torch.bfloat16, requires_grad=True)
    _, beta_raw, alpha = torch.split(rows, [12, 4, 4], dim=-1)
    g, beta = gates(alpha, beta_raw, a_log, dt_bias)
    want_g = -a_log.exp() * F.softplus(alpha.float() + dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == torch.bfloat16
    torch.testing.assert_close(g, want_g, rtol=0, atol=0)
    torch.testing.assert_close(beta, beta_raw.sigmoid(), rtol=0, atol=0)


def test_the_unfused_path_runs_the_backends_conv_and_the_kernel_normalizes(monkeypatch):
    """The ``unfused`` glue (GDN_CP_GLUE=unfused on a GPU) takes the backend's conv and leaves the l2 norm
    to the scan kernel: the core's output and gradients are the same as the fused step's (fp64)."""
    from gdn_cp.modes import local

    class Recording:
        calls = 0

        def causal_conv1d(self, *a, **kw):
            Recording.calls += 1
            return REFERENCE.causal_conv1d(*a, **kw)

        def chunk_gated_delta_rule(self, *a, **kw):
            return REFERENCE.chunk_gated_delta_rule(*a, **kw)

        def repeats_key_heads(self):
            return False

    torch.manual_seed(5)
    cu, c = [0, 9, 9, 30], SHAPE.conv_dim
    leaves = [torch.randn(30, c, dtype=torch.float64), -torch.rand(30, 4, dtype=torch.float64),
              torch.rand(30, 4, dtype=torch.float64), torch.randn(c, W, dtype=torch.float64)]
    leaves = [t.requires_grad_(True) for t in leaves]

    def core():
        o = local.local_core(*leaves, None, shape=SHAPE, cu_seqlens=cu, backend=Recording(), glue="unfused")
        return [o] + list(torch.autograd.grad(o.sum(), leaves))

    fused = core()
    assert Recording.calls == 0  # on the CPU every setting runs the fused step's plain math
    monkeypatch.setattr(local, "glue_path", lambda setting, x: "unfused")
    by_backend = core()
    assert Recording.calls == 1
    for a, b in zip(fused, by_backend):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("switch, repeats, heads_read", [(False, True, 2), (True, True, 4), (True, False, 2)])
def test_key_heads_are_repeated_by_the_glue_only_for_a_backend_that_repeats_them(monkeypatch, switch, repeats,
                                                                                  heads_read):
    """``REPEAT_KEY_HEADS_IN_CONV`` on and a backend that repeats q and k for its kernel (FLA 0.4.2): the glue hands
    them over repeated, the core reads 4 key heads (Hk = Hv), and the output and every gradient are what they are
    with the switch off (fp64); off, or for a backend that reads grouped heads, q and k keep their 2 heads."""
    from gdn_cp.modes import local

    class Backend:
        def __init__(self):
            self.heads = []

        def repeats_key_heads(self):
            return repeats

        def chunk_gated_delta_rule(self, q, k, *a, **kw):
            self.heads.append(q.shape[1])
            return REFERENCE.chunk_gated_delta_rule(q, k, *a, **kw)

    torch.manual_seed(6)
    cu, c = [0, 9, 9, 30], SHAPE.conv_dim
    leaves = [torch.randn(30, c, dtype=torch.float64), -torch.rand(30, 4, dtype=torch.float64),
              torch.rand(30, 4, dtype=torch.float64), torch.randn(c, W, dtype=torch.float64)]
    leaves = [t.requires_grad_(True) for t in leaves]

    def core(backend):
        o = local.local_core(*leaves, None, shape=SHAPE, cu_seqlens=cu, backend=backend, glue="auto")
        return [o] + list(torch.autograd.grad(o.sum(), leaves))

    plain = core(REFERENCE)
    monkeypatch.setattr(glue, "REPEAT_KEY_HEADS_IN_CONV", switch)
    backend = Backend()
    for a, b in zip(core(backend), plain):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert backend.heads == [heads_read]


class _FakeCuda:
    """Stands in for a CUDA tensor in glue_path (it reads the device type and the dtype only)."""

    def __init__(self, dtype):
        self.device, self.dtype = torch.device("cuda"), dtype


@pytest.mark.parametrize("setting, dtype, want", [
    ("auto", torch.bfloat16, glue.CUDA_DEFAULT), ("triton", torch.bfloat16, "triton"),
    ("triton", torch.float64, "eager"), ("unfused", torch.float64, "unfused"), ("compiled", torch.float16, "compiled"),
])
def test_glue_path_on_cuda(setting, dtype, want):
    with torch._dynamo.config.patch(disable=False):  # other tests' CPU shims disable dynamo process-wide
        assert glue.glue_path(setting, _FakeCuda(dtype)) == want


def test_glue_path_off_cuda_is_the_plain_math_and_compiled_without_dynamo_too():
    for setting in ("auto", "triton", "compiled", "unfused"):
        assert glue.glue_path(setting, torch.zeros(1)) == "eager"
    with torch._dynamo.config.patch(disable=True):
        assert glue.glue_path("compiled", _FakeCuda(torch.bfloat16)) == "eager"


def test_a_bad_glue_setting_names_the_variable():
    from gdn_cp.modes.settings import Settings

    with pytest.raises(ValueError, match="GDN_CP_GLUE"):
        Settings.from_environment({"GDN_CP_GLUE": "fast"}, mode="chunkwise")
    assert Settings.from_environment({"GDN_CP_GLUE": "triton"}, mode="chunkwise").glue == "triton"


@pytest.mark.parametrize("path", REMOVED_GLUE_PATHS)
def test_a_removed_glue_path_is_refused_naming_the_value_and_the_choices(path):
    """A path since removed (``gdn_cp_testing.results.REMOVED_GLUE_PATHS``) is no setting: set in the environment or
    given as ``Settings(glue=...)``, a ValueError names it and every value that is one."""
    from gdn_cp.env import GLUE_CHOICES
    from gdn_cp.modes.settings import Settings

    for make in (lambda: Settings.from_environment({"GDN_CP_GLUE": path}, mode="chunkwise"),
                 lambda: Settings(mode="chunkwise", glue=path)):
        with pytest.raises(ValueError) as refused:
            make()
        assert f"{path!r}" in str(refused.value) and ", ".join(GLUE_CHOICES) in str(refused.value), refused.value


def test_every_glue_path_is_a_setting_with_its_steps_and_words():
    """A path in GLUE_PATHS is a value of GDN_CP_GLUE, runs its gates and conv (all but ``unfused``, which takes
    the backend's conv), and is named in the log line that says which path a layer runs."""
    from gdn_cp.env import GLUE_CHOICES
    from gdn_cp.modes.local import _GLUE_WORDS
    from gdn_cp.ops.fused import GLUE_PATHS, glue

    assert GLUE_CHOICES == ("auto", *GLUE_PATHS)
    assert set(glue._GATES) == {"eager", *GLUE_PATHS}
    assert set(glue._CONV) == {"eager", *GLUE_PATHS} - {"unfused"}
    assert set(_GLUE_WORDS) == {"eager", *GLUE_PATHS}
