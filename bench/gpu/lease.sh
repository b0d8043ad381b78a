#!/usr/bin/env bash
# What a session lent a GPU runs, one device call each (each under the 10-minute limit).
# A task is lent 15 minutes of device time in all, the machine's start included, so `first`
# is the one call to make (timeout_s 590): the gpu-marked tests, the targets of bench.gpu
# --quick, and the engine's host time, each cut short by its own time box so the next still runs.
#   bash bench/gpu/lease.sh first   # ~9 min at most: what a task's device time holds
# Then, with device time left (`status` budget_left_s >= the box + ~60 s), while the machine
# is still warm:
#   bash bench/gpu/lease.sh quantized [box]  # ~3 min: bench.gpu --only quantized, 8B then 1B
#                                   # (the quantized GEMMs and the 8-bit KV cache's decode
#                                   # attention against bf16); box: seconds, default 300
#   bash bench/gpu/lease.sh profile [box]  # ~3 min: pdserve profile of the 8B, then the 1B
#                                   # shapes on the GPU (random weights from the config), the
#                                   # hardware profile pdserve plan reads; box default 240
#   bash bench/gpu/lease.sh roofline [box]  # ~4 min: bench.plan_roofline --size gpu: the
#                                   # planner's step roofline against the engine's steps of a
#                                   # dense, a mixture-of-experts, a sliding-window and a
#                                   # latent-attention shape (8 layers each); on profile's
#                                   # hardware_8b.json when that ran first, else profiled
#                                   # here; box default 300
# The longer calls, for device time left over or a later task:
#   bash bench/gpu/lease.sh tests   # the gpu-marked tests (kernels at full size, graphs,
#                                   # transports), then bench.structured_masks on cuda
#   bash bench/gpu/lease.sh bench   # bench.gpu --quick, then bench.engine_overhead on cuda
#   bash bench/gpu/lease.sh speculative  # bench.speculative on cuda (drafts against none)
#   bash bench/gpu/lease.sh draft_model  # bench.draft_model on cuda (a draft model's drafts)
#   bash bench/gpu/lease.sh mtp     # bench.mtp on cuda (the model's own prediction layer)
#   bash bench/gpu/lease.sh async   # bench.async_scheduling on cuda (1B, then 8B shapes)
# Logs and JSON go to $OUT (the device tool brings them back), else to bench/results/lease.
# The GPU machine has python3 with torch, triton and transformers, and no ray, fastapi or
# uvicorn: the tests and benchmarks drive the engine, kernels and kv_transfer directly.
set -uo pipefail
out="${OUT:-bench/results/lease}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
python="${PYTHON:-python3}"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; git rev-parse --short HEAD 2>/dev/null; } | tee "$out/device.txt"
# Each run in its own time box (seconds), so a run cut short still leaves the next its turn.
gpu_tests() {  # $1 box, $2 limit per test, $3 -q or -v (-v: each verdict logged as it ends)
    timeout "$1" "$python" -m pytest -m gpu "$3" -rs -p no:cacheprovider --timeout "$2" \
        tests/engine tests/kv_transfer tests/workers 2>&1 | tee "$out/gpu_tests.log"
}
bench_gpu_quick() {  # $1 box
    timeout "$1" "$python" -m bench.gpu --quick --out "$out/gpu.json" 2>&1 | tee "$out/bench_gpu.log"
}
engine_overhead() {  # $1 box, $2 batch sizes
    timeout "$1" "$python" -m bench.engine_overhead --device cuda --batch-sizes "$2" \
        --out "$out/engine_overhead.json" 2>&1 | tee "$out/engine_overhead.log"
}
case "${1:-}" in
first)
    gpu_tests 230 120 -v
    bench_gpu_quick 250
    engine_overhead 60 1,64,256
    ;;
quantized)  # $2: the time box, seconds; the 8B model's sections are saved first
    timeout "${2:-300}" "$python" -m bench.gpu --quick --only quantized --models 8b,1b \
        --batch-sizes 1,64,256 --out "$out/quantized.json" 2>&1 | tee "$out/quantized.log"
    ;;
profile)  # $2: the time box, seconds, shared by the two shapes (the 8B's first)
    deadline=$(( SECONDS + ${2:-240} ))
    for shape in ${PROFILE_SHAPES:-8b 1b}; do
        dir="$out/llama-$shape-shapes"
        "$python" -c "import sys; from pathlib import Path; from bench.gpu.shapes import MODELS; \
MODELS[sys.argv[1]].write_config(Path(sys.argv[2]), 4096, 'bfloat16')" "$shape" "$dir"
        timeout $(( deadline - SECONDS > 0 ? deadline - SECONDS : 1 )) "$python" -m router.cli \
            profile --model "$dir" --load-format dummy --device "${PROFILE_DEVICE:-cuda}" \
            --dtype bfloat16 --max-num-batched-tokens 2048 --num-kv-blocks 4096 \
            --out "$out/hardware_$shape.json" 2>&1 | tee "$out/profile_$shape.log"
    done
    ;;
roofline)  # $2: the time box, seconds
    hardware=()
    [ -f "$out/hardware_8b.json" ] && hardware=(--hardware "$out/hardware_8b.json")
    timeout "${2:-300}" "$python" -m bench.plan_roofline --size gpu --device cuda \
        "${hardware[@]}" --out "$out/plan_roofline.json" 2>&1 | tee "$out/plan_roofline.log"
    ;;
tests)
    gpu_tests 600 540 -q  # 600: the device call's own limit
    # structured outputs' per-step masking on the GPU (a state's mask copied there once)
    timeout 60 "$python" -m bench.structured_masks --device cuda --walks 2 \
        --out "$out/structured_masks.json" 2>&1 | tee "$out/structured_masks.log"
    ;;
bench)
    bench_gpu_quick 420
    engine_overhead 120 1,8,64,256
    ;;
speculative)
    timeout 500 "$python" -m bench.speculative --device cuda --batch-sizes 1,8,32,128 \
        --repeats 2 --out "$out/speculative.json" 2>&1 | tee "$out/speculative.log"
    ;;
draft_model)
    timeout 500 "$python" -m bench.draft_model --device cuda --batch-sizes 1,8,32 \
        --repeats 2 --out "$out/draft_model.json" 2>&1 | tee "$out/draft_model.log"
    ;;
mtp)
    timeout 500 "$python" -m bench.mtp --device cuda --hidden-size 1024 --num-layers 32 \
        --batch-sizes 1,8,32 --repeats 2 --out "$out/mtp.json" 2>&1 | tee "$out/mtp.log"
    ;;
async)
    timeout 270 "$python" -m bench.async_scheduling --device cuda --model 1b \
        --batch-sizes 1,8,64,256 --context-len 1000 \
        --out "$out/async_scheduling_1b.json" 2>&1 | tee "$out/async_scheduling_1b.log"
    timeout 300 "$python" -m bench.async_scheduling --device cuda --model 8b \
        --batch-sizes 1,64,256 --context-len 1000 \
        --out "$out/async_scheduling_8b.json" 2>&1 | tee "$out/async_scheduling_8b.log"
    ;;
*)
    echo "usage: bash bench/gpu/lease.sh first|quantized [box]|profile [box]|roofline [box]|tests|bench|speculative|draft_model|mtp|async" >&2
    exit 2
    ;;
esac
