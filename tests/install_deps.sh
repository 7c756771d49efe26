#!/usr/bin/env bash
# Install what the test suite needs into the current Python environment, meant to be a fresh
# virtual environment (python3 -m venv .venv && . .venv/bin/activate; .ci/run makes one):
# torch 2.13.0, gdn-cp with its test extras (pytest, hypothesis and three linters: hadolint, shellcheck, ruff), megatron-core
# 0.19.2 (+ triton, which it imports) and the gdn-cp patch applied to that megatron-core. Every package
# it installs is pinned by tests/constraints.txt to the version CI ran the test suite with.
# Outside a virtual environment it refuses (exit 2) before installing anything, since it would
# patch the megatron-core of that environment; --any-env installs there anyway (e.g. a conda env).
#
# torch: `pip install torch==2.13.0` takes whatever build the configured index serves. On Linux PyPI
# serves the CUDA build (several GB with its CUDA libraries: a 4.8 GB environment); --cpu-torch takes
# the CPU build instead, from PyTorch's CPU index (CPU_TORCH_INDEX) on Linux, from the configured index
# elsewhere (PyPI's macOS and Windows wheels are CPU builds), and keeps a CPU torch 2.13.0 already
# installed; where that index cannot be reached it says so in one line and takes torch from the configured
# index. The tests need no GPU. Either way the script says which build it installed.
#
# megatron-core 0.19.2 declares Python >= 3.12 but its sources run on 3.11: there we build
# its sdist with --ignore-requires-python. On 3.12+ it installs normally.
set -euo pipefail
PY=${PYTHON:-python3}
TORCH=2.13.0
CPU_TORCH_INDEX=${CPU_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
ANY_ENV=0
CPU_TORCH=0
for arg in "$@"; do
  case $arg in
    --any-env) ANY_ENV=1 ;;
    --cpu-torch) CPU_TORCH=1 ;;
    *) echo "tests/install_deps.sh: error: unknown argument $arg; usage: bash tests/install_deps.sh [--cpu-torch]" \
         "[--any-env]" >&2
       exit 2 ;;
  esac
done
if [ "$ANY_ENV" != 1 ] && ! "$PY" -c 'import sys; sys.exit(0 if sys.prefix != sys.base_prefix else 1)'; then
  echo "tests/install_deps.sh: error: $("$PY" -c 'import sys; print(sys.prefix)') is not a virtual environment, and" \
    "this script would patch its megatron-core and install the test tools into it; run it in a fresh one" \
    "(python3 -m venv .venv && . .venv/bin/activate), or pass --any-env to install here anyway" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
PINS=tests/constraints.txt  # every package below, at the version CI tested

# one progress line per step (about a minute in all on 2 cores with a fast index); two pip calls (three with
# --cpu-torch where torch is not there yet; each
# start costs seconds): what resolves normally, then what must not pull dependencies
START=$SECONDS
step() { echo "tests/install_deps.sh: [$1/4] $2 ($(( SECONDS - START )) s so far)"; }
# the reason a package index cannot be reached within 10 s (exit 0), or nothing (exit 1: it answers); the
# request runs in a thread pool only to get its exception back as a value, on one line
index_unreachable() {
  "$PY" -c 'import sys, urllib.request as u, concurrent.futures as f; e = f.ThreadPoolExecutor(1).submit(lambda: u.urlopen(sys.argv[1], timeout=10).close()).exception(); print(getattr(e, "reason", None) or e or type(e).__name__) if e else sys.exit(1)' "$1"
}
# torch's version and build, read from its version.py without importing torch ("2.13.0+cpu CPU",
# "2.13.0 CUDA 13.0"; "none" when there is none)
torch_build() {
  "$PY" -c 'import importlib.util as u, pathlib as p; s = u.find_spec("torch"); v = {}; s and exec((p.Path(s.origin).parent / "version.py").read_text(), v); print(v["__version__"] + " " + ("CUDA " + v["cuda"] if v.get("cuda") else "ROCm" if v.get("hip") else "CPU") if s else "none")'
}
DEPS="gdn-cp (editable) with its test extras (pytest, hypothesis, hadolint, shellcheck, ruff), packaging, numpy"
if [ "$CPU_TORCH" = 1 ]; then
  build=$(torch_build)
  version=${build%% *}
  if [ "${version%%+*}" = "$TORCH" ] && [ "${build##* }" = CPU ]; then
    step 1 "torch $TORCH: the CPU build installed here ($build) is kept; $DEPS"
  elif [ "$(uname -s)" = Linux ] && ! why=$(index_unreachable "$CPU_TORCH_INDEX/torch/"); then
    step 1 "torch $TORCH, its CPU build (--cpu-torch), from $CPU_TORCH_INDEX; then $DEPS"
    # torch alone from that index; its dependencies come from the configured one, under the pins, below
    "$PY" -m pip install -q --no-deps "torch==$TORCH" --index-url "$CPU_TORCH_INDEX"
  elif [ "$(uname -s)" = Linux ]; then
    step 1 "--cpu-torch: PyTorch's CPU index cannot be reached ($why); torch $TORCH from the configured index" \
      "instead (the build it serves: PyPI's is the CUDA one, several GB), $DEPS"
  else
    step 1 "torch $TORCH, its CPU build (--cpu-torch: the configured index serves CPU builds on $(uname -s)), $DEPS"
  fi
else
  step 1 "torch $TORCH from the configured index (on Linux PyPI's is the CUDA build, several GB: --cpu-torch takes the CPU one), $DEPS"
fi
# (not --no-compile: it saves ~12 s here, but the test ranks run with -B and then compile torch's modules in
# every process: CI took 405 s instead of 336)
"$PY" -m pip install -q -c "$PINS" "torch==$TORCH" -e ".[test]" packaging numpy
echo "tests/install_deps.sh: installed torch $(torch_build) build"
# megatron.core imports triton at import time; --no-deps keeps pip from touching torch.
if "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)'; then
  step 2 "megatron-core 0.19.2 and triton (megatron.core imports it)"
  "$PY" -m pip install -q -c "$PINS" --no-deps megatron-core==0.19.2 triton
else
  step 2 "megatron-core 0.19.2 from its sources (it declares Python >= 3.12; they run on this one) and triton"
  "$PY" -m pip install -q -c "$PINS" --no-deps --no-binary megatron-core --ignore-requires-python megatron-core==0.19.2 \
    triton
fi
step 3 "gdn-cp patch apply"
"$PY" -m gdn_cp.cli patch apply
step 4 "gdn-cp patch check --expect patched"
"$PY" -m gdn_cp.cli patch check --expect patched
echo "tests/install_deps.sh: done in $(( SECONDS - START )) s; run the tests with: python3 -m pytest"
