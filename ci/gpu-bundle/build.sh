#!/usr/bin/env bash
# Builds a vLLM 0.26.0 bundle for the GPU machine (Python 3.12, torch 2.11.0+cu130, no network), here on a
# machine that can reach the package index. See ci/gpu-bundle/README.md for the two device calls that unpack it.
#
#   bash ci/gpu-bundle/build.sh [OUT]     # OUT defaults to <repo>/.gpucarry (git-ignored)
#
# Writes OUT/vllm-a/bundle.tar.xz.part0, OUT/vllm-b/{bundle.tar.xz.part1,SHA256SUMS,unpack.sh} and
# OUT/vllm-moe/ (vLLM's MoE kernels, optional): each stays under the 64 MiB that one device call carries.
# About 4 minutes on 2 cores (mostly xz).
#
# Why vLLM 0.26.0: it is the newest vLLM release built against torch 2.11, which is what the GPU image has;
# later releases pin torch 2.13/2.14 and newer CUDA libraries than the image provides.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="${1:-$root/.gpucarry}"
log() { printf '[gpu-bundle] %s\n' "$*" >&2; }

# The wheels: vLLM itself (--no-deps: the image already has torch, triton, transformers, numpy, ...) and the
# small pure-Python or abi3 packages vLLM imports that the image lacks. Pinned so two builds are the same.
offline=(   # what an offline LLM(...) imports beyond the image
    vllm==0.26.0 cbor2==6.3.0 msgspec==0.23.0 pyzmq==27.3.0 pybase64==1.5.1 openai-harmony==0.0.8
    openai==3.57.0 jiter==0.19.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 sniffio==1.3.1
    cachetools==8.0.2 llguidance==1.7.6 xgrammar==0.2.7 apache-tvm-ffi==0.1.10 fastapi==0.136.3
    starlette==1.10.0 partial-json-parser==0.2.1.1.post7 pydantic==2.14.4 pydantic-core==2.50.5
    annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
    depyf==0.20.0 astor==0.8.1 dill==0.4.1 setproctitle==1.3.8 blake3==1.0.11
    compressed-tensors==0.17.0 loguru==0.7.3   # the GDN layer's quantization imports (Qwen3-Next)
)
server=(    # what `python -m vllm.entrypoints.openai.api_server` imports on top (vLLM 0.26's entrypoints/):
    uvicorn==0.54.0 h11==0.16.0 click==8.5.1            # entrypoints/launcher.py (uvicorn's h11 protocol)
    watchfiles==1.3.0 anyio==4.16.0                     # entrypoints/serve/utils/ssl.py (certificate reload)
    prometheus-fastapi-instrumentator==8.1.0            # entrypoints/serve/instrumentator/metrics.py (/metrics)
    model-hosting-container-standards==0.1.16 jmespath==1.0.1   # serve/sagemaker and serve/lora routers
)

platforms=()
for glibc in 2_35 2_34 2_31 2_28 2_27 2_26 2_24 2_17 2_5; do platforms+=(--platform "manylinux_${glibc}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
target=(--python-version 3.12 --implementation cp --only-binary=:all: "${platforms[@]}")

work="$(mktemp -d /tmp/elastic-kv-gpu-bundle.XXXX)"
trap 'rm -rf "$work"' EXIT
log "downloading ${#offline[@]} + ${#server[@]} wheels for CPython 3.12 (pip's cache makes repeats fast)"
PIP_CONSTRAINT='' python3 -m pip download -q --no-deps "${target[@]}" -d "$work/wheels" "${offline[@]}" "${server[@]}" \
    2> >(grep -v -e "is ignored: it is neither" >&2)
log "installing them into a site folder (--target, no dependency resolution)"
PIP_CONSTRAINT='' python3 -m pip install -q --root-user-action=ignore --no-index --no-deps --no-compile "${target[@]}" --target "$work/site" \
    "$work"/wheels/*.whl 2> >(grep -v -e "is ignored: it is neither" >&2)

# Drop what a dense model on an H200 never loads, to fit two device calls: FlashAttention-2 kernels (Hopper
# runs FlashAttention-3), the Rust front end, DeepGEMM builds for other Pythons, console scripts. The MoE
# kernels (the MoE, MLA and GDN families' test models are MoE models) go to a part of their own, carried in
# a third call only by the runs that need them.
moe=vllm/_moe_C_stable_libtorch.abi3.so
mkdir -p "$work/moe"
xz -9e -T2 -c "$work/site/$moe" >"$work/moe/$(basename "$moe").xz"
(cd "$work/site" && rm -rf bin vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so "$moe" \
    vllm/vllm-rs vllm/third_party/deep_gemm/_C.cpython-3{10,11,13,14}-x86_64-linux-gnu.so)

log "compressing (xz -9e, the slow part)"
tar -C "$work/site" --owner=0 --group=0 --sort=name -cf - . | xz -9e -T2 >"$work/bundle.tar.xz"
(cd "$work" && split -b 60M -d -a 1 bundle.tar.xz bundle.tar.xz.part && sha256sum bundle.tar.xz.part* >SHA256SUMS)
(cd "$work/moe" && sha256sum ./*.xz >SHA256SUMS)
parts=("$work"/bundle.tar.xz.part*)
if [ "${#parts[@]}" -ne 2 ]; then
    log "the bundle splits into ${#parts[@]} parts, not 2: trim more, or add a device call to README.md"
    exit 1
fi
rm -rf "$out/vllm-a" "$out/vllm-b" "$out/vllm-moe"
mkdir -p "$out/vllm-a" "$out/vllm-b"
cp "$work/bundle.tar.xz.part0" "$out/vllm-a/"
cp "$work/bundle.tar.xz.part1" "$work/SHA256SUMS" "$here/unpack.sh" "$out/vllm-b/"
cp -r "$work/moe" "$out/vllm-moe"
du -sh "$out/vllm-a" "$out/vllm-b" "$out/vllm-moe"
log "done: carry $out/vllm-a in one device call, then $out/vllm-b in the next (ci/gpu-bundle/README.md);"
log "  for MoE models, $out/vllm-moe in a call between them"
