#!/usr/bin/env bash
# One prepared session on a GPU machine, about 9 minutes at most, every step bounded by `timeout`, in order of worth.
# The session of 2026-11-26 (H100) measured a 1.5B Llama and GPT-2 124M against torch.compile and the optimizer
# kernels (benchmarks/results/*_h100.json); its fp8 Llama did not compile within 210 s. This plan follows up:
#   1. the machine and versions                        -> $OUT/steps.log (every step's output)
#   2. the tests that run only on a GPU
#   3. fp8 against bf16 on a 4-layer Llama of Llama 3.2 1B's widths with XLA's default flags; if fp8 does not
#      compile in time, fp8 alone with GEMM autotuning off, then with Triton GEMMs off (is the compile time
#      autotuning?)                                    -> $OUT/gpu_speed_fp8_*.json
#   4. GPT-2 124M's jmp step profiled: device time by program and kernel, the device's idle time per step
#      (benchmarks/gpu_profile.py)                     -> $OUT/gpu_profile.json
#   5. the 16-layer Llama, fp8 and bf16, with the XLA flags step 3 found to compile, in the time left
#                                                      -> $OUT/gpu_speed_llama_fp8.json
# Each step's exit status and seconds -> $OUT/session.log. No arguments; environment variables:
#   bash benchmarks/gpu_session.sh          (OUT defaults to /tmp/gpu_out)
#   GPU_LLAMA_ARGS="..."                    the Llama's size arguments instead of Llama 3.2 1B's (without
#                                           --layers), e.g. small ones to check this script on a CPU
#   GPU_GPT2_ARGS="..."                     step 4's size arguments instead of GPT-2 124M's defaults
#   GPU_SESSION_SECONDS=540                 the whole session's seconds
set -uo pipefail

OUT="${OUT:-/tmp/gpu_out}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.." || exit 1
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
# torch and JAX share the GPU in one process (step 3): JAX must not take 75% of it upfront
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export TOKENIZERS_PARALLELISM=false
unset JAX_PLATFORMS  # the GPU, not an inherited CPU-only setting

TOTAL=${GPU_SESSION_SECONDS:-540}  # seconds for the whole session; each step gets its share, at most what is left
SESSION_LOG="$OUT/session.log"
: >"$SESSION_LOG"

note() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$SESSION_LOG"; }

# step NAME SECONDS LOG COMMAND...: run COMMAND under min(SECONDS, what is left) seconds, output tee'd to LOG
step() {
    local name=$1 budget=$2 log=$3
    shift 3
    local left=$((TOTAL - SECONDS - 5))
    local limit=$((budget < left ? budget : left))
    if ((limit < 20)); then
        note "$name: skipped, ${left}s left"
        return 0
    fi
    note "$name: start (limit ${limit}s)"
    local start=$SECONDS
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    local verdict="rc $rc"
    ((rc == 124 || rc == 137)) && verdict="rc $rc (TIMED OUT after ${limit}s)"
    note "$name: $verdict, $((SECONDS - start))s"
}

# --- 1. the machine ---------------------------------------------------------------------------------------------
environment() {
    nvidia-smi -L
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    echo "gcc (torch.compile's Triton launchers need a C compiler): $(command -v gcc || command -v cc || echo none)"
    python3 - <<'EOF'
import sys, platform
print("python", sys.version.split()[0], platform.platform())
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "")
import jax, jaxlib
print("jax", jax.__version__, "jaxlib", jaxlib.__version__, "backend", jax.default_backend())
print("jax.devices()", jax.devices())  # after torch took the GPU, as in gpu_speed.py: both in one process
import flax, optax, transformers
print("flax", flax.__version__, "optax", optax.__version__, "transformers", transformers.__version__)
try:
    import triton
    print("triton", triton.__version__)
except ImportError as error:
    print("triton:", error)
EOF
}
export -f environment
step environment 60 "$OUT/steps.log" bash -c environment

