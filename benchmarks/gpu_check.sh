#!/usr/bin/env bash
# One call on a fresh GPU machine: GPU tests (GPU_TEST_FILES: the files, default all of tests/gpu, more than
# one call's 10 minutes; GPU_TESTS_K selects as pytest -k), then the benchmark of the given shapes.
#   bash benchmarks/gpu_check.sh [tests|bench|all|serving|split|tier|tier-large|serving-large] [shape ...]
# tier: the expert tier's GPU tests and benchmarks/expert_tier.py on q30-half (no expert / 96 resident on the
# random router's routing, the 96 spread over every layer and gathered into whole layers; 32 resident on Zipf
# and the demo model's routing, frozen / blocking / async);
# pool: the CPU pool's kernel on the host (Q4_K, Q5_K, Q6_K, bf16) and the host's memory shared by a copy and the
# pool (host_reads.py, 8 experts), then the tier's batch-1 decode by phase with the pool in the step's thread
# (STRATA_POOL_BACKGROUND=0), on its own with the step waiting (STRATA_POOL_DEVICE_WAIT=0), and the defaults:
# q30-half at 0 and 96 resident, the Q4_K file at 25%; then q30-half's uniform figures at 0 and 96 resident
# (spread, then whole layers);
# device-wait: the frozen tier's GPU tests, host_reads.py, then batch-1 and batch-8 decode of q30-half at 0 and
# 96 resident with the pool in the step's thread, on its own, and so with the device waiting for it, and at 96
# in whole layers with the defaults;
# tier-large: the full 48-layer Qwen3-Next shape built tiered (368 experts a layer on an H200's card, 200 on an
# 80 GB one: LARGE_RESIDENT);
# serving-large: the same shape served over HTTP (`strata serve --expert-cache` as above, its weights drawn as they
# load: `random_checkpoint.py --drawn-on-load`): one stream, one 8K-token prompt read alone, 8 streams decoding
# together, then 8 clients with 8K-token prompts at once (LARGE_SCENARIOS: http_burst.py's to run;
# LARGE_SERVE_ARGS: more `strata serve` options, e.g. "--max-batched-tokens=2048").
# serving: writes each shape as a random checkpoint on disk, starts `strata serve` on it and drives it over
# HTTP (benchmarks/http_burst.py: 32 clients at once, a slot decoding while peers' prompts are read).
# split: the split's GPU tests (SPLIT_TESTS=0 skips them), then `strata bench` on each shape's weights drawn as
# they load at 1, 2, 4, 8 and 32 concurrent (one engine a configuration), whole on one GPU, split in two with
# one slot group, and with pipelined groups (on a machine of one GPU both stages share it: --stage-gpus 0,0);
# then over HTTP a decoding slot while a peer's 32K prompt is read on the split (two groups).
# gguf: the held-weight GPU tests, the CUDA held kernels' and the one-launch routing's (GGUF_TESTS=0 skips
# them, GGUF_TESTS_K selects as pytest -k, GPU_TEST_FILES names others), with NCU_KINDS Nsight Compute's counters of those kinds' expert
# kernels at 8 tokens (ncu-KIND.txt), benchmarks/tune_held.py at TUNE_TOKENS tokens where given
# (TUNE_VARIANTS: the kernels' defines to try, TUNE_PER_PAIR: windows up to which to try a block a pair,
# TUNE_PER_EXPERT: windows up to which to try a block an expert,
# TUNE_SPLIT_WAVES: the dense projections' k splits to try, TUNE_DENSE_VARIANTS: their defines to try, e.g.
# "- DENSE_STAGES=5" (each a word: "-" none; a variant's several defines joined by commas,
# "STAGES=4,DOWN_STAGES=2"); benchmarks/pick_held.py's pick then serves the runs below), then
# benchmarks/gguf_bench.py on a random q30 file of each quant type named (default Q4_K; again with each of
# AB_ENV's NAME=VALUE settings in its environment, e.g. AB_ENV="STRATA_FUSED_DECODE=0") and, with
# PROFILE_BATCH, benchmarks/profile_window.py's kernels of its decode windows of that batch (PROFILE_UNFUSED=1:
# again with the MoE blocks' pieces, STRATA_FUSED_DECODE=0); also with the
# expert tier at a 25% budget (--expert-cache 32, whole layers: --expert-placement TIER_PLACEMENT, default
# layers, as llama.cpp's --n-cpu-moe keeps them) for the types in TIER_KINDS (default: every one named), and
# llama.cpp on the same files (benchmarks/llama_cpp.sh), with 18 of 24 layers' experts on the CPU (CPU_MOE=18)
# where a tier ran (LLAMA=0: Strata alone, no llama.cpp build); with REPEAT=N both engines run N times in turn,
# and benchmarks/gguf_compare.py prints each figure's runs, medians and their ratio (compare.jsonl).
# kv: the 8-bit KV GPU tests, then benchmarks/kv_dtype_bench.py on the shape (32K and 128K-token prompts and
# the decode after them, KV bf16 / fp8 / int8) and benchmarks/kv_agreement.py (the demo model's greedy tokens
# over 8-bit KV against bf16's).
# kv-stream: the streamed KV's GPU tests, then benchmarks/kv_dtype_bench.py with 64K tokens of the pool on the
# device (KV_RESIDENT) and the rest in host RAM, at 32K / 128K / 256K-token prompts, KV bf16 / fp8 / int8 (and
# 128K bf16 again with a copy a run of host blocks instead of the block-copy kernel: STRATA_KV_GATHER=0);
# then benchmarks/chat_turns.py on a random checkpoint of the shape: 8 users with 16K-token chats taking turns
# two at a time, 64K tokens of the pool on the card, blocks moved onto the card or left where first given.
# long-burst: the shape's weights drawn as they load, taking 128K positions, served on a simulated 24 GB card
# (experts and KV capped: SERVE_ARGS, by default --expert-vram 14GiB, --kv-memory 40GiB of which
# --kv-resident 65536 tokens on the device) and driven over HTTP: 4 peers with 96K-token prompts (LONG_PROMPT) arriving together
# beside a decoding stream, their first-token times against one read alone; then the same with every expert on
# the card (unless SERVE_ARGS is given).
# decode: the fused decode steps' GPU tests and the end-to-end ones, then the decode windows of Qwen3-Next's
# shapes cut to 12 layers profiled with the fused steps off and on (STRATA_FUSED_DECODE).
# decode-bench: benchmarks/gpu_bench.py on qnext at 12 layers, at the most that fit, and on q30-half.
# drafts: the drafts' and Gated DeltaNet kernels' GPU tests, then benchmarks/drafts.py on the demo model at 1, 4
# and 8 slots (no drafts, n-gram, MTP head; 256 tokens each).
# Wheels the machine's image lacks can sit in .whl/ (benchmarks/device_env.sh installs them to /tmp/site).
# Results go to $OUT (or ./gpu-results): pytest log, bench.jsonl.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
shift || true
shapes=${*:-q30-half}
out=${OUT:-gpu-results}
mkdir -p "$out"
# shellcheck source=benchmarks/device_env.sh
source benchmarks/device_env.sh  # the wheels of .whl/, unbuffered output, the native CPU kernel
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
status=0
if [[ $what == tests || $what == all ]]; then
    # shellcheck disable=SC2086
    python3 -m pytest -q -p no:cacheprovider -m gpu ${GPU_TEST_FILES:-tests/gpu} -k "${GPU_TESTS_K:-}" 2>&1 \
        | tee "$out/gpu-tests.log" || status=1
