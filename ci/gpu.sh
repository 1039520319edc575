#!/usr/bin/env bash
# GPU checks of the data plane, for the GPU machine (one H200; no network). Run from anywhere:
#
#   bash ci/gpu.sh               # build, driver facts, pytest -m gpu (data plane, the vLLM plugin's zeroing),
#                                # compute-sanitizer memcheck, benchmark
#   bash ci/gpu.sh --no-bench    # everything but the benchmark
#
# Needs: python3 with torch (CUDA), pybind11, scikit-build-core, cmake, ninja, pytest; compute-sanitizer on PATH
# (or under /usr/local/cuda/bin) for the memcheck step. Writes logs to $OUT (or build/gpu-logs) and prints a
# summary; exits non-zero if any step failed.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
out="${OUT:-$root/build/gpu-logs}"
mkdir -p "$out"
python="${PYTHON:-python3}"
bench=1
[ "${1:-}" = "--no-bench" ] && bench=0
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1   # no network on the GPU machine
declare -a summary=()
failed=0

step() {  # step NAME LOGFILE COMMAND...
    local name="$1" log="$2"
    shift 2
    local t0=$SECONDS
    echo "== $name (log: $log)"
    if "$@" >"$log" 2>&1; then
        summary+=("PASS  $name ($((SECONDS - t0)) s)")
    else
        summary+=("FAIL  $name ($((SECONDS - t0)) s): see $log")
        failed=1
        tail -n 30 "$log"
    fi
}

step "build elastic-kv-core" "$out/build.log" \
    "$python" -m pip install --no-build-isolation --no-deps -v ./packages/elastic-kv-core

step "driver facts" "$out/facts.txt" "$python" - <<'PY'
import torch
from elastic_kv import _vmm
b = _vmm.CudaBackend(0)
free, total = b.mem_info()
print(f"torch {torch.__version__}, device {torch.cuda.get_device_name(0)}")
print(f"CUDA driver {b.driver_version}, granularity {b.granularity >> 20} MiB, multi_unmap {b.multi_unmap}")
print(f"memory {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB")
PY
cat "$out/facts.txt" 2>/dev/null

step "pytest -m gpu tests/dataplane" "$out/pytest-gpu.log" \
    "$python" -m pytest -m gpu tests/dataplane -q -rA -p no:cacheprovider
# Without a usable driver every gpu test skips and pytest still exits 0: insist that they really ran.
passed="$(grep -oE '[0-9]+ passed' "$out/pytest-gpu.log" | tail -1 | cut -d' ' -f1)"
if [ "${passed:-0}" -lt 60 ]; then
    summary+=("FAIL  gpu tests ran: only ${passed:-0} passed (expected >= 60; were they skipped?)")
    failed=1
fi

# The vLLM plugin's zeroing of new pages (its own streams and events; needs no vLLM, only the plugin's source).
step "pytest -m gpu tests/vllm/test_vllm_zeroing_gpu.py" "$out/pytest-gpu-zeroing.log" \
    env PYTHONPATH="$root/packages/vllm-elastic-kv/src${PYTHONPATH:+:$PYTHONPATH}" \
    "$python" -m pytest -m gpu tests/vllm/test_vllm_zeroing_gpu.py -q -rA -p no:cacheprovider
passed="$(grep -oE '[0-9]+ passed' "$out/pytest-gpu-zeroing.log" | tail -1 | cut -d' ' -f1)"
if [ "${passed:-0}" -lt 5 ]; then
    summary+=("FAIL  zeroing gpu tests ran: only ${passed:-0} passed (expected 5; were they skipped?)")
    failed=1
fi

sanitizer="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)"
if [ -n "$sanitizer" ]; then
    # API errors are not reported: the data plane's rollback tests provoke driver errors on purpose, and the
    # multi-unmap probe may be refused by the driver. The caching allocator would hide out-of-bounds accesses.
    step "compute-sanitizer memcheck (kernels on mapped/unbacked pages)" "$out/memcheck.log" \
        env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$sanitizer" --tool memcheck --report-api-errors no \
        --error-exitcode 86 "$python" -m pytest -m gpu -q -p no:cacheprovider tests/dataplane/test_gpu_kernels.py \
        -k "read_and_write_mapped_pages or unbacked_pages_read_zeros"
    grep -h "ERROR SUMMARY" "$out/memcheck.log" | tail -1
else
    summary+=("SKIP  compute-sanitizer memcheck: compute-sanitizer not found")
fi

if [ "$bench" = 1 ]; then
    step "benchmark (benchmarks/vmm_bench.py --backend cuda)" "$out/bench.txt" \
        "$python" benchmarks/vmm_bench.py --backend cuda --gib 1 --repeat 3 --json "$out/bench.json"
    cat "$out/bench.txt"
fi

echo
echo "== summary (logs in $out)"
printf '%s\n' "${summary[@]}"
tail -n 1 "$out/pytest-gpu.log"
exit "$failed"
