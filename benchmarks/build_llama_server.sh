#!/usr/bin/env bash
# Build llama.cpp's `llama-server` and `llama-bench`, the peers of benchmarks/compare.py's
# llama-server sections, and `llama-quantize`, which writes the model-1b section's Q4_0, Q8_0 and
# Q4_K_M files, from the llama.cpp source that llama-cpp-python ships (so both peers run
# the same llama.cpp), into a cache directory outside the repository.
#
#   benchmarks/build_llama_server.sh [--with-amx] [--force] [--cache-dir DIR] [--jobs N]
#
# Prints the directory holding the three binaries (last line of output). Skips the build when all
# three are already there (--force rebuilds). About 13 CPU-minutes of compiling plus a 76 MB download;
# on a shared machine run it as `nice -n 19 benchmarks/build_llama_server.sh`.
#
#   --with-amx      keep llama.cpp's AMX kernels (see below); built into DIR-amx by default
#   --force         rebuild even when the binaries exist
#   --cache-dir DIR where the binaries go (default:
#                   ${XDG_CACHE_HOME:-~/.cache}/pyxllm/llama.cpp-VERSION, with -amx appended
#                   for --with-amx), as DIR/bin/llama-server, DIR/bin/llama-bench and
#                   DIR/bin/llama-quantize
#   --jobs N        parallel compile jobs (default: the number of cores)
#
# Environment: LLAMA_CPP_PYTHON_VERSION (default 0.3.36), PYTHON (the interpreter whose pip
# downloads the source; default: the repository's .venv, else python3).
#
# Why AMX is off by default: on a CPU with AMX (amx_int8), llama.cpp 0.3.36 built with
# -march=native selects its AMX kernels, and llama_decode segfaults on the first multi-token batch
# (a 10-token prompt) with the default Q4_1 GGUF. A native build with the AMX instructions
# disabled (-mno-amx-tile -mno-amx-int8 -mno-amx-bf16; GCC applies an explicit -mno-* whatever
# its place relative to -march=native) runs correctly and keeps every other native extension
# (AVX-512, VNNI, BF16). On a CPU without AMX the flags change nothing.
set -euo pipefail

version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
with_amx=0
force=0
cache_dir=""
jobs="$(nproc 2>/dev/null || echo 2)"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --with-amx) with_amx=1 ;;
        --force) force=1 ;;
        --cache-dir)
            [[ $# -ge 2 ]] || { echo "error: --cache-dir needs a directory" >&2; exit 2; }
            cache_dir="$2"
            shift
            ;;
        --jobs)
            [[ $# -ge 2 && "$2" =~ ^[1-9][0-9]*$ ]] || {
                echo "error: --jobs needs a positive integer" >&2
                exit 2
            }
            jobs="$2"
            shift
            ;;
        -h | --help)
            sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
            exit 0
            ;;
        *)
            echo "error: unknown argument $1 (see --help)" >&2
            exit 2
            ;;
    esac
    shift
done

suffix=""
[[ $with_amx == 1 ]] && suffix="-amx"
cache_dir="${cache_dir:-${XDG_CACHE_HOME:-$HOME/.cache}/pyxllm/llama.cpp-${version}${suffix}}"
bin_dir="$cache_dir/bin"
binaries=(llama-server llama-bench llama-quantize)
missing=0
for name in "${binaries[@]}"; do
    [[ -x "$bin_dir/$name" ]] || missing=1
done
if [[ $force == 0 && $missing == 0 ]]; then
    echo "${binaries[*]} already built (--force rebuilds):"
    echo "$bin_dir"
    exit 0
fi

for tool in cmake c++; do
    command -v "$tool" >/dev/null || { echo "error: $tool is needed to build llama.cpp" >&2; exit 1; }
done
repo_root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
    python=python3
    [[ -x "$repo_root/.venv/bin/python" ]] && python="$repo_root/.venv/bin/python"
fi

mkdir -p "$cache_dir"
work="$(mktemp -d "$cache_dir/build.XXXXXX")"
trap 'rm -rf "$work"' EXIT

echo "downloading llama-cpp-python $version's source ..."
"$python" -m pip download --quiet --no-deps --no-binary :all: \
    "llama-cpp-python==$version" -d "$work"
tar -xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
[[ -f "$src/CMakeLists.txt" ]] || { echo "error: no vendor/llama.cpp in the sdist" >&2; exit 1; }

flags=""
[[ $with_amx == 0 ]] && flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
echo "configuring (AMX $([[ $with_amx == 1 ]] && echo on || echo off)) ..."
# static libraries: the two binaries can be copied out of the build tree alone; no web UI (the
# build would fetch it from the network), no HTTPS, no tests or examples
cmake -S "$src" -B "$work/build" "${generator[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON \
    -DCMAKE_C_FLAGS="$flags" \
    -DCMAKE_CXX_FLAGS="$flags" \
    -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF \
    >"$work/configure.log" || { cat "$work/configure.log" >&2; exit 1; }
echo "building ${binaries[*]} with $jobs jobs (minutes) ..."
cmake --build "$work/build" --target "${binaries[@]}" -j "$jobs" >"$work/build.log" \
    || { tail -50 "$work/build.log" >&2; exit 1; }

mkdir -p "$bin_dir"
for name in "${binaries[@]}"; do
    found="$(find "$work/build" -type f -name "$name" -perm -u+x | head -1)"
    [[ -n "$found" ]] || { echo "error: the build made no $name" >&2; exit 1; }
    # the flags must have kept every AMX tile instruction out (where objdump can tell)
    if [[ $with_amx == 0 ]] && command -v objdump >/dev/null \
        && objdump -d "$found" | grep -qE $'\t(ldtilecfg|tileloadd|tdpb[su][su]d|tdpbf16ps) '; then
        echo "error: $name holds AMX instructions despite $flags" >&2
        exit 1
    fi
    install -m 755 "$found" "$bin_dir/$name"
done
{
    echo "llama-cpp-python $version (vendor/llama.cpp), GGML_NATIVE=ON"
    echo "CMAKE_C_FLAGS/CMAKE_CXX_FLAGS: ${flags:-(none: AMX kept)}"
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m)"
} >"$cache_dir/BUILD_INFO"
echo "built:"
echo "$bin_dir"
