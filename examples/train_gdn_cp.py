"""Train a small Gated DeltaNet language model with gdn-cp's context parallelism: a training loop of your
own on megatron-core's public API and gdn-cp's, nothing else.

    python examples/train_gdn_cp.py                                      # CP=1, on this machine's CPU
    torchrun --nproc-per-node 2 examples/train_gdn_cp.py                 # CP=2 (gloo): CP=1's losses
    torchrun --nproc-per-node 2 examples/train_gdn_cp.py --device cuda   # CP=2, one rank per GPU (NCCL, FLA)

It needs gdn-cp, torch and megatron-core 0.19.2 patched by gdn-cp (`gdn-cp patch apply`); a GPU run also needs
flash-linear-attention (`pip install -e '.[fla]'` in a gdn-cp clone). What it shows, step by step:

1. packed documents of any length, padded at their ends and cut per document for CP with gdn-cp's
   ``pad_documents`` / ``padded_rank_sources`` (a pad row comes after every real row of its document, so no
   real token sees one), handed to the model as THD rows with Megatron's ``PackedSeqParams``;
2. a ``GPTModel`` whose layers are Megatron's own ``GatedDeltaNet`` (patched: gdn-cp runs each call in the
   ``linear_cp_mode`` the config resolved, ``auto`` -> chunkwise, logged) and MLP, from Megatron's local
   modules (no TransformerEngine: this runs on a CPU);
3. the loss over every real token of the batch, the gradients summed over the CP ranks (what Megatron's
   data-parallel gradient reduction over DP x CP does), AdamW.

Every CP size starts from the same weights (set from a seed, parameter by parameter) and trains on the same
documents, so each step prints CP=1's loss: ``tests/test_examples.py`` runs it at CP=1 and CP=2 on CPU ranks
and compares the two.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import zlib

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from gdn_cp.layout import PAD_SOURCE, pad_documents, padded_rank_sources

VOCAB = 64


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu: gloo ranks; cuda: NCCL, a GPU per rank")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    p.add_argument("--documents", type=int, default=12, help="documents packed into each step's batch (default 12)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float64"), default="float32")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def allow_megatron_gdn_on_a_cpu() -> None:
    """CPU only (a GPU machine with flash-linear-attention needs neither line). megatron-core 0.19.2 builds a
    GatedDeltaNet only where flash-linear-attention imports, and makes its conv on torch.cuda.current_device().
    gdn-cp runs every call of this example (packed rows), on its plain-torch backend here, so FLA is never
    called."""
    import megatron.core.ssm.gated_delta_net.common as gdn_common

    gdn_common.HAVE_FLA = True
    torch.cuda.current_device = lambda: torch.device("cpu")


def model_spec() -> ModuleSpec:
    """A TransformerLayer of Megatron's local modules: RMSNorm -> GatedDeltaNet -> residual, RMSNorm -> MLP ->
    residual (Megatron's own GDN specs need TransformerEngine)."""
    local = LocalSpecProvider()
    norm = local.layer_norm(rms_norm=True, for_qk=False, has_residual=True)
    gdn = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=local.layer_norm(rms_norm=True, for_qk=False),
        out_proj=RowParallelLinear))
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=norm, self_attention=gdn, self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=norm, mlp=get_mlp_module_spec_for_backend(local), mlp_bda=get_bias_dropout_add))


