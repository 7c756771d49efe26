"""Megatron-Core 0.19.2 language models whose sequence mixers are the real (patched)
GatedDeltaNet, built from local modules (no TransformerEngine), run as Megatron-LM runs them.

* ``gpt``: ``GPTModel`` with a hand-written TransformerLayer spec: local RMSNorm -> GatedDeltaNet
  (ColumnParallelLinear in_proj, local RMSNorm out_norm, RowParallelLinear out_proj: the
  submodules of :mod:`.layer`) -> residual -> local RMSNorm -> Megatron's local MLP spec
  -> residual; a final RMSNorm and the output layer; ``position_embedding_type="none"`` (GDN
  needs no positions). Megatron's own GDN block spec
  (``get_transformer_block_with_experimental_attention_variant_spec``) needs TransformerEngine.
* ``hybrid``: ``HybridModel`` with a local-module stack spec (``gdn_layer``: the same GDN
  TransformerLayer without MLP; ``mlp_layer``: an ``MLPLayer`` with a local pre-MLP norm) and the
  pattern :data:`HYBRID_PATTERN`. Megatron's stock hybrid stack spec is TransformerEngine-only.
* ``hybrid_attn``: the ``hybrid`` stack spec plus an ``attention_layer`` of local modules whose core
  attention is :class:`gdn_cp_testing.megatron.attention.ThdCpAttention` (TransformerEngine's THD
  attention under CP, re-derived in torch for the CPU), pattern :data:`TE_HYBRID_PATTERN`.
* ``hybrid_moe``: ``hybrid_attn`` plus a ``moe_layer`` (Megatron's MoE of local experts: router, top-2,
  alltoall token dispatcher, SequentialMLP), pattern :data:`MOE_HYBRID_PATTERN`.
* ``hybrid_te`` (GPU, TransformerEngine): ``HybridModel`` with Megatron's own stack spec
  (``megatron.core.models.hybrid.hybrid_layer_specs.hybrid_stack_spec``: TE linears and norms, TE
  attention) and the pattern :data:`TE_HYBRID_PATTERN` (GDN, MLP, attention, MLP); attention CP
  through all-to-all (``cp_comm_type='a2a'``: ranks that share one GPU talk over gloo, which has no
  point-to-point for CUDA tensors).

:func:`model_config` gives every model the same small shape; :func:`build_model` seeds every
parameter from its name (:func:`set_model_params`), so every rank and every CP size starts from
identical weights.

Stand-ins, for test processes only (:func:`install_model_stand_ins`; never in a training job):

* :func:`gdn_cp_testing.megatron.layer.install_cpu_shims` on the CPU (see there);
* ``HybridStack`` builds its final norm as ``TENorm`` whatever the spec says (0.19.2,
  ``hybrid_block.py``), which raises without TransformerEngine: ``hybrid_block.TENorm`` becomes
  Megatron's local norm (``LocalSpecProvider().layer_norm``: torch's RMSNorm / LayerNorm as the
  config says), the norm TENorm computes;
* MoE's alltoall token dispatcher asks for its split sizes as NumPy arrays, which megatron-core 0.19.2
  makes only of CUDA tensors (``maybe_move_tensor_to_cpu``): on the CPU a host tensor becomes one too;
* Megatron's cross entropy casts the logits to fp32 (``VocabParallelCrossEntropy.
  calculate_logits_max`` calls ``.float()``): right for bf16, but it puts an fp32 floor (~1e-7)
  under an fp64 comparison. fp64 logits stay fp64 under the stand-in; every other dtype is cast
  as before. Nothing else of the loss changes.
"""

from __future__ import annotations

import math
import re
import zlib
from typing import Optional

import torch

from gdn_cp_testing.megatron.layer import _submodules, install_cpu_shims, install_gpu_shims, make_config, set_params

