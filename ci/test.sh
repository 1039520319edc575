#!/usr/bin/env bash
# The whole test suite on a machine without a GPU: creates the environment (ci/env.sh: both engines,
# our packages built from this checkout), then runs every test that is not marked `gpu`.
# Exits non-zero when a test fails; pytest's summary line is the last thing it prints, after the table of
# the slowest tests.
#
#   bash ci/test.sh [extra pytest args]           # everything (what .ci/run and CI run)
#   bash ci/test.sh --quick [extra pytest args]   # the edit-test loop: every test that starts no engine
#                                                 # (not marked vllm, sglang, slow or gpu), a few minutes
#
# Tests run in two pytest-xdist workers (ELASTIC_KV_TEST_WORKERS, default 2; 0 runs them in this process),
# a whole module (or test class) at a time on one worker: an engine start-up is mostly one thread's work, so
# two workers keep both of CI's two cores busy (tests/conftest.py says how the workers share the CPUs).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
marks="not gpu"
if [ "${1:-}" = "--quick" ]; then
    marks="not gpu and not vllm and not sglang and not slow"
    shift
fi
bash ci/env.sh
venv="${ELASTIC_KV_VENV:-$root/.venv}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
workers="${ELASTIC_KV_TEST_WORKERS:-2}"
exec "$venv/bin/python" -m pytest -m "$marks" -n "$workers" --dist loadscope --no-loadscope-reorder \
    --durations=25 "$@"