fi
if [[ $what == bench || $what == all ]]; then
    args=()
    for s in $shapes; do args+=(--shape "$s"); done
    python3 benchmarks/gpu_bench.py "${args[@]}" --out "$out/bench.jsonl" 2>&1 | tee "$out/bench.log" || status=1
fi
if [[ $what == kv ]]; then
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_kv_quant_gpu.py tests/gpu/test_triton_norm_gpu.py \
        tests/gpu/test_triton_attention_gpu.py 2>&1 | tee "$out/gpu-tests.log" || status=1
    python3 benchmarks/kv_dtype_bench.py --shape "${shapes%% *}" --out "$out/kv.jsonl" 2>&1 | tee "$out/kv.log" \
        || status=1
    python3 benchmarks/kv_agreement.py --device cuda --out "$out/kv-agreement.jsonl" 2>&1 | tee -a "$out/kv.log" \
        || status=1
fi
if [[ $what == kv-stream ]]; then
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_kv_stream_gpu.py 2>&1 | tee "$out/gpu-tests.log" \
        || status=1
    python3 benchmarks/kv_dtype_bench.py --shape "${shapes%% *}" --kv-resident "${KV_RESIDENT:-65536}" \
        --contexts 32768 131072 262144 --out "$out/kv-stream.jsonl" 2>&1 | tee "$out/kv-stream.log" || status=1
    STRATA_KV_GATHER=0 python3 benchmarks/kv_dtype_bench.py --shape "${shapes%% *}" --kv auto \
        --kv-resident "${KV_RESIDENT:-65536}" --contexts 131072 --out "$out/kv-stream-copies.jsonl" 2>&1 \
        | tee -a "$out/kv-stream.log" || status=1
    s=${shapes%% *}
    dir=${CHECKPOINTS:-/tmp}/strata-$s-32k
    [[ -f $dir/model.safetensors.index.json ]] || python3 benchmarks/random_checkpoint.py --shape "$s" \
        --context 32768 "$dir"
    for stay in "" --stay-put; do
        # shellcheck disable=SC2086
        python3 benchmarks/chat_turns.py --model "$dir" --device cuda --users 8 --active 2 --rounds 12 \
            --first 16384 --message 512 --answer 128 --kv-resident 65536 --kv-gib 16 $stay \
            --out "$out/chat-turns.jsonl" 2>&1 | tee -a "$out/chat-turns.log" || status=1
    done
