#!/usr/bin/env bash
# Every `gpu`-marked test of the repository, on the GPU machine (no network). Run from anywhere:
#
#   bash ci/gpu.sh                   # build, driver facts, every gpu test group, memcheck, benchmark
#   bash ci/gpu.sh --no-bench        # everything but the benchmark
#   bash ci/gpu.sh --require vllm-engine,ranks   # fail (not NOT RUN) when those groups cannot run
#   bash ci/gpu.sh --only vllm-engine    # build, then only those groups (no memcheck, no benchmark): a device
#                                        # call is limited to 10 minutes, so long groups can run on their own
#
# Each group below has the number of tests that must pass on an H200 machine. pytest exits 0 when every test
# skips (no driver, a missing engine), so the count is checked from pytest's JUnit report: fewer passes than
# the table says fails the group. A group whose prerequisite is missing here (vLLM, SGLang, a second GPU) is
# not run and is listed as NOT RUN with the reason; --require (or --require all) turns that into a failure.
# vLLM comes from the bundle of ci/gpu-bundle/ (PYTHONPATH=/tmp/site); our packages are installed here from
# this checkout (the core built), and their source folders lead PYTHONPATH.
#
# Needs: python3 with torch (CUDA), pybind11, scikit-build-core, cmake, ninja, pytest; compute-sanitizer on
# PATH (or under /usr/local/cuda/bin) for the memcheck step. Every step has a time limit, and a test that hangs
# has its stack printed (faulthandler) before the limit ends it. Logs go to $OUT (or build/gpu-logs); the
# summary comes last; the exit status is non-zero if any step or group failed.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
out="${OUT:-$root/build/gpu-logs}"
mkdir -p "$out"
python="${PYTHON:-python3}"
bench=1
require=""
only=""
while [ $# -gt 0 ]; do
    case "$1" in
        --no-bench) bench=0 ;;
        --require) require="${2:?--require needs a list of groups, or all}"; shift ;;
        --only) only="${2:?--only needs a list of groups}"; shift; bench=0 ;;
        *) echo "usage: bash ci/gpu.sh [--no-bench] [--require GROUP,...|all] [--only GROUP,...]" >&2; exit 2 ;;
    esac
    shift
done
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1   # no network on the GPU machine
export HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 TOKENIZERS_PARALLELISM=false
# Our packages from their source folders, ahead of whatever PYTHONPATH holds (the vLLM bundle's /tmp/site).
export PYTHONPATH="$root/packages/vllm-elastic-kv/src:$root/packages/sglang-elastic-kv/src:$root/packages/elastic-kv-serve/src${PYTHONPATH:+:$PYTHONPATH}"

# group | tests that must pass on an H200 machine | prerequisites (cuda, vllm, sglang, gpus2) | time limit (s) | tests
groups=(
    "dataplane|68|cuda|900|tests/dataplane"     # 3 more skip on CUDA by design: budget tests of the host backend
    "ledger|2|cuda|600|tests/ledger/test_ledger_gpu.py"
    "vllm-zeroing|5|cuda|600|tests/vllm/test_vllm_zeroing_gpu.py"
    # vllm-engine: tiny, gptoss, mla, gdn, ngram (2-4 minutes each; gptoss, mla and gdn need vLLM's MoE
    # kernels: with ci/gpu-bundle/, carry its MoE part too)
    "vllm-engine|5|cuda,vllm|1800|tests/vllm/test_vllm_gpu.py"
    "vllm-sleep|5|cuda,vllm|600|tests/vllm/test_vllm_sleep_gpu.py"   # sleep mode into the host arena
    "vllm-limit|1|cuda,vllm|600|tests/vllm/test_vllm_limit_gpu.py"   # a limit's drain, async scheduling
    "serve-gpu|1|cuda,vllm|600|tests/serve/test_serve_vllm_gpu.py"   # elastic-kv serve suspends a vLLM engine
    "ranks|4|cuda,gpus2|600|tests/ranks/test_ranks_gpu.py"
    "sglang|2|cuda,sglang|600|tests/sglang/test_sglang_gpu.py"
)

