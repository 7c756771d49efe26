"""GDN computes SiLU (its conv and output gate: FLA's kernels, gdn-cp's modes), so a GDN layer with
another ``activation_func`` is refused, never computed: when the config is built (configs that
build GDN layers), in Megatron-LM's ``validate_args`` (``test_thd_split.py``,
``test_training_args.py``), and at the first call of every GDN layer (hybrid models, whose config
does not see the pattern), before any collective, on the stock CP=1 path too."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from gdn_cp.megatron.config import check_gdn_activation, configure_linear_cp_mode

GELU = ("TransformerConfig.activation_func=gelu, but gated delta net layers need SiLU: their conv and output gate "
        "compute SiLU (FLA's kernels, gdn-cp's modes), so another activation would not be the configured one. "
        "Fix: Megatron-LM: add --swiglu; Python: TransformerConfig(..., activation_func=torch.nn.functional.silu).")


def _config(act, variant="gated_delta_net", **extra):
    return types.SimpleNamespace(linear_cp_mode="chunkwise", linear_num_key_heads=4, linear_num_value_heads=8,
                                 tensor_model_parallel_size=1, context_parallel_size=2,
                                 experimental_attention_variant=variant, activation_func=act, **extra)


def swish(x):
    return x * torch.sigmoid(x)


def silu(x):  # named silu, computes something else
    return torch.relu(x)


def test_config_refuses_an_activation_other_than_silu():
    assert configure_linear_cp_mode(_config(F.silu)) == "chunkwise"
    assert configure_linear_cp_mode(_config(swish)) == "chunkwise"  # SiLU under FLA's other name
    with pytest.raises(ValueError) as ei:
        configure_linear_cp_mode(_config(F.gelu))
    assert str(ei.value) == GELU
    refused = {
        silu: "activation_func=silu (named 'silu', but it does not compute SiLU), but gated delta net layers need SiLU",
        (lambda x: x * torch.sigmoid(x)): "activation_func=<lambda>, but",  # not a name FLA's conv takes
        torch.nn.SiLU(): "activation_func=SiLU(), but",  # stock's act_fn.__name__ fails on a module
        None: "activation_func=None, but",
    }
    for act, start in refused.items():
        with pytest.raises(ValueError) as ei:
            configure_linear_cp_mode(_config(act))
        assert str(ei.value).startswith("TransformerConfig." + start), str(ei.value)
    no_field = _config(F.silu)
    del no_field.activation_func  # TransformerConfig's default is gelu
    with pytest.raises(ValueError, match="activation_func=gelu, but"):
        configure_linear_cp_mode(no_field)
    # a hybrid model's config does not see its pattern (its GDN layers check); other configs build no GDN
    assert configure_linear_cp_mode(_config(F.gelu, variant=None, is_hybrid_model=True)) == "chunkwise"
    assert configure_linear_cp_mode(_config(F.gelu, variant=None)) == "chunkwise"
    assert configure_linear_cp_mode(_config(F.gelu, variant="dsa")) == "chunkwise"
    with pytest.raises(ValueError, match=r"^GatedDeltaNet \(layer 3\): config\.activation_func=gelu, but"):
        check_gdn_activation(F.gelu, owner="GatedDeltaNet (layer 3): config.")


@pytest.mark.megatron
def test_transformer_config_refuses_gelu(patched_megatron):
    from gdn_cp_testing.megatron.layer import install_cpu_shims, make_config

    install_cpu_shims()
    with pytest.raises(ValueError) as ei:
        make_config(2, "chunkwise", torch.float64, activation_func=F.gelu)
    assert str(ei.value) == GELU
    hybrid = make_config(2, "chunkwise", torch.float64, activation_func=F.gelu, experimental_attention_variant=None,
                         is_hybrid_model=True)
    assert hybrid.activation_func is F.gelu


def _first_call(ctx):
    """A hybrid model's GDN layer with gelu (its config accepts it): every call refused, SBHD and THD,
    at CP=1 (SBHD: the stock path below the hand-over) and CP=world, before in_proj and before any
    collective; the same layer with SiLU runs."""
    from gdn_cp_testing.megatron.layer import build_gdn, make_config, rank_groups, thd_params
    from gdn_cp_testing.packings import thd_case

    out = {}
    for cp, group in ((1, rank_groups()["self"]), (ctx.world_size, rank_groups()["world"])):
        config = make_config(cp, "chunkwise", torch.float64, activation_func=F.gelu,
                             experimental_attention_variant=None, is_hybrid_model=True, linear_cp_thd_split="per_document")
        module = build_gdn(config, group)
        in_proj_calls = []
        module.in_proj.register_forward_pre_hook(lambda m, args: in_proj_calls.append(1))
        cu_pad, cu_act = thd_case(cp)
        hidden = config.hidden_size
        for layout, x, psp in (("sbhd", torch.zeros(24, 2, hidden, dtype=torch.float64), None),
                               ("thd", torch.zeros(cu_pad[-1] // cp, 1, hidden, dtype=torch.float64),
                                thd_params(cu_pad, cu_act))):
            before = ctx.collective_count()
            try:
                module(x, None, packed_seq_params=psp)
                got = "no error"
            except ValueError as e:
                got = str(e)
            out[(cp, layout)] = (got, ctx.collective_count() - before, len(in_proj_calls))
        module.act_fn = F.silu  # the same layer with SiLU runs
        y, _ = module(torch.zeros(24, 2, hidden, dtype=torch.float64), None)
        out[(cp, "silu")] = tuple(y.shape)
    return out


@pytest.mark.megatron
def test_hybrid_gdn_layer_refuses_gelu_at_its_first_call(patched_megatron, rank_pool):
    for rank, res in enumerate(rank_pool(2).run(_first_call)):
        for cp in (1, 2):
            for layout in ("sbhd", "thd"):
                msg, collectives, in_proj = res[(cp, layout)]
                assert msg.startswith("GatedDeltaNet (layer 1): config.activation_func=gelu, but gated delta net "
                                      "layers need SiLU"), (rank, cp, layout, msg)
                assert "add --swiglu" in msg and collectives == 0 and in_proj == 0, (rank, cp, layout, res)
            assert res[(cp, "silu")][1] == 2, res
