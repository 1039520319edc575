#!/usr/bin/env bash
# The H200 benchmark runs, driven within the GPU machine's limits (one command runs at most 10 minutes, a
# machine is held at most 30 minutes and handed back about 30 s after a call ends): `start` launches the
# whole plan detached (setsid) and returns at once; each later `poll` waits while it runs and brings back
# whatever has finished, so a plan longer than one call runs across back-to-back calls.
#
#   bash .gpucarry/vllm-b/unpack.sh && bash ci/gpu-bench.sh start [STEP ...]   # the bundle's second call
#   bash ci/gpu-bench.sh poll [--wait SECONDS]    # later calls, each begun within 30 s of the last one
#
# Steps, run in the order given (default: tests n8 n12 n3):
#   tests  bash ci/gpu.sh --only vllm-limit,vllm-sleep,serve-gpu: a limit drain under async scheduling, the
#          sleep-mode backend, a suspension through serve
#   gpu:GROUP,...  bash ci/gpu.sh --only GROUP,...: other groups of ci/gpu.sh, or fewer
#   n8     eight 8B models, elastic-kv serve (sleep set-up), 16 bursts x 24 reaching every model, load 4
#   n8w    the same with kv_share_min_weights = 0.5 (models take turns rather than share slivers of KV),
#          out in n8w-0.5; n8w-R with R instead of 0.5 (n8w-1 keeps each serving model's KV at least its weights)
#   n12    twelve 8B models, the same at 24 bursts x 16
#   n3     three 8B models, static then elastic, loads 8 and 16
#   n3b    the same at load 8 with bursts of 256: static's loss follows the burst size against its share, not
#          the load (at 3 x 128 static attains 69-89 % at every load from 2 to 16)
# A step that fails is recorded and the next one runs. `poll` packs into $OUT/gpu-bench.tar.gz (one file: a
# device call brings back at most eight): the driver's log, each step's log tail, the benchmark's
# results.json, report.md, plots, alone.json, the serve log, the engine log tails, host memory over time and the
# GPU test logs; `python benchmarks/multi_model.py --out DIR --report-only` redraws a report here.
# Needs the vLLM bundle of ci/gpu-bundle/ unpacked at /tmp/site (unpack.sh), python3 with pip.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="${GPU_BENCH_DIR:-/tmp/gpu-bench}"
dest_dir="${OUT:-$root/build/gpu-bench}"   # a device call brings back at most 8 files: one archive
out="$work/collected/gpu-bench"

usage() { echo "usage: bash ci/gpu-bench.sh start [tests|gpu:GROUP,...|n8|n8w[-R]|n12|n3|n3b ...] | poll [--wait SECONDS]" >&2; exit 2; }

step_command() {  # step_command STEP -> the step's command line
    local bench="python3 benchmarks/multi_model.py --device cuda --setups sleep --loads 4 --cover"
    case "$1" in
        tests) echo "bash ci/gpu.sh --only vllm-limit,vllm-sleep,serve-gpu" ;;
        gpu:*) echo "bash ci/gpu.sh --only ${1#gpu:}" ;;
        n8) echo "$bench --out $work/n8 --models 8 --bursts 16 --burst-size 24" ;;
        n8w) step_command n8w-0.5 ;;
        n8w-*) [[ "${1#n8w-}" =~ ^[0-9]+(\.[0-9]+)?$ ]] || return 1
            echo "$bench --out $work/$1 --models 8 --bursts 16 --burst-size 24 \
--serve-option kv_share_min_weights=${1#n8w-}" ;;
        n12) echo "$bench --out $work/n12 --models 12 --bursts 24 --burst-size 16" ;;
        n3) echo "python3 benchmarks/multi_model.py --device cuda --out $work/n3 --models 3 --setups static,elastic \
--loads 8,16" ;;
        n3b) echo "python3 benchmarks/multi_model.py --device cuda --out $work/n3b --models 3 --setups static,elastic \
--loads 8 --bursts 3 --burst-size 256" ;;
        *) return 1 ;;
    esac
}

