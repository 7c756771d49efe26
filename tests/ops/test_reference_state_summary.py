"""gdn_cp.ops.reference.chunk_state_summary (chunk maps composed in a tree) against the serial scan.

The serial summary of a sequence is the final state of a scan from ``[I | 0]`` over values
``[0 | v]`` (the scan is linear in (state, v) column by column); both are compared in fp64, values
and gradients, and the summary is checked to act as one: ``M S_in + S_ext`` equals the final state
of a scan from ``S_in``.
"""

from __future__ import annotations

import pytest
import torch

from gdn_cp.ops.reference.gated_delta_rule import chunk_gated_delta_rule, chunk_state_summary
from gdn_cp.ops.accuracy import max_rel

from .test_reference_gated_delta_rule import CU, make

TOL = 1e-11


def serial_summary(inputs, cu, chunk_size, use_qk_l2norm=True):
    q, k, v, g, beta = (inputs[n] for n in ("q", "k", "v", "g", "beta"))
    n, hv, dk = len(cu) - 1, v.shape[1], k.shape[2]
    v_aug = torch.cat([v.new_zeros(v.shape[0], hv, dk), v], dim=-1)
    eye = torch.eye(dk, dtype=v.dtype).expand(n, hv, dk, dk)
    init = torch.cat([eye, eye.new_zeros(n, hv, dk, v.shape[2])], dim=-1)
    _, final = chunk_gated_delta_rule(q, k, v_aug, g, beta, cu_seqlens=cu, initial_state=init,
                                      output_final_state=True, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)
    return final


def tree_summary(inputs, cu, chunk_size, use_qk_l2norm=True):
    return chunk_state_summary(inputs["k"], inputs["v"], inputs["g"], inputs["beta"], cu_seqlens=cu,
                               use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)


@pytest.mark.parametrize("chunk_size", [1, 3, 16, 64])
@pytest.mark.parametrize("heads", [(2, 4), (3, 3)], ids=["grouped", "equal"])
def test_tree_equals_serial_scan(chunk_size, heads):
    """Empty sequences, one shorter than a chunk, whole chunks and remainders; 1..91 chunks per
    sequence, so odd counts at every tree level."""
    inputs = make(Hk=heads[0], Hv=heads[1], seed=chunk_size)
    got, want = tree_summary(inputs, CU, chunk_size), serial_summary(inputs, CU, chunk_size)
    assert got.shape == want.shape == (len(CU) - 1, heads[1], 8, 8 + 6)
    assert max_rel(got, want) < TOL
    empty = [i for i, (a, b) in enumerate(zip(CU, CU[1:])) if a == b]
    assert torch.equal(got[empty, :, :, :8], torch.eye(8, dtype=got.dtype).expand(len(empty), heads[1], 8, 8))
    assert torch.equal(got[empty, :, :, 8:], torch.zeros_like(got[empty, :, :, 8:]))


def test_summary_acts_like_the_scan():
    """``M S_in + S_ext`` is the final state of the sequence scanned from S_in."""
    inputs = make(seed=5)
    summary = tree_summary(inputs, CU, 16)
    s_in = inputs["initial_state"]
    _, final = chunk_gated_delta_rule(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], cu_seqlens=CU,
                                      initial_state=s_in, output_final_state=True, chunk_size=16)
    assert max_rel(summary[..., :8] @ s_in + summary[..., 8:], final) < TOL


def test_gradients_equal_the_serial_scans():
    names = ("k", "v", "g", "beta")
    grads = []
    for fn in (tree_summary, serial_summary):
        inputs = make(seed=9)
        for n in names:
            inputs[n].requires_grad_(True)
        out = fn(inputs, CU, 16)
        weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
        (out * weight).sum().backward()
        grads.append({n: inputs[n].grad for n in names})
    for n in names:
        assert max_rel(grads[0][n], grads[1][n]) < 1e-10, n


def test_gradcheck_small():
    cu = [0, 3, 3, 10]
    inputs = make(cu=cu, Hk=1, Hv=2, Dk=3, Dv=2, seed=3)
    leaves = [inputs[n].clone().requires_grad_(True) for n in ("k", "v", "g", "beta")]
    fn = lambda k, v, g, b: chunk_state_summary(k, v, g, b, cu_seqlens=cu, chunk_size=2)  # noqa: E731
    assert torch.autograd.gradcheck(fn, leaves)


def test_fp32_inputs_give_fp32_summaries_near_fp64():
    inputs = make(seed=4)
    want = tree_summary(inputs, CU, 16)
    low = {k: (v.float() if v is not None else None) for k, v in inputs.items()}
    got = tree_summary(low, CU, 16)
    assert got.dtype == torch.float32 and max_rel(got.double(), want) < 1e-5


def test_bad_input_names_the_fix():
    inputs = make()
    with pytest.raises(ValueError, match=r"g must be \[T, Hv\]"):
        chunk_state_summary(inputs["k"], inputs["v"], inputs["g"][:, :1], inputs["beta"], cu_seqlens=CU)
    for chunk_size in (0, 1025):  # the same bound as chunk_gated_delta_rule's
        with pytest.raises(ValueError, match=r"chunk_size must be an int in \[1, 1024\]"):
            chunk_state_summary(inputs["k"], inputs["v"], inputs["g"], inputs["beta"], cu_seqlens=CU, chunk_size=chunk_size)
