# shellcheck shell=bash
# The caches that travel between device calls, sourced by benchmarks/gpu_suite.sh (tests/test_suite_caches.py runs
# these functions on a CPU): restored before the stages, saved into $OUT after every stage group, carried back by
# hand (docs/testing.md, "Caches between calls"). Reads OUT, STACK, TRITON_CACHE_DIR, TILELANG_CACHE_DIR.
#
# - the Triton cache (GDN_CP_SAVE_CACHE): compiled kernels, ~30 MiB compressed, .triton_cache/$STACK/;
# - TileLang's (GDN_CP_SAVE_TL_CACHE): FlashQLA's compiled kernels, .tl_cache/;
# - the autotune results alone (GDN_CP_SAVE_AUTOTUNE): Triton's *.autotune.json (FLA's kernels and gdn-cp's keep
#   their picks there: FLA_CACHE_RESULTS, gdn_cp.ops.fused.triton_launch), a few KiB, per GPU model in
#   .triton_cache/autotune/<model>.<family>.tar.gz. A call that restores them times no config again and compiles
#   only the picked ones: stock's FLA kernels autotuned cold for 192 s in run 2026-12-07w, in a call whose 64 MiB
#   held no room for the whole Triton cache beside .tl and .tl_cache. Per model, so an H100 never runs an H200's
#   picks; per family (autotune_family), so a timed row never runs picks made while other processes shared the GPU.

# unpack_parts TAR DEST: a cache saved in parts (TAR.part00, ...: split_parts) unpacked into DEST; false if none
unpack_parts() { ls "$1".part* >/dev/null 2>&1 && cat "$1".part* | tar -xzf - -C "$2"; }

# split_parts TAR NAME: TAR as $OUT/NAME.part00, part01, ... (15 MiB each: a file that comes back from a device
# call is at most 16 MiB); says its size and parts
split_parts() {
  rm -f "$OUT/$2".part*
  split -b 15m -d "$1" "$OUT/$2.part"
  echo "$(( $(stat -c %s "$1") / 1024 )) KiB in $(ls "$OUT/$2".part* | wc -l) part(s)"
}

# gpu_model: this machine's first GPU as a file name ("NVIDIA_H100_80GB_HBM3"); empty without nvidia-smi
gpu_model() {
  nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | tr -c 'A-Za-z0-9\n' _ | tr -d '\n'
}

# autotune_family STAGES: whose picks a call's stages (GDN_CP_STAGES) share. "timed": only the timed benchmarks
# (layer_full, layer_full_b, glue_kernels), none beside another stage, so each autotune had the GPU to itself;
# "runs": no timed benchmark (tests, training, gradient dumps: ranks side by side). Empty for a call that mixes the
# two or runs a timed one side by side: it neither restores nor saves picks (it autotunes as every call did before).
autotune_family() {
  local group stage timed=0 other=0 contended=0
  for group in $1; do
    for stage in ${group//+/ }; do
      case $stage in
        layer_full|layer_full_b|glue_kernels) timed=1; [ "$group" != "$stage" ] && contended=1 ;;
        *) other=1 ;;
      esac
    done
  done
  if [ $contended = 1 ] || [ $timed = $other ]; then echo ""; elif [ $timed = 1 ]; then echo timed; else echo runs; fi
}

# restore_autotune MODEL FAMILY: .triton_cache/autotune/MODEL.FAMILY.tar.gz into the Triton cache; says how many
restore_autotune() {
  local tar=.triton_cache/autotune/$1.$2.tar.gz
  if [ -n "$1" ] && [ -n "$2" ] && [ -f "$tar" ]; then
    tar -xzf "$tar" -C "$TRITON_CACHE_DIR" \
      && echo "autotune results restored for $1 ($2): $(tar -tzf "$tar" | grep -c '\.autotune\.json$')"
  fi
}

# save_autotune MODEL FAMILY: every *.autotune.json of the Triton cache (restored ones included) as
# $OUT/autotune/MODEL.FAMILY.tar.gz; nothing without a model, a family or a result
save_autotune() {
  local n name=$1.$2.tar.gz
  n=$(find "$TRITON_CACHE_DIR" -name '*.autotune.json' | wc -l)
  if [ -n "$1" ] && [ -n "$2" ] && [ "$n" -gt 0 ]; then
    mkdir -p "$OUT/autotune"
    (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' -print0 | sort -z \
      | tar -czf "$OUT/autotune/$name" --null -T -)
    echo "autotune results saved: $n in autotune/$name (carry it as .triton_cache/autotune/$name)"
  fi
}

# save_caches MODEL FAMILY: what GDN_CP_SAVE_CACHE, GDN_CP_SAVE_TL_CACHE and GDN_CP_SAVE_AUTOTUNE ask for, into $OUT. Of
# the Triton cache only what a cache hit reads: the kernel binaries (*.cubin), their metadata and group files
# (*.json), the launcher modules (*.so) and torch.compile's own cache (inductor/); the intermediate IR (ttir, ttgir,
# llir, ptx, source) is 3/4 of the bytes. Not the autotune results: they travel only in save_autotune's tarball, by
# model and family (in the whole cache, restored into every call, a timed row could run picks made beside other
# work). Past GDN_CP_CACHE_MAX_MB, nothing of it.
save_caches() {
  if [ "${GDN_CP_SAVE_CACHE:-1}" != 0 ]; then
    local TAR=/tmp/triton_cache_$STACK.tar.gz MAX=$(( ${GDN_CP_CACHE_MAX_MB:-56} * 1024 * 1024 ))
    (cd "$TRITON_CACHE_DIR" && find . -type f \( -name '*.cubin' -o -name '*.json' -o -name '*.so' -o -path './inductor/*' \) \
      ! -name '*.autotune.json' -print0 | tar -czf "$TAR" --null -T -)
    if [ "$(stat -c %s "$TAR")" -gt "$MAX" ]; then
      echo "triton cache is $(( $(stat -c %s "$TAR") / 1048576 )) MiB compressed, over GDN_CP_CACHE_MAX_MB: not kept"
    else
      echo "triton cache saved: $(split_parts "$TAR" cache.tar.gz); files $(find "$TRITON_CACHE_DIR" -type f | wc -l)"
    fi
  fi
  if [ "${GDN_CP_SAVE_AUTOTUNE:-1}" != 0 ]; then
    save_autotune "$1" "$2"
  fi
  # TileLang's kernel cache (FlashQLA's compiled kernels), split like the Triton cache
  if [ "${GDN_CP_SAVE_TL_CACHE:-1}" != 0 ] && [ -n "$(find "$TILELANG_CACHE_DIR" -type f ! -name .restored -print -quit)" ]; then
    (cd "$TILELANG_CACHE_DIR" && tar -czf /tmp/tl_cache.tar.gz --exclude=.restored .)
    echo "tilelang cache saved: $(split_parts /tmp/tl_cache.tar.gz tl_cache.tar.gz), $(find "$TILELANG_CACHE_DIR" -type f | wc -l) files"
  fi
}
