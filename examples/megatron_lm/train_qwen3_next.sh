#!/usr/bin/env bash
# Train a Qwen3-Next-shaped hybrid with Megatron-LM's pretrain_hybrid.py and gdn-cp's context parallelism,
# on packed documents: three Gated DeltaNet layers to one gated attention layer, each followed by a
# mixture of experts (the hybrid pattern GEGEGE*E), zero-centred RMSNorm, QK-norm, partial RoPE.
#
# Sized to run on 1 to 8 GPUs of one machine (GPUS; CP must divide it; the rest is data parallelism):
#   MEGATRON_LM=~/Megatron-LM GPUS=8 CP=2 bash examples/megatron_lm/train_qwen3_next.sh
# The full Qwen3-Next-80B-A3B shape (48 layers, 512 experts, 262144 positions: many nodes; set TP, EP and
# PP for them, and your data and tokenizer: DATA=... TOKENIZER=Qwen/Qwen3-Next-80B-A3B-Instruct):
#   PATTERN_REPEAT=12 HIDDEN=2048 ATTN_HEADS=16 ATTN_GROUPS=2 ATTN_HEAD_DIM=256 GDN_KEY_HEADS=16 GDN_VALUE_HEADS=32 GDN_HEAD_DIM=128 EXPERTS=512 TOPK=10 EXPERT_FFN=512 SHARED_FFN=512 VOCAB=151936 SEQ=262144
# (Qwen3-Next also has one multi-token-prediction layer and a load-balancing loss of 1e-3; both are left out
# here: see "Packed documents" below for the loss, and docs/megatron.md "What runs beside CP" for MTP.)
#
# Needs: Python >= 3.12, torch with CUDA, TransformerEngine, flash-linear-attention (gdn-cp's [fla] extra)
# and a Megatron-LM checkout at core_v0.19.0 patched by gdn-cp (this script checks the patch first):
#   git clone https://github.com/NVIDIA/Megatron-LM && git -C Megatron-LM checkout core_v0.19.0
#   gdn-cp patch apply Megatron-LM
# Data: Megatron's mock data by default; DATA=<prefix of a Megatron indexed dataset> with TOKENIZER=<a
# Hugging Face tokenizer> trains on yours.
#
# gdn-cp's flags:
#   --context-parallel-size CP         every GDN layer runs under CP in LINEAR_CP_MODE (default auto, which
#                                      resolves once to chunkwise and logs why; headwise needs the GDN heads
#                                      divisible by TP*CP, chunkwise and all_gather by TP)
#   --linear-cp-backend BACKEND        the per-rank kernels: auto (FLA, or FlashQLA where it runs), fla,
#                                      flashqla, reference
# Packed documents (PACKED=1, the default):
#   --dataloader-inter-document-masking  rows hold several documents; attention and GDN restart at each one
#   --calculate-per-token-loss           needed at CP > 1: with attention layers every document is padded at
#                                      its end and cut per document, and the pads fall unevenly on the ranks
#   --moe-aux-loss-coeff 0               the load-balancing loss would count those pads (gdn-cp's validate_args
#                                      refuses it with the reason); PACKED=0 (SBHD rows) keeps Qwen3-Next's 1e-3
#
# PRINT_ARGS=1 prints pretrain_hybrid.py's arguments, one per line, and runs nothing (tests/test_examples.py
# parses them with Megatron-LM's own parser and validate_args).
set -euo pipefail

GPUS=${GPUS:-2}
CP=${CP:-2}
TP=${TP:-1}
EP=${EP:-1}
LINEAR_CP_MODE=${LINEAR_CP_MODE:-auto}
LINEAR_CP_BACKEND=${LINEAR_CP_BACKEND:-auto}
PACKED=${PACKED:-1}
# the model: Qwen3-Next's layout at a size one machine trains (the full shape: the header)
PATTERN_REPEAT=${PATTERN_REPEAT:-2}
HIDDEN=${HIDDEN:-1024}
ATTN_HEADS=${ATTN_HEADS:-8}
ATTN_GROUPS=${ATTN_GROUPS:-2}
ATTN_HEAD_DIM=${ATTN_HEAD_DIM:-128}
GDN_KEY_HEADS=${GDN_KEY_HEADS:-8}
GDN_VALUE_HEADS=${GDN_VALUE_HEADS:-16}
GDN_HEAD_DIM=${GDN_HEAD_DIM:-128}
EXPERTS=${EXPERTS:-16}
TOPK=${TOPK:-2}
EXPERT_FFN=${EXPERT_FFN:-512}
SHARED_FFN=${SHARED_FFN:-512}
VOCAB=${VOCAB:-151936}
SEQ=${SEQ:-8192}
MICRO_BATCH=${MICRO_BATCH:-1}
GLOBAL_BATCH=${GLOBAL_BATCH:-16}
ITERS=${ITERS:-200}

