#!/usr/bin/env bash
# The whole test suite on a machine without a GPU: creates the environment (ci/env.sh: both engines,
# our packages built from this checkout), then runs every test that is not marked `gpu`.
# Exits non-zero when a test fails; pytest's summary line is the last thing it prints.
#
#   bash ci/test.sh [extra pytest args]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
bash ci/env.sh
venv="${ELASTIC_KV_VENV:-$root/.venv}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$venv/bin/python" -m pytest -m "not gpu" --durations=15 "$@"