# the jmp sides keep their compiled programs in an empty cache: a first step is a real compile, and --compiled-hlo
# then loads the step program instead of compiling it again
export JMP_COMPILATION_CACHE="${JMP_COMPILATION_CACHE:-$(mktemp -d /tmp/jmp-xla-cache-XXXX)}"

# --- 2. the tests that skip unless jax.default_backend() == "gpu" -------------------------------------------------
# The GPU-only tests of the fused kernels and offloading's numbers (host memory is a real memory space on a GPU).
# Not the rest of these files: they lay models out over 4 to 8 devices, which the CPU suite emulates and one GPU
# does not have.
PER_TEST=()
python3 -c "import pytest_timeout" 2>/dev/null && PER_TEST=(--timeout 60)
step gpu_tests 100 "$OUT/steps.log" \
    python3 -m pytest -q -rA -n 0 -p no:cacheprovider ${PER_TEST[@]+"${PER_TEST[@]}"} -k "gpu or offloading_moves" \
    tests/kernels/test_fused_optimizers.py tests/remat/test_offload.py

# --- 3. fp8's compile time: XLA's defaults; if fp8 does not compile in time, GEMM autotuning off, Triton GEMMs off -----
read -r -a LLAMA_SIZE <<<"${GPU_LLAMA_ARGS:---d-model 2048 --heads 32 --kv-heads 8 --intermediate 8192 --vocab 128256 --seq 2048 --batch 4}"
LLAMA=(python3 -m benchmarks.gpu_speed --model llama "${LLAMA_SIZE[@]}" --torch-eager off --torch-compile off
    --compiled-hlo)
compiled_fp8() {  # whether the json $1 holds an fp8 side that trained
    python3 -c "import json, sys; sys.exit(0 if 'median_step_ms' in json.load(open('$1'))['sides'].get('jmp_fp8', {}) else 1)" 2>/dev/null
}
step fp8_default 120 "$OUT/steps.log" \
    "${LLAMA[@]}" --layers 4 --steps 10 --jmp-configs fp8,bf16 --out "$OUT/gpu_speed_fp8_default.json"
FP8_FLAGS=none
if compiled_fp8 "$OUT/gpu_speed_fp8_default.json"; then
    FP8_FLAGS="${XLA_FLAGS:-}"
else
    for variant in autotune_off:--xla_gpu_autotune_level=0 triton_gemm_off:--xla_gpu_enable_triton_gemm=false; do
        flags="${XLA_FLAGS:-} ${variant#*:}"
        step "fp8_${variant%%:*}" 90 "$OUT/steps.log" \
            env XLA_FLAGS="$flags" "${LLAMA[@]}" --layers 4 --steps 10 --jmp-configs fp8 \
            --out "$OUT/gpu_speed_fp8_${variant%%:*}.json"
        if compiled_fp8 "$OUT/gpu_speed_fp8_${variant%%:*}.json"; then
            FP8_FLAGS="$flags"
            break
        fi
    done
fi

# --- 4. GPT-2 124M's step profiled ------------------------------------------------------------------------------
read -r -a GPT2_SIZE <<<"${GPU_GPT2_ARGS:-}"
step profile 90 "$OUT/steps.log" \
    python3 -m benchmarks.gpu_profile ${GPT2_SIZE[@]+"${GPT2_SIZE[@]}"} --steps 5 --out "$OUT/gpu_profile.json"

# --- 5. the 16-layer Llama in fp8 and bf16, with the flags that compiled fp8 in step 3 ------------------------------
if [[ $FP8_FLAGS == none ]]; then
    note "llama_fp8: skipped, fp8 compiled in no configuration of step 3"
else
    note "llama_fp8: XLA_FLAGS='$FP8_FLAGS'"
    step llama_fp8 400 "$OUT/steps.log" \
        env XLA_FLAGS="$FP8_FLAGS" "${LLAMA[@]}" --layers 16 --steps 10 --jmp-configs fp8,bf16 \
        --out "$OUT/gpu_speed_llama_fp8.json"
fi

note "done; files in $OUT:"
ls -l "$OUT" | tee -a "$SESSION_LOG"
