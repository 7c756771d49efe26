#!/usr/bin/env bash
# Install what the test suite needs into the current Python environment:
# CPU torch (from the local wheel where there is one), gdn-cp with its test extras,
# megatron-core 0.19.2 (+ triton, which it imports) and the gdn-cp patch applied to it.
#
# megatron-core 0.19.2 declares Python >= 3.12 but its sources run on 3.11: there we build
# its sdist with --ignore-requires-python. On 3.12+ it installs normally.
set -euo pipefail
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.."

"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q -e ".[test]"
if "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)'; then
  "$PY" -m pip install -q --no-deps megatron-core==0.19.2
else
  "$PY" -m pip install -q --no-binary megatron-core --ignore-requires-python --no-deps megatron-core==0.19.2
fi
# megatron.core imports triton at import time; --no-deps keeps pip from touching torch.
"$PY" -m pip install -q --no-deps triton
"$PY" -m pip install -q "packaging>=24.2" numpy
"$PY" -m gdn_cp.cli patch apply
"$PY" -m gdn_cp.cli patch check --expect patched