fi
if [[ $what == decode ]]; then
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_decode_steps_gpu.py tests/gpu/test_triton_gdn_gpu.py \
        tests/gpu/test_triton_norm_gpu.py tests/gpu/test_fast_path_gpu.py 2>&1 | tee "$out/gpu-tests.log" || status=1
    for fused in 0 1; do
        STRATA_FUSED_DECODE=$fused python3 benchmarks/profile_window.py --shape qnext --layers 12 --batch 1 --batch 8 \
            --batch 32 --no-prefill --top 30 2>&1 | tee "$out/profile-fused$fused.log" || status=1
    done
fi
if [[ $what == decode-bench ]]; then
    python3 benchmarks/gpu_bench.py --shape qnext --layers 12 --skip-hf --out "$out/bench.jsonl" 2>&1 \
        | tee "$out/bench.log" || status=1
    python3 benchmarks/gpu_bench.py --shape qnext --shape q30-half --skip-hf --out "$out/bench.jsonl" 2>&1 \
        | tee -a "$out/bench.log" || status=1
fi
if [[ $what == serving ]]; then
    for s in $shapes; do
        dir=${CHECKPOINTS:-/tmp}/strata-$s
        [[ -f $dir/model.safetensors.index.json ]] || python3 benchmarks/random_checkpoint.py --shape "$s" "$dir"
        python3 benchmarks/http_burst.py --model "$dir" --long-peers 4 --out "$out/serving.jsonl" \
            --serve-arg=--parallel=32 --serve-arg=--kv-memory=24GiB 2>&1 | tee -a "$out/serving.log" || status=1
    done
fi
if [[ $what == long-burst ]]; then
    s=${shapes%% *}
    dir=${CHECKPOINTS:-/tmp}/strata-$s-128k-drawn
    [[ -f $dir/random_weights.json ]] || python3 benchmarks/random_checkpoint.py --shape "$s" --drawn-on-load \
        --context 131072 "$dir"
    # the 24 GB card's budget, then (unless SERVE_ARGS names one) the same KV with every expert on the card
    budgets=("${SERVE_ARGS:---expert-vram=14GiB --kv-memory=40GiB --kv-resident=65536}")
    [[ -n ${SERVE_ARGS:-} ]] || budgets+=("--kv-memory=40GiB --kv-resident=65536")
    for args in "${budgets[@]}"; do
        read -ra serve <<<"$args"
        python3 benchmarks/http_burst.py --model "$dir" --clients 8 --long-peers 4 \
            --long-prompt-len "${LONG_PROMPT:-98304}" --observer-tokens 30000 --scenarios solo,long_peers \
            --out "$out/long-burst.jsonl" \
            "${serve[@]/#/--serve-arg=}" --serve-arg=--parallel=8 --serve-arg=--max-batched-tokens=8192 \
            2>&1 | tee -a "$out/long-burst.log" || status=1
    done
