"""A model's initial weights do not depend on what the global random generators drew before it was
built: the CP=N run starts from CP=1's model.

Megatron-LM's ``set_jit_fusion_options`` draws ``torch.rand`` tensors of (seq_length / cp) x
micro_batch_size x ffn_hidden elements from the global CUDA generator before the model is built,
so anything a model draws from that generator starts at a CP- and micro-batch-dependent offset.
Stock megatron-core 0.19.2 drew GDN's ``conv1d`` there (``nn.Conv1d(device=cuda)``); the patch
redraws it from Megatron's model-parallel RNG stream (``megatron/core/ssm/gated_delta_net/common.py``).

These tests build Megatron's GDN models with Megatron's own initialization twice, drawing a
different amount from the global generator before each build, and find every parameter identical.
On the CPU the models are built from local modules and the CPU generator stands in for the global
CUDA one (Megatron's RNG tracker swaps the CPU generator's state, as it swaps the CUDA generator's
on a GPU); the GPU test builds the TransformerEngine specs Megatron-LM's scripts use.
"""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch

SEED = 1234
DRAWS = (0, 3_000_000)  # elements drawn from the global generator before each build (> one Philox round)


@contextlib.contextmanager
def _cpu_model_parallel_rng(seed: int):
    """Megatron's CUDA RNG tracker, on the CPU: its model-parallel stream seeded as
    ``model_parallel_cuda_manual_seed(seed)`` seeds it (seed + 2718 at TP rank 0), and ``fork()``
    swapping the CPU generator's state in and out."""
    import megatron.core.tensor_parallel.random as mrandom

    saved = mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    tracker.states_[mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME] = torch.Generator().manual_seed(seed + 2718).get_state()
    tracker.seeds_.add(seed + 2718)
    try:
        yield
    finally:
        tracker.reset()
        mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state = saved


def _local_gpt(config, pg):
    """GPTModel: two GDN + MLP layers and one softmax-attention + MLP layer, local modules."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from gdn_cp_testing.megatron.model import MAX_SEQUENCE_LENGTH, VOCAB_SIZE, gdn_layer_spec

    layers = [gdn_layer_spec(), gdn_layer_spec(), get_gpt_layer_local_spec(normalization="RMSNorm")]
    return GPTModel(config, TransformerBlockSubmodules(layer_specs=layers), vocab_size=VOCAB_SIZE,
                    max_sequence_length=MAX_SEQUENCE_LENGTH, position_embedding_type="none", pg_collection=pg)


def _local_hybrid(config, pg):
    """HybridModel ``G*-G-``: GDN, softmax attention and MLP layers, local modules."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.transformer.identity_op import IdentityOp

    from gdn_cp_testing.megatron.model import MAX_SEQUENCE_LENGTH, VOCAB_SIZE, hybrid_stack_spec

    spec = hybrid_stack_spec()
    attention = get_gpt_layer_local_spec(normalization="RMSNorm")
    attention.submodules.mlp = attention.submodules.pre_mlp_layernorm = IdentityOp  # '-' layers are the MLPs
    spec.submodules.attention_layer = attention
    return HybridModel(config, spec, hybrid_layer_pattern="G*-G-", vocab_size=VOCAB_SIZE,
                       max_sequence_length=MAX_SEQUENCE_LENGTH, position_embedding_type="none", pg_collection=pg)


@contextlib.contextmanager
def _stock_conv1d_init():
    """The mutation: GDN's conv1d keeps what ``nn.Conv1d`` drew from the global generator at
    construction, as in stock megatron-core 0.19.2 (the patched ``reset_parameters`` undone)."""
    from megatron.core.ssm.gated_delta_net.common import _GDNBase

    patched = _GDNBase.reset_parameters

    def reset_parameters(self):
        constructed = [p.detach().clone() for p in self.conv1d.parameters()]
        patched(self)
        with torch.no_grad():
            for p, value in zip(self.conv1d.parameters(), constructed):
                p.copy_(value)

    _GDNBase.reset_parameters = reset_parameters
    try:
        yield
    finally:
        _GDNBase.reset_parameters = patched