__all__ = [
    "FFN_HIDDEN",
    "HYBRID_PATTERN",
    "TE_HYBRID_PATTERN",
    "MODEL_KINDS",
    "VOCAB_SIZE",
    "build_model",
    "copy_stage_params",
    "global_layer_name",
    "gdn_layer_spec",
    "hybrid_stack_spec",
    "install_model_stand_ins",
    "megatron_lm_args_for",
    "model_config",
    "model_pg_collection",
    "run_model",
    "set_model_params",
    "sum_grads",
]

MODEL_KINDS = ("gpt", "hybrid", "hybrid_attn", "hybrid_moe", "hybrid_te")
VOCAB_SIZE = 64
FFN_HIDDEN = 64
GPT_LAYERS = 2  # each: GDN + MLP
HYBRID_PATTERN = "G-G-"  # GDN, MLP, GDN, MLP
TE_HYBRID_PATTERN = "G-*-"  # GDN, MLP, attention, MLP (hybrid_attn, hybrid_te)
MOE_HYBRID_PATTERN = "GE*-"  # GDN, MoE, attention, MLP (hybrid_moe)
MOE_EXPERTS = 4  # hybrid_moe: top-2 routing, Megatron's alltoall dispatcher, local experts (SequentialMLP)
MAX_SEQUENCE_LENGTH = 4096

_STAND_INS_INSTALLED = False


def _local_norm(has_residual: bool = False):
    from megatron.core.models.backends import LocalSpecProvider

    return LocalSpecProvider().layer_norm(rms_norm=True, for_qk=False, has_residual=has_residual)


def _keep_fp64_logits_max(vocab_parallel_logits):
    """``VocabParallelCrossEntropy.calculate_logits_max`` with fp64 logits kept fp64 (see the
    module docstring): the upcast, then the max over the vocabulary, as 0.19.2 computes them."""
    if vocab_parallel_logits.dtype != torch.float64:
        vocab_parallel_logits = vocab_parallel_logits.float()
    return vocab_parallel_logits, torch.max(vocab_parallel_logits, dim=-1)[0]


def install_model_stand_ins(device="cpu") -> None:
    """Idempotent; call in every process that builds or runs these models (see the module
    docstring for what each stand-in replaces and why)."""
    global _STAND_INS_INSTALLED
    if torch.device(device).type == "cpu":
        install_cpu_shims()
    else:
        install_gpu_shims()
    if _STAND_INS_INSTALLED:
        return
    import megatron.core.models.hybrid.hybrid_block as hybrid_block
    from megatron.core.extensions.transformer_engine import HAVE_TE
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

    if not HAVE_TE:
        hybrid_block.TENorm = _local_norm()
    VocabParallelCrossEntropy.calculate_logits_max = staticmethod(_keep_fp64_logits_max)
    if torch.device(device).type == "cpu":
        import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

        token_dispatcher.maybe_move_tensor_to_cpu = _splits_as_on_a_gpu
    _STAND_INS_INSTALLED = True


def _splits_as_on_a_gpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    """MoE's alltoall dispatcher moves its split sizes to the host with ``maybe_move_tensor_to_cpu``, which
    leaves a tensor that is already on the host as it is, so on a CPU they reach ``all_to_all_single`` as
    tensors, which it refuses; here a host tensor asked for as NumPy becomes one, as a GPU's would."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.cpu().numpy()
    return tensor.cpu() if torch.is_tensor(tensor) else tensor


def gdn_layer_spec(with_mlp: bool = True):
    """A TransformerLayer ModuleSpec: local RMSNorm -> GatedDeltaNet -> residual, then (with_mlp)
    local RMSNorm -> Megatron's local MLP -> residual."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    norm = _local_norm(has_residual=True)
    mlp = dict(pre_mlp_layernorm=norm, mlp=get_mlp_module_spec_for_backend(LocalSpecProvider()),
               mlp_bda=get_bias_dropout_add) if with_mlp else {}
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=norm,
        self_attention=ModuleSpec(module=GatedDeltaNet, submodules=_submodules()),
        self_attn_bda=get_bias_dropout_add,
        **mlp,
    ))