def set_weights(model: torch.nn.Module, seed: int) -> None:
    """Every parameter from a generator seeded by ``seed`` and its name: the same model on every rank and at
    every CP size (Megatron's own initialization draws from CUDA generators, hence perform_initialization=False)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            n = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if name.endswith("A_log"):
                value = torch.log(torch.empty_like(n).uniform_(1, 16, generator=g))  # decays of GDN's own init range
            elif name.endswith("dt_bias"):
                value = 0.1 * n
            elif "norm" in name:
                value = torch.ones_like(n)
            elif name.startswith("output_layer"):
                value = 0.02 * n  # small logits: the first loss is about log(VOCAB)
            elif p.dim() == 2:
                value = n / math.sqrt(p.shape[1])
            else:
                value = 0.02 * n  # conv1d, biases
            p.copy_(value.to(p.dtype))


def documents(step: int, count: int, seed: int) -> list[torch.Tensor]:
    """``count`` documents of 3 to 60 tokens, the same on every rank: each counts up from a random token by
    its own stride (1, 2 or 3, mod VOCAB), so the loss falls as the model learns to read the stride off the
    document's first tokens (a recurrence across the document: what GDN's state carries)."""
    g = torch.Generator().manual_seed(seed * 7919 + step)
    docs = []
    for _ in range(count):
        length = int(torch.randint(3, 61, (1,), generator=g))
        first, stride = int(torch.randint(0, VOCAB, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        docs.append((first + stride * torch.arange(length)) % VOCAB)
    return docs


def this_ranks_batch(docs: list[torch.Tensor], cp: int, rank: int, device) -> tuple[dict, PackedSeqParams, int]:
    """The rows this CP rank holds of the packed documents: every document padded at its end to a multiple
    of 2*cp and cut in 2*cp parts, rank r holding parts r and 2*cp-1-r (gdn-cp's ``padded_rank_sources``).
    Labels are the next token of the same document; the last token of a document and the pads have no loss."""
    lengths = [len(d) for d in docs]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    stream = torch.cat(docs)
    labels = torch.cat([torch.cat([d[1:], d[:1]]) for d in docs])
    has_label = torch.cat([torch.arange(n) < n - 1 for n in lengths])
    padded = pad_documents(cu, cp)  # the documents' boundaries with their pads
    source = padded_rank_sources(cu, padded, cp, rank)  # per row of this rank: its row of `stream`, or a pad
    real = source != PAD_SOURCE
    pick = source.clamp(min=0)
    batch = {"tokens": torch.where(real, stream[pick], 0), "labels": torch.where(real, labels[pick], 0),
             "loss_mask": (real & has_label[pick]).float()}
    batch = {k: v.unsqueeze(0).to(device) for k, v in batch.items()}  # [1, rows]: one packed row
    bounds = torch.tensor(padded, dtype=torch.int32, device=device)
    longest = max(b - a for a, b in zip(padded[:-1], padded[1:]))
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, cu_seqlens_q_padded=bounds,
                             cu_seqlens_kv_padded=bounds, max_seqlen_q=longest, max_seqlen_kv=longest)
    return batch, packed, int(sum(n - 1 for n in lengths))


def main() -> None:
    args = parse_args()
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("gdn_cp").setLevel(logging.INFO)  # the mode auto picked, and the mode each layer runs
    cp, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        allow_megatron_gdn_on_a_cpu()
        device = torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=rank, world_size=cp)
    parallel_state.initialize_model_parallel(context_parallel_size=cp)  # every rank is one CP group
    dtype = getattr(torch, args.dtype)

    config = TransformerConfig(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
        experimental_attention_variant="gated_delta_net", linear_attention_freq=1,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, activation_func=torch.nn.functional.silu, normalization="RMSNorm",
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
        context_parallel_size=cp, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        linear_cp_thd_split="per_document",  # how this_ranks_batch cut the rows (gdn-cp's config field)
        deterministic_mode=args.device == "cpu",  # CPU: Megatron's GDN builds its torch path (gdn-cp runs the calls)
        perform_initialization=False, use_cpu_initialization=True,  # weights: set_weights
    )  # linear_cp_mode: left at its default, "auto" (chunkwise; logged with why)
    model = GPTModel(config, model_spec(), vocab_size=VOCAB, max_sequence_length=4096,
                     position_embedding_type="none").to(device=device, dtype=dtype)
    set_weights(model, args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    grad_group = parallel_state.get_data_parallel_group(with_context_parallel=True)  # DP x CP: here the CP ranks

    for step in range(1, args.steps + 1):
        batch, packed, tokens_with_loss = this_ranks_batch(documents(step, args.documents, args.seed), cp, rank, device)
        losses = model(batch["tokens"], None, None, labels=batch["labels"], packed_seq_params=packed)  # [1, rows]
        loss = (losses.float() * batch["loss_mask"]).sum() / tokens_with_loss  # this rank's share of the mean
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=grad_group)
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total, group=grad_group)
        if rank == 0:
            print(f"CP={cp} step {step}: loss {total.item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