def _weights_after_draws(ctx, kind: str, stock: bool = False) -> dict:
    """Per entry of :data:`DRAWS`: the model's parameters built after that many global draws, and a
    plain ``nn.Conv1d`` built right after the draws (what stock's conv1d was). ``stock``: built with
    :func:`_stock_conv1d_init`."""
    from gdn_cp_testing.megatron.layer import rank_groups
    from gdn_cp_testing.megatron.model import install_model_stand_ins, model_config, model_pg_collection

    install_model_stand_ins("cpu")
    if stock:
        with _stock_conv1d_init():
            return _weights_after_draws(ctx, kind)
    build = {"gpt": _local_gpt, "hybrid": _local_hybrid}[kind]
    out = {}
    for n in DRAWS:
        torch.manual_seed(SEED)
        torch.rand(n)  # Megatron-LM's JIT warm-up, of a CP- and micro-batch-dependent size
        stock_conv1d = torch.nn.Conv1d(8, 8, 4, groups=8).weight.detach().clone()
        with _cpu_model_parallel_rng(SEED):
            config = model_config(kind, 1, dtype=torch.float32, perform_initialization=True,
                                  use_cpu_initialization=False, num_layers=3 if kind == "gpt" else 5)
            model = build(config, model_pg_collection(rank_groups()["self"]))
        out[n] = {"stock_conv1d": stock_conv1d, **{k: v.detach().clone() for k, v in model.named_parameters()}}
    return out


@pytest.mark.megatron
@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
def test_every_parameter_independent_of_earlier_global_draws(patched_megatron, rank_pool, kind):
    (first, second), *_ = [tuple(r.values()) for r in rank_pool(2).run(_weights_after_draws, kind)]
    # the draws move what the global generator gives (what stock megatron-core's conv1d was drawn from) ...
    assert not torch.equal(first["stock_conv1d"], second["stock_conv1d"])
    # ... and no parameter of the patched model
    assert first.keys() == second.keys()
    names = [k for k in first if k != "stock_conv1d"]
    assert any("conv1d.weight" in k for k in names) and any("linear_qkv" in k for k in names), names
    differ = [k for k in names if not torch.equal(first[k], second[k])]
    assert not differ, f"{kind}: these parameters depend on what the global generator drew before the build: {differ}"
    # Megatron's initialization really ran (not the zeros / ones a skipped init leaves)
    conv = [first[k] for k in names if k.endswith("conv1d.weight")]
    assert all(w.std() > 0.05 for w in conv), [w.std() for w in conv]


@pytest.mark.megatron
def test_the_comparison_sees_stock_conv1d_init(patched_megatron, rank_pool):
    first, second = rank_pool(2).run(_weights_after_draws, "hybrid", True)[0].values()
    differ = [k for k in first if k != "stock_conv1d" and not torch.equal(first[k], second[k])]
    assert differ and all("conv1d" in k for k in differ), differ


def _mamba_weights_after_draws(ctx) -> dict:
    """MambaMixer (megatron-core 0.19.2) built twice after different global draws. mamba_ssm (its
    kernels) and einops are not installed on the test machines: their import flags are set for the
    build only, and its gated RMSNorm is left out (``rmsnorm=False``); construction needs none of them."""
    import megatron.core.ssm.mamba_context_parallel as mamba_cp
    import megatron.core.ssm.mamba_mixer as mamba_mixer
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from gdn_cp_testing.megatron.layer import rank_groups
    from gdn_cp_testing.megatron.model import install_model_stand_ins, model_config, model_pg_collection

    install_model_stand_ins("cpu")
    out = {}
    saved = mamba_mixer.HAVE_MAMBA_SSM, mamba_mixer.HAVE_EINOPS, mamba_cp.HAVE_EINOPS
    mamba_mixer.HAVE_MAMBA_SSM = mamba_mixer.HAVE_EINOPS = mamba_cp.HAVE_EINOPS = True
    try:
        for n in DRAWS:
            torch.manual_seed(SEED)
            torch.rand(n)
            with _cpu_model_parallel_rng(SEED):
                config = model_config("hybrid", 1, dtype=torch.float32, perform_initialization=True,
                                      use_cpu_initialization=False, mamba_num_heads=4, mamba_head_dim=16,
                                      mamba_state_dim=8, mamba_num_groups=2)
                mixer = MambaMixer(config, MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
                                   d_model=config.hidden_size, rmsnorm=False,
                                   pg_collection=model_pg_collection(rank_groups()["self"]))
            out[n] = {k: v.detach().clone() for k, v in mixer.named_parameters()}
    finally:
        mamba_mixer.HAVE_MAMBA_SSM, mamba_mixer.HAVE_EINOPS, mamba_cp.HAVE_EINOPS = saved
    return out