run_plan() {  # the detached job: install, then every step; one line per step in $work/status
    cd "$root" || exit 1
    export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
    export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1 OUT="$work/gpu-logs"
    (while sleep 10; do echo "$(date +%T) $(free -m | awk '/^Mem:/ {print "used_mib=" $3, "available_mib=" $7}')"
     done) >"$work/host-memory.log" 2>&1 &
    local sampler=$!
    { date; nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv; free -g; df -h /dev/shm /tmp; } \
        >"$work/machine.txt" 2>&1
    local t0=$SECONDS
    if ! python3 -m pip install -q --no-build-isolation --no-deps ./packages/elastic-kv-core \
        ./packages/vllm-elastic-kv ./packages/elastic-kv-serve >"$work/install.log" 2>&1; then
        echo "install FAIL $((SECONDS - t0)) s" >>"$work/status"
        kill "$sampler"
        return 1
    fi
    echo "install PASS $((SECONDS - t0)) s" >>"$work/status"
    for step in "$@"; do
        t0=$SECONDS
        echo "$step RUNNING" >"$work/current"
        local rc=0
        timeout -k 30 1500 bash -c "$(step_command "$step")" >"$work/$step.log" 2>&1 || rc=$?
        local verdict=PASS
        [ "$rc" -eq 0 ] || verdict="FAIL(exit $rc)"
        echo "$step $verdict $((SECONDS - t0)) s" >>"$work/status"
    done
    rm -f "$work/current"
    echo "done" >>"$work/status"
    kill "$sampler"
}

collect() {  # pack what exists now into $dest_dir/gpu-bench.tar.gz
    rm -rf "$out"
    mkdir -p "$out"
    cp -f "$work"/status "$work"/machine.txt "$work"/host-memory.log "$work"/install.log "$out"/ 2>/dev/null
    for log in "$work"/*.log; do
        [ -f "$log" ] && tail -n 200 "$log" >"$out/$(basename "$log" .log).tail.log"
    done
    for dir in "$work"/n*/; do
        [ -d "$dir" ] || continue
        local name dest
        name="$(basename "$dir")"
        dest="$out/$name"
        mkdir -p "$dest"
        cp -f "$dir"/*.json "$dir"/*.md "$dir"/*.png "$dir"/models.toml "$dest"/ 2>/dev/null
        # the whole serve log (it compresses well): every sleep, wake and wait for room is in it
        cp -f "$dir/logs/sleep-serve.log" "$dest"/ 2>/dev/null
        for engine in "$dir"/logs/sleep-engines/*.log "$dir"/logs/static-*.log "$dir"/logs/elastic-*.log; do
            [ -f "$engine" ] && { echo "==== $(basename "$engine")"; tail -n 40 "$engine"; }
        done >"$dest/engines.tail.log"
    done
    if [ -d "$work/gpu-logs" ]; then
        mkdir -p "$out/gpu-logs"
        for log in "$work"/gpu-logs/*; do
            [ -f "$log" ] && tail -n 300 "$log" >"$out/gpu-logs/$(basename "$log")"
        done
    fi
    mkdir -p "$dest_dir"
    tar -czf "$dest_dir/gpu-bench.tar.gz" -C "$(dirname "$out")" gpu-bench
}

case "${1:-}" in
    start)
        shift
        steps=("$@")
        [ ${#steps[@]} -gt 0 ] || steps=(tests n8 n12 n3)
        for step in "${steps[@]}"; do step_command "$step" >/dev/null || usage; done
        [ -d /tmp/site/vllm ] || { echo "gpu-bench: no vLLM bundle at /tmp/site (run unpack.sh first)" >&2; exit 1; }
        if [ -f "$work/current" ]; then echo "gpu-bench: a plan is running already ($(cat "$work/current"))" >&2
            exit 1; fi
        mkdir -p "$work"
        rm -f "$work/status"
        export -f run_plan step_command
        export root work
        setsid bash -c 'run_plan "$@"' run_plan "${steps[@]}" >"$work/driver.log" 2>&1 </dev/null &
        echo "gpu-bench: started ${steps[*]} (pid $!); poll with: bash ci/gpu-bench.sh poll"
        ;;
    poll)
        shift
        wait_s=500
        if [ "${1:-}" = "--wait" ]; then wait_s="${2:?--wait needs seconds}"; shift 2; fi
        [ $# -eq 0 ] || usage
        [ -d "$work" ] || { echo "gpu-bench: nothing started here ($work is missing: a fresh machine?)" >&2; exit 1; }
        end=$((SECONDS + wait_s))
        while [ $SECONDS -lt $end ] && ! grep -qx done "$work/status" 2>/dev/null; do sleep 5; done
        collect
        echo "== status"; cat "$work/status" 2>/dev/null
        [ -f "$work/current" ] && echo "running: $(cat "$work/current")"
        echo "== host memory (last)"; tail -n 2 "$work/host-memory.log" 2>/dev/null
        for log in "$work"/n*.log "$work"/tests.log; do
            [ -f "$log" ] && { echo "== $(basename "$log") (last lines)"; tail -n 6 "$log"; }
        done
        ;;
    *) usage ;;
esac
