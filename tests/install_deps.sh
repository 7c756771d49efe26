#!/usr/bin/env bash
# Install what the test suite needs into the current Python environment, meant to be a fresh
# virtual environment (python3 -m venv .venv && . .venv/bin/activate; .ci/run makes one):
# torch 2.13.0, gdn-cp with its test extras (pytest, hypothesis and two linters), megatron-core
# 0.19.2 (+ triton, which it imports) and the gdn-cp patch applied to that megatron-core.
# Outside a virtual environment it refuses (exit 2) before installing anything, since it would
# patch the megatron-core of that environment; --any-env installs there anyway (e.g. a conda env).
#
# megatron-core 0.19.2 declares Python >= 3.12 but its sources run on 3.11: there we build
# its sdist with --ignore-requires-python. On 3.12+ it installs normally.
set -euo pipefail
PY=${PYTHON:-python3}
ANY_ENV=0
for arg in "$@"; do
  case $arg in
    --any-env) ANY_ENV=1 ;;
    *) echo "tests/install_deps.sh: error: unknown argument $arg; usage: bash tests/install_deps.sh [--any-env]" >&2
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

# one progress line per step (about a minute in all on 2 cores with a fast index); two pip calls (each
# start costs seconds): what resolves normally, then what must not pull dependencies
START=$SECONDS
step() { echo "tests/install_deps.sh: [$1/4] $2 ($(( SECONDS - START )) s so far)"; }
step 1 "torch 2.13.0, gdn-cp (editable) with its test extras (pytest, hypothesis, hadolint, shellcheck), packaging, numpy"
"$PY" -m pip install -q torch==2.13.0 -e ".[test]" "packaging>=24.2" numpy
# megatron.core imports triton at import time; --no-deps keeps pip from touching torch.
if "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)'; then
  step 2 "megatron-core 0.19.2 and triton (megatron.core imports it)"
  "$PY" -m pip install -q --no-deps megatron-core==0.19.2 triton
else
  step 2 "megatron-core 0.19.2 from its sources (it declares Python >= 3.12; they run on this one) and triton"
  "$PY" -m pip install -q --no-deps --no-binary megatron-core --ignore-requires-python megatron-core==0.19.2 triton
fi
step 3 "gdn-cp patch apply"
"$PY" -m gdn_cp.cli patch apply
step 4 "gdn-cp patch check --expect patched"
"$PY" -m gdn_cp.cli patch check --expect patched
echo "tests/install_deps.sh: done in $(( SECONDS - START )) s; run the tests with: python3 -m pytest"
