#!/usr/bin/env bash
# One call on a fresh GPU machine: GPU tests, then the benchmark of the given shapes.
#   bash benchmarks/gpu_check.sh [tests|bench|all|serving] [shape ...]
# serving: writes each shape as a random checkpoint on disk, starts `strata serve` on it and drives it over
# HTTP (benchmarks/http_burst.py: 32 clients at once, a slot decoding while peers' prompts are read).
# Wheels the machine's image lacks can sit in .whl/ (installed to /tmp/site first).
# Results go to $OUT (or ./gpu-results): pytest log, bench.jsonl.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
shift || true
shapes=${*:-q30-half}
out=${OUT:-gpu-results}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
status=0
if [[ $what == tests || $what == all ]]; then
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu 2>&1 | tee "$out/gpu-tests.log" || status=1
fi
if [[ $what == bench || $what == all ]]; then
    args=()
    for s in $shapes; do args+=(--shape "$s"); done
    python3 benchmarks/gpu_bench.py "${args[@]}" --out "$out/bench.jsonl" 2>&1 | tee "$out/bench.log" || status=1
fi
if [[ $what == serving ]]; then
    for s in $shapes; do
        dir=${CHECKPOINTS:-/tmp}/strata-$s
        [[ -f $dir/model.safetensors.index.json ]] || python3 benchmarks/random_checkpoint.py --shape "$s" "$dir"
        python3 benchmarks/http_burst.py --model "$dir" --long-peers 4 --out "$out/serving.jsonl" \
            --serve-arg=--parallel=32 --serve-arg=--kv-memory=24GiB 2>&1 | tee -a "$out/serving.log" || status=1
    done
fi
exit $status
