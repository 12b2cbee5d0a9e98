#!/usr/bin/env bash
# Installs everything the CPU test suite needs, then runs it: `bash scripts/test.sh [PYTEST ARGS]`.
# Runs in the active Python environment (the one `pip` and `python` name).
set -euo pipefail
cd "$(dirname "$0")/.."

# System packages, only as root on a Debian-like machine and only when missing:
# chromium for the MegaScope UI browser tests (tests/scope_ui/test_scope_ui.py),
# iproute2 (`ip`) for the tests that put ranks in network namespaces.
missing=()
[ -x /usr/bin/chromium ] || missing+=(chromium)
command -v ip >/dev/null || [ -x /usr/sbin/ip ] || missing+=(iproute2)
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "installing ${missing[*]} (apt-get)"
  (apt-get install -y -q "${missing[@]}" || (apt-get update -q && apt-get install -y -q "${missing[@]}")) >/dev/null \
    || echo "could not install ${missing[*]}: the tests that need them will skip"
fi

# The master-AdamW Triton kernel is checked on the CPU through Triton's interpreter
# (tests/engine/test_master_adam_interpret.py); Triton goes beside the environment (.ci/triton), not into it,
# so nothing else in the environment picks it up.
if [ ! -d .ci/triton/triton ]; then
  pip install -q --no-deps --target .ci/triton triton==3.5.0 \
    || echo "could not install triton: the interpreter test will skip"
fi

pip install -q torch==2.13.0 -e '.[test]'
python -m pytest -q "$@"
