#!/usr/bin/env bash
# Builds core_ext with ThreadSanitizer, then with AddressSanitizer + UndefinedBehaviorSanitizer, and runs the
# multi-threaded stress driver (core_ext/tests/stress.cpp) under each. Any report fails the run.
#
#   bash core_ext/tests/sanitize.sh            # both
#   bash core_ext/tests/sanitize.sh thread     # one of: thread, address
#   ROUNDS=2000 bash core_ext/tests/sanitize.sh
#
# Needs a C++17 compiler with sanitizer runtimes (gcc or clang), cmake >= 3.18 and ninja (or make).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
rounds="${ROUNDS:-400}"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)

run() {
    local san="$1" flags
    flags="-fsanitize=$san -fno-omit-frame-pointer -g -O1"
    if [ "$san" = address ]; then flags="$flags -fsanitize=undefined -fno-sanitize-recover=undefined"; fi
    local build="$root/build/sanitize-$san"
    echo "== $san: building in $build"
    cmake -S "$root/core_ext" -B "$build" "${generator[@]}" -DELASTIC_KV_BUILD_PYTHON=OFF \
        -DELASTIC_KV_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS="$flags" \
        -DCMAKE_EXE_LINKER_FLAGS="$flags" >/dev/null
    cmake --build "$build" >/dev/null
    echo "== $san: vmm_stress $rounds"
    TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
        ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:abort_on_error=0" \
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
        "$build/vmm_stress" "$rounds"
    echo "== $san: clean"
}

if [ $# -eq 0 ]; then set -- thread address; fi
for san in "$@"; do run "$san"; done
