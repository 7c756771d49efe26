#!/usr/bin/env bash
# The GPU suite in one command, for a CUDA machine with no network (the device machine). docs/testing.md ("The
# GPU suite in stages") says what each stage runs; `python3 -m gdn_cp_testing.env` lists every GDN_CP_* setting
# this script reads, with its default.
#
#   GDN_CP_TEST_FAST_AUTOTUNE=1 bash benchmarks/gpu_suite.sh -q          # stage tests on FLA 0.4.2 (default stack)
#   GDN_CP_STACK=fla060 GDN_CP_STAGES=layer_full bash benchmarks/gpu_suite.sh
#
# Stacks (GDN_CP_STACK): fla042 (default: the carried wheels .whl/*.whl, FLA 0.4.2 as megatron-core 0.19 pins it,
# and megatron-core) or fla060 (FLA 0.6.0 + Triton 3.7.1 from a slim-triton pack in GDN_CP_SLIM, default .slim;
# only megatron-core from .whl/). Optional packs, each unpacked once per machine and put on PYTHONPATH: .te
# (TransformerEngine: the TE-spec tests), .mlm (a Megatron-LM checkout as *.tar.gz: stage train_mlm), .tl
# (FlashQLA + TileLang).
#
# 1. installs the stack into /tmp/site-$GDN_CP_STACK and applies the gdn-cp patch to its megatron-core;
# 2. restores the Triton cache (.triton_cache/$GDN_CP_STACK/cache.tar.gz.part*), the autotune results of this GPU
#    model and stage family (.triton_cache/autotune/<model>.<family>.tar.gz) and TileLang's cache (.tl_cache/):
#    benchmarks/suite_caches.sh;
# 3. runs the stage groups of GDN_CP_STAGES (default "tests"; stages joined by "+" run side by side, each one's
#    output streamed to $OUT/stage_<name>.log), each stage under its own time limit; results in $OUT (default
#    /tmp/gdn_cp_gpu_out): gpu_results.jsonl, the benchmarks' files, run.log;
# 4. after every group saves the caches as $OUT/cache.tar.gz.part*, tl_cache.tar.gz.part* (<= 15 MiB each) and
#    autotune/<model>.<family>.tar.gz, to be carried back as .triton_cache/$GDN_CP_STACK/, .tl_cache/ and
#    .triton_cache/autotune/. At most 8 files come back from a device call: GDN_CP_SAVE_CACHE=0 where the Triton
#    cache is warm already or too large to carry beside the packs (the autotune results are saved either way).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
# a bad or unknown GDN_CP_* variable (a stage name, a stack, a time limit): one line, before anything runs
python3 -m gdn_cp_testing.env --check || exit 2
ROOT=$PWD
OUT=${OUT:-/tmp/gdn_cp_gpu_out}
mkdir -p "$OUT"
# shellcheck source=benchmarks/suite_caches.sh
. benchmarks/suite_caches.sh
T0=$(date +%s)