fi
if [[ $what == split ]]; then
    if [[ ${SPLIT_TESTS:-1} != 0 ]]; then
        python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_layer_split_gpu.py 2>&1 \
            | tee "$out/gpu-tests.log" || status=1
    fi
    for s in $shapes; do
        # weights drawn as they load: no 30-160 GB written to the disk first
        dir=${CHECKPOINTS:-/tmp}/strata-$s-drawn
        [[ -f $dir/random_weights.json ]] || python3 benchmarks/random_checkpoint.py --shape "$s" --drawn-on-load "$dir"
        cards=$(python3 -c "import torch; print('0,1' if torch.cuda.device_count() > 1 else '0,0')")
        # --kv-memory is a stage's: two stages sharing an 80 GB card take half each
        kv=$([[ $cards == 0,1 ]] && echo 24GiB || echo 12GiB)
        for split in "" "--layer-split 2 --stage-gpus $cards --batch-groups 1" \
            "--layer-split 2 --stage-gpus $cards --batch-groups 2"; do
            # shellcheck disable=SC2086
            python3 -m app.cli bench --model "$dir" --parallel 32 --kv-memory $kv --concurrency 1 2 4 8 32 \
                --prompt-len 512 --output-len 128 $split >>"$out/split.jsonl" 2>>"$out/split.log" || status=1
        done
        # a decoding slot while a peer's 32K prompt is read on the split, over HTTP
        python3 benchmarks/http_burst.py --model "$dir" --long-peers 1 --long-prompt-len 32768 \
            --scenarios solo,long_peers --out "$out/split-long-peer.jsonl" --serve-arg=--layer-split=2 \
            --serve-arg=--stage-gpus="$cards" --serve-arg=--batch-groups=2 --serve-arg=--parallel=8 \
            --serve-arg=--kv-memory=$kv 2>&1 | tee -a "$out/split.log" || status=1
    done
fi
if [[ $what == drafts ]]; then
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_drafts_gpu.py tests/gpu/test_triton_gdn_gpu.py 2>&1 \
        | tee "$out/gpu-tests.log" || status=1
    python3 benchmarks/drafts.py --concurrency 1 4 8 --output-len 256 --out "$out/drafts.jsonl" 2>&1 \
        | grep -v Warning | tee "$out/drafts.log" || status=1
fi
if [[ $what == tier ]]; then
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_tier_link_gpu.py tests/gpu/test_fast_path_gpu.py -k tier 2>&1 \
        | tee "$out/gpu-tests.log" || status=1
    python3 benchmarks/expert_tier.py --routing uniform --resident 0 96 --adapt frozen \
        --out "$out/tier.jsonl" 2>&1 | tee "$out/tier.log" || status=1
    python3 benchmarks/expert_tier.py --routing uniform --resident 96 --adapt frozen --placement layers \
        --out "$out/tier.jsonl" 2>&1 | tee -a "$out/tier.log" || status=1
    python3 benchmarks/expert_tier.py --routing zipf demo --resident 32 --adapt frozen blocking async \
        --out "$out/tier.jsonl" 2>&1 | tee -a "$out/tier.log" || status=1
