#!/usr/bin/env bash
# On the GPU machine: joins the two parts of the vLLM bundle, checks them, unpacks them into a site folder and
# imports vLLM and its OpenAI server from it. Run from the repository root in the second device call
# (ci/gpu-bundle/README.md):
#
#   bash .gpucarry/vllm-b/unpack.sh [SITE]      # SITE defaults to /tmp/site
#
# The first device call has left part 0 in /tmp/vparts (the machine's /tmp survives between calls while the
# machine stays warm). Afterwards: export PYTHONPATH=SITE VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1.
set -euo pipefail
site="${1:-/tmp/site}"
here="$(cd "$(dirname "$0")" && pwd)"
parts=/tmp/vparts
if [ ! -f "$parts/bundle.tar.xz.part0" ]; then
    echo "unpack: $parts/bundle.tar.xz.part0 is missing (a fresh machine?): repeat the first device call" >&2
    exit 3
fi
cp "$here/bundle.tar.xz.part1" "$here/SHA256SUMS" "$parts/"
(cd "$parts" && sha256sum --quiet -c SHA256SUMS)
mkdir -p "$site"
cat "$parts/bundle.tar.xz.part0" "$parts/bundle.tar.xz.part1" | python3 -c '
import sys, tarfile
tarfile.open(fileobj=sys.stdin.buffer, mode="r|xz").extractall(sys.argv[1], filter="tar")' "$site"
# vLLM's MoE kernels, where a call before this one left them in /tmp/vparts/moe (README.md: MoE models).
if [ -f "$parts/moe/SHA256SUMS" ]; then
    (cd "$parts/moe" && sha256sum --quiet -c SHA256SUMS)
    for kernel in "$parts"/moe/*.xz; do xz -dc "$kernel" >"$site/vllm/$(basename "$kernel" .xz)"; done
    echo "unpack: with vLLM's MoE kernels"
fi
# FlashInfer is not in the bundle: vLLM must not pick its sampler.
PYTHONPATH="$site" VLLM_USE_FLASHINFER_SAMPLER=0 python3 -c '
import torch, vllm
import vllm.entrypoints.openai.api_server  # the HTTP server imports everything it serves with
print(f"unpack: vllm {vllm.__version__} (OpenAI server importable), torch {torch.__version__}")'
