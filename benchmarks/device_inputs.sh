#!/usr/bin/env bash
# What the GPU machine's image lacks, made here where the package registries answer; run from the repository
# root before the first GPU call of a session, then name both folders in the call's `carry`:
#   bash benchmarks/device_inputs.sh
# .whl/: wheels (CPython 3.12, x86-64 Linux) of the engine's imports the image does not have: msgspec, gguf,
#   platformdirs, llguidance, and the web server's: litestar, websockets, uvicorn with their dependencies
#   (benchmarks/gpu_check.sh installs them to /tmp/site first).
# .llama/llama-src.tar.xz: llama.cpp's tree from llama-cpp-python's source distribution (LLAMA_CPP_PYTHON,
#   default 0.3.36), without what a CUDA build of llama-bench and llama-batched-bench never reads (models,
#   docs, tests, benches, the other backends), about 6 MB; benchmarks/llama_cpp.sh builds it there.
# Both folders are ignored by git. On the machine, `source benchmarks/device_env.sh` installs the wheels.
set -euo pipefail
python=${PYTHON:-.venv/bin/python}
version=${LLAMA_CPP_PYTHON:-0.3.36}
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
    platforms+=(--platform "$p")
done
rm -rf .whl && mkdir -p .whl .llama
for package in msgspec gguf platformdirs llguidance; do
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d .whl "$package"
done
# the web server's (`strata serve`, for gpu_check's serving and long-burst runs), with what they need
"$python" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d .whl litestar websockets uvicorn
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m pip download -q --no-deps --no-binary=:all: -d "$work" "llama-cpp-python==$version"
tar xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
tree="$work/llama_cpp_python-$version/vendor/llama.cpp"
rm -rf "$tree"/{models,docs,tests,benches,media,gguf-py,scripts,conversion,pocs,ci,app,skills}
for backend in "$tree"/ggml/src/ggml-*/; do
    case $(basename "$backend") in ggml-cpu | ggml-cuda) ;; *) rm -rf "$backend" ;; esac
done
tar cJf .llama/llama-src.tar.xz -C "$(dirname "$tree")" llama.cpp
ls -la .whl .llama