fi
if [[ $what == pool ]]; then
    # the CPU pool's kernel on this host (POOL_KERNELS=0 skips it), then the tier's batch-1 decode by phase
    # under each of POOL_SETTINGS (words of NAME=VALUE settings joined by commas, "-" none; by default the pool
    # in the step's thread, then on its own thread with the step waiting for it, then the defaults: the graph
    # after a cut launched while it runs, the device waiting for it), one after the other: q30-half at 0 and 96 experts resident a layer (uniform routing) and the Q4_K file at a 25%
    # budget (whole layers); then issue 15's uniform figures (0 and 96 resident) with FINAL_ENV (NAME=VALUE
    # words, default none)
    if [[ ${POOL_KERNELS:-1} != 0 ]]; then
        python3 benchmarks/cpu_experts.py --kinds q4_k q5_k q6_k bf16 --rows 1 4 --per-call 1 2 4 8 --gap-us 0 \
            2>&1 | tee "$out/pool.log" || status=1
    fi
    # the host's memory shared by a copy and the CPU pool: the bound on batch-1 decode with no expert resident
    python3 benchmarks/host_reads.py --counts 8 2>&1 | tee "$out/pool-host-reads.json" | tee -a "$out/pool.log" \
        || status=1
    python3 benchmarks/gguf_bench.py write --kind Q4_K --out /tmp/q30-Q4_K.gguf >/dev/null || status=1
    for setting in ${POOL_SETTINGS:-STRATA_POOL_BACKGROUND=0 STRATA_POOL_DEVICE_WAIT=0 -}; do
        [[ $setting == - ]] && setting=STRATA_POOL_DEVICE_WAIT=1  # the defaults
        echo "$setting" | tee -a "$out/pool.log"
        read -ra settings <<<"${setting//,/ }"
        for resident in 0 96; do
            env "${settings[@]}" python3 benchmarks/expert_tier.py --routing uniform --resident $resident --phases \
                --out "$out/pool-phases.jsonl" 2>&1 | tail -1 | tee -a "$out/pool.log" || status=1
        done
        env "${settings[@]}" python3 benchmarks/gguf_bench.py strata --model /tmp/q30-Q4_K.gguf --expert-cache 32 \
            --expert-placement layers --phases --out "$out/pool-gguf-phases.jsonl" 2>&1 | tail -1 \
            | tee -a "$out/pool.log" || status=1
    done
    read -ra final <<<"${FINAL_ENV:-STRATA_POOL_DEVICE_WAIT=1}"
    env "${final[@]}" python3 benchmarks/expert_tier.py --routing uniform --resident 0 96 --adapt frozen \
        --out "$out/pool-tier.jsonl" 2>&1 | tee -a "$out/pool.log" || status=1
    env "${final[@]}" python3 benchmarks/expert_tier.py --routing uniform --resident 96 --adapt frozen \
        --placement layers --out "$out/pool-tier.jsonl" 2>&1 | tee -a "$out/pool.log" || status=1
fi
if [[ $what == device-wait ]]; then
    # the frozen tier's GPU tests (device wait among them), the host's memory shared by a copy and the pool,
    # then q30-half's batch-1 and batch-8 decode at 0 and 96 resident (uniform routing) with the pool in the
    # step's thread, on its own with the step waiting for it, and on its own with the graph after each cut
    # launched while it runs, the device waiting (the defaults), then 96 in whole layers with the defaults
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_fast_path_gpu.py \
        tests/gpu/test_tier_link_gpu.py -k "frozen_expert_tier or hand_over" 2>&1 | tee "$out/gpu-tests.log" \
        || status=1
    python3 benchmarks/host_reads.py --counts 8 2>&1 | tee "$out/host-reads.json" || status=1
    for setting in "0 0" "1 0" "1 1"; do
        read -r background wait <<<"$setting"
        STRATA_POOL_BACKGROUND=$background STRATA_POOL_DEVICE_WAIT=$wait timeout 200 python3 \
            benchmarks/expert_tier.py --routing uniform --resident 0 96 --adapt frozen --batches 1 8 --prompts \
            --no-whole --out "$out/device-wait.jsonl" 2>&1 | tail -2 || status=1
    done
    timeout 150 python3 benchmarks/expert_tier.py --routing uniform --resident 96 --adapt frozen \
        --placement layers --batches 1 8 --prompts --no-whole --out "$out/device-wait.jsonl" 2>&1 | tail -1 \
        || status=1
fi
# experts a layer of the 48-layer Qwen3-Next shape (6.3 MB each, 512 a layer) on the card: LARGE_RESIDENT, else
# 368 (111 GB) on a card of more than 120 GB (an H200), 200 (60 GB) on an 80 GB one, whose host then pins 94 GB
card_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
large_resident=${LARGE_RESIDENT:-$( (( ${card_mib:-0} > 120000 )) && echo 368 || echo 200)}
if [[ $what == tier-large ]]; then
    python3 benchmarks/expert_tier.py --shape qnext --resident "$large_resident" --routing zipf --adapt blocking \
        --out "$out/tier.jsonl" 2>&1 | tee "$out/tier.log" || status=1
