#!/usr/bin/env bash
# The docker image's smoke command (its CMD): on a machine with a GPU,
#
#   docker run --gpus all --ipc=host --rm gdn-cp            # or: bash docker/smoke.sh
#
# 1. gdn-cp doctor                       versions, patch state, GPUs
# 2. gdn-cp patch check --expect patched  the patch tests/install_deps.sh and the image apply
# 3. gdn-cp selftest --gpu               FLA's kernels against the reference on this GPU + stack
# 4. the GPU suite                       `pytest -m gpu` on tests/gpu (benchmarks/gpu_suite.sh's
#                                        selection) and tests/megatron
# 5. the test command of CI and README   `python3 -m pytest` (.ci/run), here with -q
#
# Every step runs even when an earlier one fails; the exit status is 1 when any failed.
# Extra arguments go to both pytest runs (e.g. -x, -k name).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

failed=()
step() {
  local name=$1
  shift
  echo
  echo "== ${name}: $*"
  local t0=$SECONDS
  if "$@"; then
    echo "== ${name}: ok ($((SECONDS - t0)) s)"
  else
    local rc=$?
    echo "== ${name}: FAILED (exit ${rc}, $((SECONDS - t0)) s)"
    failed+=("${name}")
  fi
}

step doctor gdn-cp doctor
step patch-check gdn-cp patch check --expect patched
step selftest gdn-cp selftest --gpu
step gpu-suite python3 -m pytest -m gpu tests/gpu tests/megatron -q "$@"
step ci-tests python3 -m pytest -q "$@"

echo
if [ ${#failed[@]} -gt 0 ]; then
  echo "smoke: FAILED: ${failed[*]}"
  exit 1
fi
echo "smoke: all steps passed"