declare -a summary=()
failed=0

step() {  # step NAME LOGFILE LIMIT_S COMMAND...
    local name="$1" log="$2" limit="$3"
    shift 3
    local t0=$SECONDS rc=0
    echo "== $name (log: $log, limit ${limit} s)"
    timeout -k 30 "$limit" "$@" >"$log" 2>&1 || rc=$?
    if [ "$rc" -eq 0 ]; then
        summary+=("PASS     $name ($((SECONDS - t0)) s)")
    else
        local why="exit $rc"
        [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && why="timed out after $limit s"
        summary+=("FAIL     $name ($((SECONDS - t0)) s, $why): see $log")
        failed=1
        tail -n 30 "$log"
    fi
    return "$rc"
}

missing() {  # missing PREREQ -> prints why it is missing, or nothing
    case "$1" in
        cuda) [ "$cuda" = 1 ] || echo "no CUDA driver with VMM support" ;;
        vllm) "$python" -c "import vllm" >/dev/null 2>&1 || echo "vLLM not importable (ci/gpu-bundle/README.md)" ;;
        sglang) "$python" -c "import sglang" >/dev/null 2>&1 || echo "SGLang not importable" ;;
        gpus2) [ "$gpus" -ge 2 ] || echo "needs 2 GPUs, this machine has $gpus" ;;
    esac
}

required() {  # required GROUP -> 0 when --require names it
    [ "$require" = all ] || [[ ",$require," == *",$1,"* ]]
}

# Installed, not only on PYTHONPATH: engines that elastic-kv serve starts find the vLLM plugin through its
# entry point.
step "build and install our packages" "$out/build.log" 900 \
    "$python" -m pip install --no-build-isolation --no-deps -v ./packages/elastic-kv-core \
    ./packages/vllm-elastic-kv ./packages/sglang-elastic-kv ./packages/elastic-kv-serve

cuda=0
if step "driver facts" "$out/facts.txt" 120 "$python" - <<'PY'
import torch
from elastic_kv import _vmm
b = _vmm.CudaBackend(0)
free, total = b.mem_info()
print(f"torch {torch.__version__}, device {torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} GPU(s)")
print(f"CUDA driver {b.driver_version}, granularity {b.granularity >> 20} MiB, multi_unmap {b.multi_unmap}")
print(f"memory {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB")
PY
then
    cuda=1
fi
cat "$out/facts.txt" 2>/dev/null
gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"

declare -a table=()
# Every gpu test of the repository must belong to a group above: a new gpu test file outside the table fails.
paths=""
for entry in "${groups[@]}"; do IFS='|' read -r _ _ _ _ tests <<<"$entry"; paths="$paths $tests"; done
if timeout -k 30 600 "$python" -m pytest -m gpu --collect-only -q -p no:cacheprovider tests \
    >"$out/collect.log" 2>&1; then
    stray="$(grep '::' "$out/collect.log" | "$python" -c '
import sys
paths = sys.argv[1:]
for line in sys.stdin:
    node = line.strip()
    if not any(node == p or node.startswith(p.rstrip("/") + ("/" if not p.endswith(".py") else "::")) for p in paths):
        print(node)' $paths)"
    collected="$(grep -c '::' "$out/collect.log")"
    if [ -n "$stray" ]; then
        table+=("FAIL     coverage      gpu tests in no group of ci/gpu.sh: $(echo $stray)")
        failed=1
    else
        table+=("PASS     coverage      all $collected gpu tests of tests/ belong to a group")
    fi
else
    table+=("FAIL     coverage      pytest --collect-only failed: see $out/collect.log")
    failed=1
