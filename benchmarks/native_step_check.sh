#!/usr/bin/env bash
# One GPU call for the expert tier's native small-window host step (app/models/tier_step.py): its GPU tests,
# the host step's time on this machine's host (benchmarks/tier_host_step.py), then q30-half's batch-1 decode
# with no expert resident, the native step and the Python one (STRATA_NATIVE_STEP=0) in turn, REPEAT times
# (default 2), and once by phase with the native step. Writes under $OUT (or OUT_DIR).
#   source benchmarks/device_env.sh; bash benchmarks/native_step_check.sh
set -uo pipefail
out=${OUT_DIR:-${OUT:-/tmp/native-step}}
mkdir -p "$out"
status=0
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_tier_link_gpu.py \
    tests/gpu/test_fast_path_gpu.py -k "native or frozen_expert_tier" >"$out/gpu-tests.log" 2>&1 || status=1
tail -3 "$out/gpu-tests.log"
python3 benchmarks/tier_host_step.py 2>&1 | tee "$out/host-step.json" || status=1
for _ in $(seq "${REPEAT:-2}"); do
    for native in 1 0; do
        STRATA_NATIVE_STEP=$native timeout 120 python3 benchmarks/expert_tier.py --routing uniform --resident 0 \
            --adapt frozen --batches 1 --prompts --no-whole --out "$out/decode.jsonl" >>"$out/decode.log" 2>&1 \
            || status=1
    done
done
timeout 150 python3 benchmarks/expert_tier.py --routing uniform --resident 0 --phases --out "$out/phases.jsonl" \
    >>"$out/decode.log" 2>&1 || status=1
python3 - "$out" <<'PY'
import json, sys
for name in ("decode", "phases"):
    for line in open(f"{sys.argv[1]}/{name}.jsonl"):
        r = json.loads(line)
        print(name, "native" if r.get("native_step") else "python", r["decode_bs1_tok_s"], r.get("us_per_layer", ""))
PY
exit $status