def hybrid_stack_spec(with_attention: bool = False, with_moe: bool = False):
    """A HybridStack ModuleSpec from local modules: ``gdn_layer`` (:func:`gdn_layer_spec` without
    MLP) and ``mlp_layer`` (an MLPLayer: local RMSNorm -> Megatron's local MLP -> residual); with
    ``with_attention``, ``attention_layer`` too (:func:`gdn_cp_testing.megatron.attention.attention_layer_spec`);
    with ``with_moe``, ``moe_layer`` (a MoETransformerLayer: local RMSNorm -> Megatron's MoE of local experts,
    ``get_moe_module_spec(use_te=False)`` -> residual)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    mlp_layer = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=_local_norm(has_residual=True),
        mlp=get_mlp_module_spec_for_backend(LocalSpecProvider()),
        mlp_bda=get_bias_dropout_add,
    ))
    extra = {}
    if with_attention:
        from gdn_cp_testing.megatron.attention import attention_layer_spec

        extra["attention_layer"] = attention_layer_spec()
    if with_moe:
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
        from megatron.core.transformer.transformer_layer import MoETransformerLayer

        extra["moe_layer"] = ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=_local_norm(has_residual=True),
            mlp=get_moe_module_spec(use_te=False, num_experts=MOE_EXPERTS, moe_grouped_gemm=False),
            mlp_bda=get_bias_dropout_add))
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(
        gdn_layer=gdn_layer_spec(with_mlp=False), mlp_layer=mlp_layer, **extra))


def model_config(kind: str, cp: int, mode: str = "chunkwise", dtype=torch.float64, **overrides):
    """The TransformerConfig of a ``kind`` model (:data:`MODEL_KINDS`) at static CP size ``cp``:
    the GDN shape of :data:`gdn_cp_testing.megatron.layer.DIMS`, MLP hidden :data:`FFN_HIDDEN`,
    no dropout, deterministic mode (gdn-cp's reference backend). ``overrides`` go to the config."""
    if kind not in MODEL_KINDS:
        raise ValueError(f"kind={kind!r}: use one of {MODEL_KINDS}")
    layers = {"gpt": GPT_LAYERS, "hybrid": len(HYBRID_PATTERN), "hybrid_attn": len(TE_HYBRID_PATTERN),
              "hybrid_moe": len(MOE_HYBRID_PATTERN), "hybrid_te": len(TE_HYBRID_PATTERN)}[kind]
    kw = dict(num_layers=layers, ffn_hidden_size=FFN_HIDDEN, hidden_dropout=0.0, attention_dropout=0.0)
    if kind == "hybrid_te":
        kw.update(cp_comm_type="a2a", deterministic_mode=False)
    if kind == "hybrid_moe":
        kw.update(num_moe_experts=MOE_EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=FFN_HIDDEN,
                  moe_token_dispatcher_type="alltoall")
    kw.update(overrides)
    return make_config(cp, mode, dtype, **kw)


def megatron_lm_args_for(kind: str, **flags):
    """Megatron-LM's parsed ``args`` (a namespace of the fields gdn-cp's ``validate_args`` hook reads) for a
    ``kind`` model (:data:`MODEL_KINDS`) as ``validate_args`` hands them to the hook: Megatron-LM's defaults
    (``--moe-token-dispatcher-type allgather``, ``variable_seq_lengths`` False, ...), ``--swiglu``, the model's
    layers as ``pretrain_hybrid.py`` (``--hybrid-layer-pattern``) or ``pretrain_gpt.py``
    (``--experimental-attention-variant gated_delta_net`` with no attention layer) take them, then ``flags``
    (``pipeline_model_parallel_size=2``, ``dataloader_inter_document_masking=True``, ...). Pass it to
    :func:`gdn_cp.megatron.thd_split.configure_megatron_lm_args` to see what a run of these flags gets."""
    import types

    if kind not in MODEL_KINDS:
        raise ValueError(f"kind={kind!r}: use one of {MODEL_KINDS}")
    args = dict(swiglu=True, linear_cp_mode="auto", linear_cp_backend="auto", linear_cp_thd_split=None, sft=False,
                dataloader_inter_document_masking=False, hybrid_context_parallel=False, eod_mask_loss=False,
                calculate_per_token_loss=False, context_parallel_size=1, tensor_model_parallel_size=1,
                pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None, sequence_parallel=False,
                micro_batch_size=1, eval_micro_batch_size=None, variable_seq_lengths=False, num_experts=None,
                moe_token_dispatcher_type="allgather", mtp_num_layers=None, fp8=None, fp4=None, spec=None)
    if kind == "gpt":
        args.update(experimental_attention_variant="gated_delta_net", num_layers=GPT_LAYERS,
                    linear_attention_freq=GPT_LAYERS + 1, hybrid_layer_pattern=None)
    else:
        args["hybrid_layer_pattern"] = {"hybrid": HYBRID_PATTERN, "hybrid_attn": TE_HYBRID_PATTERN,
                                        "hybrid_moe": MOE_HYBRID_PATTERN, "hybrid_te": TE_HYBRID_PATTERN}[kind]
    if kind == "hybrid_moe":
        args.update(num_experts=MOE_EXPERTS, moe_router_topk=2, moe_token_dispatcher_type="alltoall")
    args.update(flags)
    if args["eval_micro_batch_size"] is None:  # validate_args: the training micro-batch size
        args["eval_micro_batch_size"] = args["micro_batch_size"]
    return types.SimpleNamespace(**args)


def model_pg_collection(cp_group, dp_cp_group=None):
    """Process groups of a model without TP or PP: this rank alone for TP, PP and the embedding
    group; ``cp_group`` for CP; ``dp_cp_group`` (default ``cp_group``) for the checkpoint
    metadata HybridModel asks for."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from gdn_cp_testing.megatron.layer import rank_groups

    alone = rank_groups()["self"]
    pg = ProcessGroupCollection()
    pg.tp, pg.pp, pg.embd = alone, alone, alone
    pg.cp = cp_group
    pg.dp_cp = cp_group if dp_cp_group is None else dp_cp_group
    return pg


def build_model(kind: str, config, cp_group=None, *, pg_collection=None, seed: int = 0, device="cpu",
                position_embedding_type: str = "none", pre_process: bool = True, post_process: bool = True):
    """A ``kind`` model (:data:`MODEL_KINDS`) with seeded weights (:func:`set_model_params`),
    cast to ``config.params_dtype`` as a whole. ``pg_collection`` defaults to
    :func:`model_pg_collection` of ``cp_group``. ``position_embedding_type``: ``none`` (GDN needs no
    positions) or, for a model with attention layers, ``rope``. ``pre_process`` / ``post_process``: a
    pipeline stage's (the first stage has the embedding, the last the output layer); its layers and their
    weights are those of its stage (:func:`copy_stage_params` gives a stage the full model's)."""
    install_model_stand_ins(device)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    pg = model_pg_collection(cp_group) if pg_collection is None else pg_collection
    common = dict(vocab_size=VOCAB_SIZE, max_sequence_length=MAX_SEQUENCE_LENGTH,
                  position_embedding_type=position_embedding_type, pg_collection=pg, pre_process=pre_process,
                  post_process=post_process)
    if kind == "gpt":
        model = GPTModel(config, gdn_layer_spec(), **common)
    elif kind == "hybrid":
        model = HybridModel(config, hybrid_stack_spec(), hybrid_layer_pattern=HYBRID_PATTERN, **common)
    elif kind == "hybrid_attn":
        model = HybridModel(config, hybrid_stack_spec(with_attention=True), hybrid_layer_pattern=TE_HYBRID_PATTERN,
                            **common)
    elif kind == "hybrid_moe":
        model = HybridModel(config, hybrid_stack_spec(with_attention=True, with_moe=True),
                            hybrid_layer_pattern=MOE_HYBRID_PATTERN, **common)
    elif kind == "hybrid_te":
        from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec as te_hybrid_stack_spec

        model = HybridModel(config, te_hybrid_stack_spec, hybrid_layer_pattern=TE_HYBRID_PATTERN, **common)
    else:
        raise ValueError(f"kind={kind!r}: use one of {MODEL_KINDS}")
    model.to(device=device, dtype=config.params_dtype)
    set_model_params(model, seed)
    return model


def global_layer_name(name: str, layer_offset: int, expert_offset: int = 0) -> str:
    """A pipeline stage's (or expert-parallel rank's) parameter ``name`` as the whole model names it: its
    ``decoder.layers.{i}`` is layer ``i + layer_offset`` of the whole model (the stage's first layer is the
    model's ``layer_offset``-th), its ``experts.local_experts.{j}`` expert ``j + expert_offset``."""
    name = re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", name)
    return re.sub(r"\.experts\.local_experts\.(\d+)\.",
                  lambda m: f".experts.local_experts.{int(m.group(1)) + expert_offset}.", name)


def copy_stage_params(stage, whole, layer_offset: int, expert_offset: int = 0) -> None:
    """Every parameter of the pipeline stage / expert-parallel model ``stage`` from the same parameter of the
    whole model ``whole`` (:func:`global_layer_name`); KeyError naming a parameter the whole model lacks."""
    source = dict(whole.named_parameters())
    with torch.no_grad():
        for name, p in stage.named_parameters():
            p.copy_(source[global_layer_name(name, layer_offset, expert_offset)])


def _name_seed(seed: int, name: str) -> int:
    return seed * 1_000_003 + zlib.crc32(name.encode())


def set_model_params(model, seed: int) -> None:
    """Every parameter from a generator seeded by ``seed`` and its name: each GatedDeltaNet by
    :func:`gdn_cp_testing.megatron.layer.set_params` (seeded by ``seed`` and its layer number),
    norms near 1, linear weights ``N(0, 1/fan_in)``, the embedding ``N(0, 0.25)``, anything else
    (biases) ``N(0, 0.01)``."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    done = set()
    for prefix, module in model.named_modules():
        if isinstance(module, GatedDeltaNet):
            set_params(module, seed * 1000 + module.layer_number)
            done.update(f"{prefix}.{n}" for n, _ in module.named_parameters())
    for name, p in model.named_parameters():
        if name in done:
            continue
        gen = torch.Generator().manual_seed(_name_seed(seed, name))
        n = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        if "norm" in name:
            v = 1.0 + 0.1 * n
        elif name.endswith("word_embeddings.weight"):
            v = 0.5 * n
        elif name.endswith(".weight") and p.dim() == 2:
            v = n / math.sqrt(p.shape[1])
        else:
            v = 0.1 * n
        with torch.no_grad():
            p.copy_(v.to(p.dtype))


def run_model(model, batch: dict, packed_seq_params=None, *, backward: bool = True):
    """Forward (+ backward) of one micro-batch as ``pretrain_gpt.forward_step`` calls the model;
    the loss is ``pretrain_gpt.loss_func``'s ``sum(losses * loss_mask)`` in the model's dtype (its
    ``.float()`` would put an fp32 floor under an fp64 comparison). Returns ``(per-token losses
    [b, s] detached, {parameter name: gradient or None})``."""
    model.zero_grad(set_to_none=True)
    losses = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"],
                   loss_mask=batch["loss_mask"], packed_seq_params=packed_seq_params)
    if backward:
        (losses * batch["loss_mask"].to(losses.dtype)).sum().backward()
    grads = {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters()}
    return losses.detach(), grads


def sum_grads(grads: dict, group: Optional[object]) -> dict:
    """``grads`` summed over ``group`` in place (what Megatron's DP-CP gradient all-reduce sums);
    None or a group of one: unchanged."""
    import torch.distributed as dist

    if group is not None and group.size() > 1:
        for g in grads.values():
            if g is not None:
                dist.all_reduce(g, group=group)
    return grads
