"""The real patched megatron-core 0.19.2 GatedDeltaNet at CP=2 and CP=4 equals the same module at
CP=1 on the full sequence: outputs, the hidden_states gradient and the gradient of every parameter
(summed over the CP ranks, as Megatron's DP-CP gradient all-reduce does), for every
``linear_cp_mode``, SBHD (zigzag along S) and packed THD (batch 1, sequences straddling the
contiguous rank boundaries, an empty padding slot, GLOBAL padded boundaries).

Deterministic mode (the reference backend), gloo ranks on the CPU.

Precision. Megatron accepts ``params_dtype=torch.float64``, so the main parity runs in fp64 with a
tolerance of 1e-10: any layout, halo or state bug shows up far above rounding. Stock 0.19.2's
deterministic core (``torch_chunk_gated_delta_rule``) computes in fp32 whatever the input dtype, so
the fp64 SBHD baseline at CP=1 is the same module's gdn-cp path at CP=1 (``gated_delta_net_forward``
called directly: the reference backend on the whole sequence); THD at CP=1 takes that path anyway.
An fp32 run of every case compares against the module exactly as a user gets it at CP=1 (SBHD:
the stock code path), at rel err <= 1e-5 (different kernels: fp32 rounding only). That the gdn-cp
path at CP=1 is itself right is pinned by test_gdn_megatron_features (THD at CP=1 vs stock on each
sequence; patched headwise vs stock at CP=2).
"""

from __future__ import annotations

import pytest
import torch

from gdn_cp_testing.megatron.parity import MODES, parity_case
from gdn_cp.ops.accuracy import CP_VS_CP1_MAX_REL as TOL


def _all_cases(ctx, dtypes):
    return {
        (layout, str(dtype)): parity_case(ctx.rank, ctx.world_size, layout, dtype, MODES)
        for layout in ("sbhd", "thd")
        for dtype in dtypes
    }


def _check(results, tol_for, what=""):
    bad = []
    for rank, per_case in enumerate(results):
        for case, per_mode in per_case.items():
            for mode, errs in per_mode.items():
                tol = tol_for(case)
                over = {k: v for k, v in errs.items() if not v <= tol}
                if over:
                    bad.append(f"rank {rank} {case} {mode}: over {tol}: {over}")
    assert not bad, f"{what}\n" + "\n".join(bad)


@pytest.mark.megatron
@pytest.mark.parametrize("world", [2, 4])
def test_gdn_cp_equals_cp1(patched_megatron, rank_pool, world):
    """fp64 (tol 1e-10) and fp32 (tol 1e-5); SBHD and THD; headwise, chunkwise, all_gather."""
    results = rank_pool(world).run(_all_cases, (torch.float64, torch.float32))
    _check(results, lambda case: TOL[torch.float64] if "float64" in case[1] else TOL[torch.float32],
           f"CP={world} vs CP=1")
    # Every parameter was compared (a new parameter cannot slip through unchecked).
    names = {k for r in results for pm in r.values() for e in pm.values() for k in e}
    for p in ("dt_bias", "A_log", "in_proj.weight", "in_proj.bias", "conv1d.weight", "conv1d.bias",
              "out_norm.weight", "out_proj.weight", "out_proj.bias"):
        assert f"grad:{p}" in names, sorted(names)


# ------------------------------------------------------------------------------------------
# the comparison above can fail
# ------------------------------------------------------------------------------------------
def _mutated(ctx, which):
    import gdn_cp.megatron.segment as glue
    import gdn_cp.modes.chunkwise as chunkwise_module

    saved = (chunkwise_module.initial_state_from_summaries, glue.LayerSegment.__dict__["conv_bias"])
    try:
        if which == "drop_incoming_state":
            orig = chunkwise_module.initial_state_from_summaries
            chunkwise_module.initial_state_from_summaries = lambda *a, **k: orig(*a, **k) * 0
            modes = ("chunkwise",)
        else:  # "conv_bias_not_trained": the core gets the layer's conv bias cut off from its graph
            orig_bias = glue.LayerSegment.__dict__["conv_bias"]

            def conv_bias(self):
                bias = orig_bias.fget(self)
                return None if bias is None else bias.detach()

            glue.LayerSegment.conv_bias = property(conv_bias)
            modes = ("all_gather",)
        return parity_case(ctx.rank, ctx.world_size, "thd", torch.float64, modes)
    finally:
        chunkwise_module.initial_state_from_summaries, glue.LayerSegment.conv_bias = saved


@pytest.mark.megatron
@pytest.mark.parametrize("which,quantity", [("drop_incoming_state", "out"),
                                            ("conv_bias_not_trained", "grad:conv1d.bias")])
def test_parity_check_can_fail(patched_megatron, rank_pool, which, quantity):
    results = rank_pool(2).run(_mutated, which)
    worst = max(errs[quantity] for r in results for errs in r.values())
    assert worst > 1e-3, f"{which} went unnoticed ({quantity} error {worst})"