@pytest.mark.megatron
def test_mamba_mixer_independent_of_earlier_global_draws(patched_megatron, rank_pool):
    """Mamba layers in a hybrid pattern: megatron-core 0.19.2 already draws every Mamba parameter
    (conv1d included) under the RNG tracker; this holds it to that."""
    first, second = rank_pool(2).run(_mamba_weights_after_draws)[0].values()
    assert any("conv1d" in k for k in first), sorted(first)
    differ = [k for k in first if not torch.equal(first[k], second[k])]
    assert not differ, f"MambaMixer parameters that depend on earlier global draws: {differ}"


# ------------------------------------------------------------------------------------------------
# GPU: Megatron's TransformerEngine specs, the global CUDA generator
# ------------------------------------------------------------------------------------------------
def _te_models(pg) -> dict:
    """What Megatron-LM's scripts build: HybridModel from ``hybrid_stack_spec`` (``G*-G-``: GDN, TE
    attention, MLP) and GPTModel with GDN layers (``--experimental-attention-variant gated_delta_net
    --linear-attention-freq 3``), bf16, Megatron's own initialization on the GPU."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_block_with_experimental_attention_variant_spec,
    )
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from gdn_cp_testing.megatron.layer import make_config

    sizes = dict(perform_initialization=True, use_cpu_initialization=False, deterministic_mode=False, hidden_size=128,
                 ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2, bf16=True)
    common = dict(vocab_size=1024, max_sequence_length=4096, position_embedding_type="none", pg_collection=pg)
    hybrid_config = make_config(1, "chunkwise", torch.bfloat16, num_layers=5, is_hybrid_model=True,
                                experimental_attention_variant=None, linear_attention_freq=None, **sizes)
    gpt_config = make_config(1, "chunkwise", torch.bfloat16, num_layers=3, linear_attention_freq=3, **sizes)
    return {"hybrid": HybridModel(hybrid_config, hybrid_stack_spec, hybrid_layer_pattern="G*-G-", **common),
            "gpt": GPTModel(gpt_config, get_transformer_block_with_experimental_attention_variant_spec(gpt_config),
                            **common)}


def _te_weights_after_draws(ctx) -> dict:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from gdn_cp_testing.megatron.layer import install_gpu_shims, rank_groups
    from gdn_cp_testing.megatron.model import model_pg_collection

    from gdn_cp_testing.megatron.training import megatron_parallel_state

    install_gpu_shims()
    out = {}
    # Megatron's parallel state as Megatron-LM's initialize_megatron leaves it (one rank: TP = PP = CP = 1):
    # the seeding and TE's modules read its groups (tensor, pipeline, expert) without a pg_collection
    with megatron_parallel_state(1):
        for n in DRAWS:
            torch.manual_seed(SEED)
            # Megatron-LM's _set_random_seed, then its JIT warm-up's draws from the global CUDA generator:
            model_parallel_cuda_manual_seed(SEED)
            torch.rand(n, device="cuda")
            models = _te_models(model_pg_collection(rank_groups()["self"]))
            out[n] = {f"{kind}.{k}": v.detach().float().cpu().clone()
                      for kind, m in models.items() for k, v in m.named_parameters()}
    return out


def _te_ready() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    if importlib.util.find_spec("transformer_engine") is None:
        return "needs TransformerEngine (Megatron's GDN and hybrid specs are TE-only)"
    return None


@pytest.mark.gpu
@pytest.mark.megatron
@pytest.mark.skipif(_te_ready() is not None, reason=_te_ready() or "")
def test_te_models_independent_of_earlier_global_draws(patched_megatron, rank_pool):
    first, second = rank_pool(1, "cuda").run(_te_weights_after_draws)[0].values()
    assert any("conv1d.weight" in k for k in first) and any(k.startswith("hybrid.") for k in first)
    differ = [k for k in first if not torch.equal(first[k], second[k])]
    assert not differ, f"parameters that depend on earlier global CUDA draws: {differ}"