if (( GPUS % (CP * TP) )); then
  echo "train_qwen3_next.sh: error: GPUS=$GPUS is not a multiple of CP*TP=$((CP * TP)); use GPUS a multiple of it" >&2
  exit 2
fi
pattern=""
for ((i = 0; i < PATTERN_REPEAT; i++)); do pattern+="GEGEGE*E"; done

ARGS=(
  --spec megatron.core.models.hybrid.hybrid_layer_specs hybrid_stack_spec
  --hybrid-layer-pattern "$pattern"
  --hidden-size "$HIDDEN"
  --num-attention-heads "$ATTN_HEADS" --group-query-attention --num-query-groups "$ATTN_GROUPS"
  --kv-channels "$ATTN_HEAD_DIM" --attention-output-gate --qk-layernorm
  --linear-num-key-heads "$GDN_KEY_HEADS" --linear-num-value-heads "$GDN_VALUE_HEADS"
  --linear-key-head-dim "$GDN_HEAD_DIM" --linear-value-head-dim "$GDN_HEAD_DIM" --linear-conv-kernel-dim 4
  --num-experts "$EXPERTS" --moe-router-topk "$TOPK" --moe-ffn-hidden-size "$EXPERT_FFN"
  --moe-shared-expert-intermediate-size "$SHARED_FFN" --moe-shared-expert-gate
  --moe-grouped-gemm --moe-token-dispatcher-type alltoall --moe-router-dtype fp32
  --swiglu --normalization RMSNorm --apply-layernorm-1p --norm-epsilon 1e-6
  --disable-bias-linear --untie-embeddings-and-output-weights
  --position-embedding-type rope --rotary-percent 0.25 --rotary-base 10000000
  --hidden-dropout 0 --attention-dropout 0
  --seq-length "$SEQ" --max-position-embeddings "$SEQ"
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
  --tensor-model-parallel-size "$TP" --expert-model-parallel-size "$EP"
  --context-parallel-size "$CP" --linear-cp-mode "$LINEAR_CP_MODE" --linear-cp-backend "$LINEAR_CP_BACKEND"
  --bf16 --transformer-impl transformer_engine --use-distributed-optimizer
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 20 --weight-decay 0.1 --clip-grad 1.0
  --train-iters "$ITERS" --seed 1234 --log-interval 1 --eval-iters 0 --eval-interval 1000000
  --no-create-attention-mask-in-dataloader
)
if [ "$PACKED" = 1 ]; then
  ARGS+=(--dataloader-inter-document-masking --calculate-per-token-loss --moe-aux-loss-coeff 0)
else
  ARGS+=(--moe-aux-loss-coeff 1e-3)
fi
if [ -n "${DATA:-}" ]; then
  ARGS+=(--data-path "$DATA" --split "100,0,0" --tokenizer-type HuggingFaceTokenizer --tokenizer-model "${TOKENIZER:?set TOKENIZER to a Hugging Face tokenizer for DATA}")
else
  ARGS+=(--mock-data --tokenizer-type NullTokenizer --vocab-size "$VOCAB")
fi

if [ "${PRINT_ARGS:-0}" = 1 ]; then
  printf '%s\n' "${ARGS[@]}"
  exit 0
fi
: "${MEGATRON_LM:?set MEGATRON_LM to your Megatron-LM checkout (core_v0.19.0, patched: gdn-cp patch apply PATH)}"
# `gdn-cp patch check`, as python -m (gdn-cp on PYTHONPATH works too): its state; an unpatched checkout stops here
"${PYTHON:-python3}" -m gdn_cp.cli patch check -q --expect patched "$MEGATRON_LM"
cd "$MEGATRON_LM"
# Megatron-LM's validate_args asserts CUDA_DEVICE_MAX_CONNECTIONS=1 on Hopper and older GPUs with TP or CP > 1
CUDA_DEVICE_MAX_CONNECTIONS=1 exec torchrun --nproc-per-node "$GPUS" pretrain_hybrid.py "${ARGS[@]}"