fi
for entry in "${groups[@]}"; do
    IFS='|' read -r name want needs limit tests <<<"$entry"
    if [ -n "$only" ] && [[ ",$only," != *",$name,"* ]]; then
        continue
    fi
    reasons=""
    for need in ${needs//,/ }; do
        why="$(missing "$need")"
        [ -n "$why" ] && reasons="${reasons:+$reasons; }$why"
    done
    if [ -n "$reasons" ]; then
        if required "$name"; then
            table+=("$(printf 'FAIL     %-13s required, not run: %s' "$name" "$reasons")")
            failed=1
        else
            table+=("$(printf 'NOT RUN  %-13s %s' "$name" "$reasons")")
        fi
        continue
    fi
    log="$out/pytest-$name.log"
    xml="$out/pytest-$name.xml"
    rm -f "$xml"
    t0=$SECONDS
    echo "== gpu tests: $name ($tests; $want must pass; log: $log)"
    rc=0
    timeout -k 30 "$limit" "$python" -m pytest -m gpu $tests -q -rA -p no:cacheprovider \
        -o faulthandler_timeout=600 --junitxml="$xml" >"$log" 2>&1 || rc=$?
    counts="$("$python" - "$xml" <<'PY'
import sys
import xml.etree.ElementTree as ET
try:
    cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
except (OSError, ET.ParseError):
    cases = []
kinds = [next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed") for case in cases]
print(kinds.count("passed"), kinds.count("skipped"), kinds.count("failure") + kinds.count("error"))
PY
)"
    read -r passed skipped bad <<<"$counts"
    took=$((SECONDS - t0))
    detail="$passed passed (want $want), $skipped skipped, $bad failed, $took s"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        table+=("$(printf 'FAIL     %-13s timed out after %s s (%s): see %s' "$name" "$limit" "$detail" "$log")")
        failed=1
    elif [ "$rc" -ne 0 ] || [ "$bad" -gt 0 ] || [ "$passed" -lt "$want" ]; then
        table+=("$(printf 'FAIL     %-13s %s, pytest exit %s: see %s' "$name" "$detail" "$rc" "$log")")
        failed=1
        tail -n 30 "$log"
    elif [ "$passed" -gt "$want" ]; then
        table+=("$(printf 'PASS     %-13s %s; more than the table says: update ci/gpu.sh' "$name" "$detail")")
    else
        table+=("$(printf 'PASS     %-13s %s' "$name" "$detail")")
    fi
done

sanitizer="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)"
if [ -n "$only" ]; then
    summary+=("NOT RUN  compute-sanitizer memcheck: --only")
elif [ "$cuda" = 0 ]; then
    summary+=("NOT RUN  compute-sanitizer memcheck: no CUDA driver")
elif [ -n "$sanitizer" ]; then
    # API errors are not reported: the data plane's rollback tests provoke driver errors on purpose, and the
    # multi-unmap probe may be refused by the driver. The caching allocator would hide out-of-bounds accesses.
    step "compute-sanitizer memcheck (kernels on mapped/unbacked pages)" "$out/memcheck.log" 900 \
        env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$sanitizer" --tool memcheck --report-api-errors no \
        --error-exitcode 86 "$python" -m pytest -m gpu -q -p no:cacheprovider tests/dataplane/test_gpu_kernels.py \
        -k "read_and_write_mapped_pages or unbacked_pages_read_zeros"
    grep -h "ERROR SUMMARY" "$out/memcheck.log" | tail -1
else
    summary+=("NOT RUN  compute-sanitizer memcheck: compute-sanitizer not found")
fi

if [ "$bench" = 1 ] && [ "$cuda" = 1 ]; then
    step "benchmark (benchmarks/vmm_bench.py --backend cuda)" "$out/bench.txt" 600 \
        "$python" benchmarks/vmm_bench.py --backend cuda --gib 1 --repeat 3 --json "$out/bench.json"
    cat "$out/bench.txt"
fi

echo
echo "== summary (logs in $out)"
printf '%s\n' "${summary[@]}"
echo "-- gpu test groups"
printf '%s\n' "${table[@]}"
exit "$failed"
