#!/usr/bin/env bash
# llama.cpp on the same GGUF files, built for this GPU from a source tree (llama-cpp-python's source
# distribution vendors one; its vendor/llama.cpp packed as a .tar.xz, models/, docs/ and tests/ left out):
#   bash benchmarks/llama_cpp.sh SRC.tar.xz BUILD_DIR FILE.gguf [FILE.gguf ...]
# llama-bench: batch-1 decode of 128 tokens and an 8K-token prompt (flash attention, every layer on the
# GPU); llama-batched-bench: aggregate decode of 1, 8 and 32 sequences of 128-token prompts, 128 tokens each.
# With CPU_MOE=N set, then the same files with the experts of N layers kept in host RAM and computed on the
# CPU (llama.cpp's --n-cpu-moe; N=18 of 24 layers is the expert tier's 25% budget): an 8K prompt, batch-1
# decode, and 1 and 8 sequences (ONLY_CPU_MOE=1: only those). Prints JSON lines; a BUILD_DIR already holding
# the binaries is reused.
set -euo pipefail
src=$1 build=$2
shift 2
if [[ ! -x $build/bin/llama-bench ]]; then
    mkdir -p "$build/src"
    tar xJf "$src" -C "$build/src"
    cmake -S "$build/src/llama.cpp" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF >"$build/cmake.log" 2>&1
    ninja -C "$build" llama-bench llama-batched-bench >"$build/ninja.log" 2>&1
fi
for file in "$@"; do
    [[ -n ${ONLY_CPU_MOE:-} ]] && break
    "$build/bin/llama-bench" -m "$file" -ngl 99 -fa 1 -p 8192 -n 128 -r 3 -o jsonl
    "$build/bin/llama-batched-bench" -m "$file" -ngl 99 -fa on -c 16384 -b 2048 -ub 512 \
        -npp 128 -ntg 128 -npl 1,8,32 --output-format jsonl
done
if [[ -n ${CPU_MOE:-} ]]; then
    for file in "$@"; do
        "$build/bin/llama-bench" -m "$file" -ngl 99 -fa 1 -ncmoe "$CPU_MOE" -p 8192 -n 128 -r 2 -o jsonl
        "$build/bin/llama-batched-bench" -m "$file" -ngl 99 -fa on -c 16384 -b 2048 -ub 512 \
            --n-cpu-moe "$CPU_MOE" -npp 128 -ntg 128 -npl 1,8 --output-format jsonl
    done
fi