fi
if [[ $what == serving-large ]]; then
    # the same shape served over HTTP, its weights drawn as they load (160 GB would not fit the disk)
    dir=${CHECKPOINTS:-/tmp}/strata-qnext-drawn
    [[ -f $dir/random_weights.json ]] || python3 benchmarks/random_checkpoint.py --shape qnext --drawn-on-load "$dir"
    serve_args=()
    for a in ${LARGE_SERVE_ARGS:-}; do serve_args+=("--serve-arg=$a"); done
    python3 benchmarks/http_burst.py --model "$dir" --clients 8 --prompt-len 8192 --output-len 128 \
        --scenarios "${LARGE_SCENARIOS:-solo,read,together,burst}" --out "$out/serving-large.jsonl" \
        --serve-arg=--expert-cache="$large_resident" --serve-arg=--parallel=8 --serve-arg=--kv-memory=8GiB \
        "${serve_args[@]}" --ready-timeout 1800 2>&1 | tee -a "$out/serving-large.log" || status=1
fi
if [[ $what == gguf ]]; then
    # the kinds to time are the arguments (default Q4_K); llama.cpp builds (niced) beside Strata's runs from
    # .llama/llama-src.tar.xz (its binaries, 42 MB packed, cannot travel with the tree, so every call builds)
    kinds=${*:-Q4_K}
    build=/tmp/llama-build
    builder=
    if [[ ${LLAMA:-1} != 0 ]]; then
        nice -n 19 bash benchmarks/llama_cpp.sh .llama/llama-src.tar.xz $build >"$out/llama-build.log" 2>&1 &
        builder=$!
    fi
    if [[ ${GGUF_TESTS:-1} != 0 ]]; then
        # shellcheck disable=SC2086
        python3 -m pytest -q -p no:cacheprovider -m gpu ${GPU_TEST_FILES:-tests/gpu/test_cuda_held_gpu.py \
            tests/gpu/test_held_gpu.py tests/gpu/test_triton_moe_gpu.py::test_a_window_routed_in_one_launch_routes_as_its_pieces} \
            -k "${GGUF_TESTS_K:-}" 2>&1 | tee "$out/gpu-tests.log" || status=1
    fi
    for kind in ${NCU_KINDS:-}; do
        # Nsight Compute's counters of one layer's expert kernels at 8 tokens (two windows: grouping, gate_up,
        # down), serialised by the profiler, so each kernel's time, DRAM throughput, occupancy and stalls are
        # its own
        timeout 200 ncu --clock-control none --target-processes all -k "regex:held_.*_(gate_up|rows)|group_pairs" \
            --launch-skip 12 --launch-count 6 --section SpeedOfLight --section MemoryWorkloadAnalysis \
            --section Occupancy --section WarpStateStats --section LaunchStats --section SchedulerStats \
            --section SourceCounters python3 benchmarks/tune_held.py --kinds "$kind" --tokens 8 --default-only \
            --experts-only >"$out/ncu-$kind.txt" 2>&1 || status=1
        grep -E "^  [a-z_0-9]+ \(|Duration|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Waves Per SM" \
            "$out/ncu-$kind.txt" | head -60
    done
    if [[ -n ${TUNE_TOKENS:-} ]]; then
        # experts at 2 and 4 warps a block and each of TUNE_VARIANTS (words of defines, "-": none), then the
        # projections; the pick becomes this call's settings for the runs below
        read -ra variants <<<"${TUNE_VARIANTS:--}"
        per_pair=()
        [[ -n ${TUNE_PER_PAIR:-} ]] && read -ra per_pair <<<"--per-pair $TUNE_PER_PAIR"
        [[ -n ${TUNE_PER_EXPERT:-} ]] && per_pair+=(--per-expert $TUNE_PER_EXPERT)
        python3 benchmarks/tune_held.py --kinds $kinds --tokens $TUNE_TOKENS --default-only --experts-only \
            --warps 2 4 --variants "${variants[@]}" "${per_pair[@]}" 2>&1 | tee "$out/tune-held.log" || status=1
        split=() dense_variants=()
        [[ -n ${TUNE_SPLIT_WAVES:-} ]] && read -ra split <<<"--split-waves $TUNE_SPLIT_WAVES"
        [[ -n ${TUNE_DENSE_VARIANTS:-} ]] && read -ra dense_variants <<<"--variants $TUNE_DENSE_VARIANTS"
        python3 benchmarks/tune_held.py --kinds $kinds --tokens $TUNE_TOKENS --default-only --dense-only "${split[@]}" \
            "${dense_variants[@]}" 2>&1 | tee "$out/tune-dense.log" || status=1
        eval "$(python3 benchmarks/pick_held.py "$out/tune-held.log" "$out/tune-dense.log")"
        env | grep STRATA_CUDA_HELD | tee "$out/picked.txt"
    fi
    time_strata() {  # the file's decode and 8K prompt, every expert on the card
        python3 benchmarks/gguf_bench.py strata --model "$1" --out "$out/gguf.jsonl" 2>&1 | tee -a "$out/gguf.log" \
            || status=1
    }
    files=() tiered=()
    for kind in $kinds; do
        file=/tmp/q30-$kind.gguf
        python3 benchmarks/gguf_bench.py write --kind "$kind" --out "$file" || status=1
        time_strata "$file"
        for setting in ${AB_ENV:-}; do  # the same run again with each setting (NAME=VALUE) in its environment
            echo "$setting" | tee -a "$out/gguf.log"
            env "$setting" python3 benchmarks/gguf_bench.py strata --model "$file" --out "$out/gguf-ab.jsonl" 2>&1 \
                | tee -a "$out/gguf.log" || status=1
        done
        if [[ -n ${PROFILE_BATCH:-} ]]; then
            python3 benchmarks/profile_window.py --model "$file" --batch "$PROFILE_BATCH" --no-prefill --top 30 \
                2>&1 | tee -a "$out/profile.log" || status=1
            if [[ ${PROFILE_UNFUSED:-0} != 0 ]]; then  # the same window with the MoE blocks' pieces
                echo "STRATA_FUSED_DECODE=0" | tee -a "$out/profile.log"
                STRATA_FUSED_DECODE=0 python3 benchmarks/profile_window.py --model "$file" --batch "$PROFILE_BATCH" \
                    --no-prefill --top 30 2>&1 | tee -a "$out/profile.log" || status=1
            fi
        fi
        files+=("$file")
        if [[ " ${TIER_KINDS:-$kinds} " == *" $kind "* ]]; then
            # the expert tier at a 25% budget: 32 of 128 experts a layer on the card, the file's blocks
            python3 benchmarks/gguf_bench.py strata --model "$file" --expert-cache 32 \
                --expert-placement "${TIER_PLACEMENT:-layers}" --out "$out/gguf-tier.jsonl" 2>&1 | tee -a "$out/gguf.log" || status=1
            tiered+=("$file")
        fi
    done
    if [[ -z $builder ]]; then
        exit $status
    fi
    wait $builder || { status=1; tail -30 $build/ninja.log $build/cmake.log; }
    bash benchmarks/llama_cpp.sh .llama/llama-src.tar.xz $build "${files[@]}" 2>&1 | tee "$out/llama.jsonl" \
        || status=1
    for ((round = 2; round <= ${REPEAT:-1}; round++)); do  # both engines again, one after the other
        for file in "${files[@]}"; do
            time_strata "$file"
        done
        bash benchmarks/llama_cpp.sh .llama/llama-src.tar.xz $build "${files[@]}" 2>&1 | tee -a "$out/llama.jsonl" \
            || status=1
    done
    python3 benchmarks/gguf_compare.py --strata "$out/gguf.jsonl" --llama "$out/llama.jsonl" 2>&1 \
        | tee "$out/compare.jsonl" || status=1
    if ((${#tiered[@]})); then
        CPU_MOE=18 ONLY_CPU_MOE=1 bash benchmarks/llama_cpp.sh .llama/llama-src.tar.xz $build "${tiered[@]}" 2>&1 \
            | tee -a "$out/llama.jsonl" || status=1
    fi
fi
exit $status