STACK=${GDN_CP_STACK:-fla042}
SITE=/tmp/site-$STACK  # one per stack: two suites of different stacks may run side by side
SITE_PATH=
case $STACK in
  fla042)
    WHEELS=$(ls .whl/*.whl 2>/dev/null) ;;
  fla060)
    SLIM=${GDN_CP_SLIM:-.slim}
    # unpacked once: a later call on the same warm machine needs no pack (e.g. to carry .tl beside .whl)
    if [ ! -d /tmp/site37/triton ]; then
      [ -f "$SLIM/unpack.py" ] || { echo "GDN_CP_STACK=fla060 needs the slim-triton pack in $SLIM (make.sh)"; exit 1; }
      python3 "$SLIM/unpack.py" /tmp/site37 >/dev/null || { echo "slim-triton unpack failed"; exit 1; }
    fi
    SITE_PATH=/tmp/site37:
    WHEELS=$(ls .whl/*.whl 2>/dev/null | grep -v -e '/fla_core-' -e '/flash_linear_attention-') ;;
  *) echo "GDN_CP_STACK=$STACK: use fla042 or fla060"; exit 1 ;;
esac
if [ -n "$WHEELS" ]; then
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" $WHEELS || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=$SITE_PATH$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}
  # Patched once, before any stage: side-by-side stages then never patch or revert it under another.
  if [ -d "$SITE/megatron" ]; then
    python3 -m gdn_cp.cli patch apply "$SITE" || { echo "patch apply failed"; exit 1; }
  fi
elif [ -d "$SITE" ]; then  # no wheels carried: the stack an earlier call installed on this warm machine
  echo "no .whl/*.whl: using $SITE from an earlier call"
  export PYTHONPATH=$SITE_PATH$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$SITE_PATH$ROOT${PYTHONPATH:+:$PYTHONPATH}
fi
export GDN_CP_STACK=$STACK

# TransformerEngine (Megatron's own GDN / hybrid specs and THD attention need it): the slim-te pack in
# $GDN_CP_TE (default .te, made by ../shared/tools/slim-te/make.sh) is unpacked once into .site-te/ (an
# ignored folder of the checkout, so a later call on the same warm machine finds it without carrying
# the pack) and put on PYTHONPATH; without either, the TE tests skip with their reason.
# unpack_pack PACK SITE: PACK/unpack.py into SITE once (marked .unpacked), then SITE first on PYTHONPATH
unpack_pack() {
  if [ -f "$1/unpack.py" ] && [ ! -f "$2/.unpacked" ]; then
    python3 "$1/unpack.py" "$2" && touch "$2/.unpacked" || { echo "unpacking $1 failed"; exit 1; }
  fi
  if [ -f "$2/.unpacked" ]; then export PYTHONPATH=$2:$PYTHONPATH; fi
}
TE_SITE=$ROOT/.site-te
unpack_pack "${GDN_CP_TE:-.te}" "$TE_SITE"
# A Megatron-LM checkout ($GDN_CP_MLM/*.tar.gz, default .mlm/: e.g. the core_v0.19.0 fixture), patched by
# gdn-cp, for the train_mlm stage (its scripts import the checkout's own megatron/).
MLM_TAR=$(ls "${GDN_CP_MLM:-.mlm}"/*.tar.gz 2>/dev/null | head -n 1)
# A second, unpatched copy is stock megatron-core 0.19.2's GDN, for train_mlm's stock rows.
MLM_DIR=/tmp/megatron-lm
MLM_STOCK=/tmp/megatron-lm-stock
if [ -n "$MLM_TAR" ] && [ -f "$MLM_DIR/pretrain_hybrid.py" ] \
    && ! python3 -m gdn_cp.cli patch check --expect patched "$MLM_DIR" >/dev/null 2>&1; then
  rm -rf "$MLM_DIR" "$MLM_STOCK"  # a warm machine's checkout, patched by another version of the patch: unpack anew
fi
if [ -n "$MLM_TAR" ] && [ ! -f "$MLM_DIR/pretrain_hybrid.py" ]; then
  mkdir -p "$MLM_DIR" "$MLM_STOCK" && tar -xzf "$MLM_TAR" -C "$MLM_DIR" && tar -xzf "$MLM_TAR" -C "$MLM_STOCK" \
    && python3 -m gdn_cp.cli patch apply "$MLM_DIR" \
    || { echo "Megatron-LM checkout: unpack or patch failed"; exit 1; }
fi

# FlashQLA + TileLang (the slim-tilelang pack), unpacked once into .site-tl/ and put first on PYTHONPATH
TL_SITE=$ROOT/.site-tl
unpack_pack "${GDN_CP_TL:-.tl}" "$TL_SITE"
# from here on everything printed is in run.log too (which caches were restored, then every stage)
exec > >(tee -a "$OUT/run.log") 2>&1
export TILELANG_CACHE_DIR=$ROOT/.tl_cache/live
mkdir -p "$TILELANG_CACHE_DIR"
if [ ! -f "$TILELANG_CACHE_DIR/.restored" ] && unpack_parts .tl_cache/tl_cache.tar.gz "$TILELANG_CACHE_DIR"; then
  touch "$TILELANG_CACHE_DIR/.restored" && echo "tilelang cache restored: $(find "$TILELANG_CACHE_DIR" -type f | wc -l) files"
fi

export TRITON_CACHE_DIR=$ROOT/.triton_cache/live-$STACK
export TORCHINDUCTOR_CACHE_DIR=$TRITON_CACHE_DIR/inductor  # torch.compile's (the fused glue), saved with it
export FLA_CACHE_RESULTS=1 PYTHONUNBUFFERED=1
export GDN_CP_GPU_RESULTS=$OUT/gpu_results.jsonl
mkdir -p "$TRITON_CACHE_DIR"
CACHE_IN=.triton_cache/$STACK
if ! ls "$CACHE_IN"/cache.tar.gz.part* >/dev/null 2>&1 && [ "$STACK" = fla042 ]; then CACHE_IN=.triton_cache; fi
unpack_parts "$CACHE_IN/cache.tar.gz" "$TRITON_CACHE_DIR" \
  && echo "triton cache restored from $CACHE_IN: $(find "$TRITON_CACHE_DIR" -type f | wc -l) files"
GPU_MODEL=$(gpu_model)
AUTOTUNE_FAMILY=$(autotune_family "${GDN_CP_STAGES:-tests}")
restore_autotune "$GPU_MODEL" "$AUTOTUNE_FAMILY"

echo "== stack $STACK"
echo "== machine"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
# the training benchmark beside a test stage needs more than an 80 GB card (gdn_cp_testing.env.side_by_side_problem)
python3 -c 'import sys; from gdn_cp_testing.env import side_by_side_problem as p; s, m = sys.argv[1:]; sys.exit(p(s, int(m)) if m.strip() else None)' \
  "${GDN_CP_STAGES:-tests}" "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)" || exit 2
python3 -c 'import json, triton, gdn_cp.ops.versions as v; print(json.dumps(v.stack_versions({"triton_from": triton.__file__, "transformer_engine": v.dist_version("transformer-engine")})))'

# One stage, under its own time limit: tests / tests_core / tests_megatron / flashqla_tests / glue_tests (GPU tests:
# docs/testing.md's table); train_mlm (benchmarks/train_megatron_lm.py); syncs, layer_full, layer_full_b (a second
# run with its own limit and file), glue_kernels (the benchmark of that name); args (the megatron.training argument
# test, Python >= 3.12).
# GDN_CP_TESTS_FAST_AUTOTUNE: the first-config knob for the test stages only (tests*, glue_tests: their checks hold
# for any config); the benchmark stages, beside them or after, must autotune for real
TESTS_FAST_AUTOTUNE=${GDN_CP_TESTS_FAST_AUTOTUNE:-${GDN_CP_TEST_FAST_AUTOTUNE:-0}}
run_stage() {
  local stage=$1; shift
  local T1; T1=$(date +%s)
  case $stage in
    tests|tests_core|tests_megatron|flashqla_tests)
      # the GPU tests: tests_core = tests/gpu (the FLA backend, the fused glue compiled, the FlashQLA backend
      # where .site-tl is unpacked), tests_megatron = tests/megatron (the Megatron layer's parity on both specs,
      # TE attention on the padded cut, initial weights, the fused gated norm), tests = both in one session.
      # Each test's outcome is written as it ends (gdn_cp_testing.outcomes), so the stage's summary line
      # (passed / failed / skipped / not reached) is printed even after a time-out.
      local ARGS=("$@"); [ ${#ARGS[@]} -eq 0 ] && ARGS=(-q)
      local WHERE=(tests/gpu tests/megatron)
      [ "$stage" = tests_core ] && WHERE=(tests/gpu)
      [ "$stage" = tests_megatron ] && WHERE=(tests/megatron)
      # the FlashQLA backend's GPU tests: its own (every mode, CP=1/2/4) and the Megatron layer parity on it
      [ "$stage" = flashqla_tests ] && WHERE=(tests/gpu/test_flashqla_backend.py tests/megatron/test_gpu_parity.py -k flashqla)
      local OUTCOMES=/tmp/gdn_cp_outcomes_$stage.jsonl
      rm -f "$OUTCOMES"
      GDN_CP_TEST_OUTCOMES=$OUTCOMES GDN_CP_TEST_FAST_AUTOTUNE=$TESTS_FAST_AUTOTUNE \
      timeout --signal=INT "${GDN_CP_SUITE_TIMEOUT:-420}" python3 -m pytest "${WHERE[@]}" \
        -m gpu -p no:cacheprovider -rA --durations=15 "${ARGS[@]}"
      local prc=$?
      python3 -m gdn_cp_testing.outcomes "$OUTCOMES" "== stage $stage tests"
      (exit $prc) ;;
    glue_tests)
      # the glue's GPU paths (gdn-cp's Triton kernels, torch.compile) against the plain math, bf16 at a real width;
      # 540 s: cold, 7 of its 15 cases took 330 s (run 2026-12-06h: each form's halo case compiles ~70 s); the
      # suite's arguments go to pytest, as for the test stages (e.g. -k "not compiled")
      local GARGS=("$@"); [ ${#GARGS[@]} -eq 0 ] && GARGS=(-q)
      GDN_CP_TEST_FAST_AUTOTUNE=$TESTS_FAST_AUTOTUNE timeout --signal=INT 540 python3 -m pytest \
        tests/gpu/test_fused_glue_gpu.py -m gpu -p no:cacheprovider -rA "${GARGS[@]}" ;;
    glue_kernels)
      # shellcheck disable=SC2086
      timeout --signal=INT 400 python3 -m benchmarks.glue_kernels --out "$OUT/glue_kernels.json" ${GDN_CP_GLUE_KERNELS_ARGS:-} ;;
    args)
      timeout --signal=INT 240 python3 -m pytest tests/megatron/test_training_args.py -p no:cacheprovider -rA -q ;;
    wgrads)
      # which parameter's gradient moves first at CP > 1 (issue 47): Megatron's own per-parameter dumps of the
      # first iterations, each CP run against CP=1 beside a noise pair (gdn_cp_testing.megatron.wgrads; the checkout
      # as train_mlm's)
      if [ ! -f "$MLM_DIR/pretrain_hybrid.py" ]; then
        echo "wgrads needs a Megatron-LM checkout in ${GDN_CP_MLM:-.mlm}/"; false
      else
        # shellcheck disable=SC2086
        timeout --signal=INT 560 python3 -m gdn_cp_testing.megatron.wgrads --checkout "$MLM_DIR" --work /tmp/wgrads_work \
          --out "$OUT/wgrads.json" --timeout-s 480 ${GDN_CP_WGRADS_ARGS:-}
      fi ;;
    syncs)
      # each autotuner at its first working config (the counts do not depend on it): run 2026-12-07h, autotuning
      # cold, did not finish the FlashQLA count in 240 s
      # shellcheck disable=SC2086
      GDN_CP_TEST_FAST_AUTOTUNE=1 timeout --signal=INT "${GDN_CP_SYNCS_TIMEOUT:-240}" python3 -m benchmarks.syncs \
        --out "$OUT/syncs.json" ${GDN_CP_SYNCS_ARGS:-} ;;
    layer_full)
      # shellcheck disable=SC2086
      timeout --signal=INT "$(( ${GDN_CP_LAYER_FULL_TIMEOUT:-480} + 60 ))" python3 -m benchmarks.layer_full \
        --out "$OUT/layer_full_$STACK.json" --time-limit "${GDN_CP_LAYER_FULL_TIMEOUT:-480}" ${GDN_CP_LAYER_FULL_ARGS:-} ;;
    layer_full_b)
      # a second layer_full run in the same call (e.g. another T after the first finished), own limit and file
      # shellcheck disable=SC2086
      timeout --signal=INT "$(( ${GDN_CP_LAYER_FULL_B_TIMEOUT:-240} + 60 ))" python3 -m benchmarks.layer_full \
        --out "$OUT/layer_full_${STACK}_b.json" --time-limit "${GDN_CP_LAYER_FULL_B_TIMEOUT:-240}" \
        ${GDN_CP_LAYER_FULL_B_ARGS:-} ;;
    train_mlm)
      # Megatron-LM's own pretrain_hybrid.py / pretrain_gpt.py, CP > 1 against CP=1 (needs TE and the checkout).
      # Data: nothing to carry. The benchmark builds its text before the runs (seconds): this machine's Python
      # standard library as byte-level tokens, an indexed dataset in /tmp/mlm_work/data, provenance (Python
      # version, files, tokens, .bin sha256) in the JSON. GDN_CP_TRAIN_MLM_ARGS picks what this call runs
      # (--groups main | fp32,more | ...; --resume FILE.json: an earlier call's JSON, carried as a repository file).
      if [ ! -f "$MLM_DIR/pretrain_hybrid.py" ]; then
        echo "train_mlm needs a Megatron-LM checkout in ${GDN_CP_MLM:-.mlm}/"; false
      else
        # FlashQLA (.site-tl) only on the PYTHONPATH of group flashqla's runs: the others keep auto's choice without it
        # shellcheck disable=SC2046,SC2086
        PYTHONPATH=${PYTHONPATH//$TL_SITE:/} timeout --signal=INT "$(( ${GDN_CP_TRAIN_MLM_TIMEOUT:-420} + 90 ))" \
          python3 -m benchmarks.train_megatron_lm \
          --checkout "$MLM_DIR" --stock-checkout "$MLM_STOCK" --out "$OUT/train_megatron_lm.json" --work /tmp/mlm_work \
          --budget-s "${GDN_CP_TRAIN_MLM_TIMEOUT:-420}" $([ -f "$TL_SITE/.unpacked" ] && echo --flashqla-site "$TL_SITE") \
          ${GDN_CP_TRAIN_MLM_ARGS:-}
      fi
      local trc=$?
      tar -czf "$OUT/train_mlm_logs.tar.gz" -C /tmp/mlm_work logs 2>/dev/null
      (exit $trc) ;;
    *) echo "unknown stage $stage"; false ;;
  esac
  local rc=$?
  echo "== stage $stage: rc=$rc in $(( $(date +%s) - T1 ))s"
  return $rc
}

RC=0
for group in ${GDN_CP_STAGES:-tests}; do
  if [ "$group" = "${group//+/}" ]; then
    run_stage "$group" "$@" || RC=$?
  else
    PIDS=()
    for stage in ${group//+/ }; do
      run_stage "$stage" "$@" > "$OUT/stage_$stage.log" 2>&1 &
      PIDS+=($!)
    done
    for pid in "${PIDS[@]}"; do
      wait "$pid" || RC=$?
    done
    for stage in ${group//+/ }; do
      echo "== side-by-side stage $stage: $OUT/stage_$stage.log, last lines:"; tail -n 40 "$OUT/stage_$stage.log"
    done
  fi
  save_caches "$GPU_MODEL" "$AUTOTUNE_FAMILY"
done
# at most 8 files come back from a device call: the stage logs and the training runs' logs in one tarball
LOGS=$(cd "$OUT" && ls stage_*.log train_mlm_logs.tar.gz 2>/dev/null)
if [ -n "$LOGS" ]; then
  # shellcheck disable=SC2086
  (cd "$OUT" && tar -czf logs.tar.gz $LOGS && rm -f $LOGS)
fi
echo "suite total $(( $(date +%s) - T0 ))s"
exit "$RC"
