#!/usr/bin/env bash
# One prepared session on a GPU machine, about 9 minutes at most, every step bounded by `timeout`, in order of worth:
#   1. the machine and versions                        -> $OUT/env.txt
#   2. a 1.2B Llama (Llama 3.2 1B's shapes): torch.compile, jmp bf16, jmp fp8 (benchmarks/gpu_speed.py)
#                                                      -> $OUT/llama.log, $OUT/gpu_speed_llama.json
#   3. the fused AdamW kernels against optax and torch (benchmarks/optimizer_kernels.py)
#                                                      -> $OUT/optimizer_kernels.log, $OUT/optimizer_kernels.json
#   4. GPT-2 124M: torch.compile, jmp                  -> $OUT/gpt2.log, $OUT/gpu_speed.json
#   5. the tests that run only on a GPU                -> $OUT/gpu_tests.log
# The jmp sides of 2 and 4 update with XLA's fused AdamW (fused_optimizer: False): the Pallas kernels' compile
# takes a minute per model on a GPU, so they are measured once, in 3, against the same update done by XLA.
# Each step's exit status and seconds -> $OUT/session.log. No arguments; environment variables:
#   bash benchmarks/gpu_session.sh          (OUT defaults to /tmp/gpu_out)
#   GPU_SESSION_ONLY=speed                  steps 1 and 4 only (the machine, GPT-2 steps; step 4 may take all
#                                           the time left)
#   GPU_SPEED_ARGS="..."                    step 4's arguments instead of "--steps 20 --torch-eager off
#                                           --jmp-configs bf16+optax --compile-timeout 120", e.g. "--tiny" on a CPU
#   GPU_LLAMA_ARGS="..."                    step 2's size arguments instead of Llama 3.2 1B's
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

ONLY="${GPU_SESSION_ONLY:-}"
case "$ONLY" in
    "" | speed) ;;
    *) echo "GPU_SESSION_ONLY=$ONLY: expected speed (or unset: every step)" >&2; exit 2 ;;
esac

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
step environment 60 "$OUT/env.txt" bash -c environment

# step 2 and 4's jmp sides keep their compiled programs in an empty cache: a first step is a real compile, and
# --compiled-hlo then loads the step program instead of compiling it again
export JMP_COMPILATION_CACHE="${JMP_COMPILATION_CACHE:-$(mktemp -d /tmp/jmp-xla-cache-XXXX)}"

# --- 2. a 1.2B Llama: MFU against torch.compile, and fp8 against bf16 -------------------------------------------
read -r -a LLAMA_SIZE <<<"${GPU_LLAMA_ARGS:---layers 16 --d-model 2048 --heads 32 --kv-heads 8 --intermediate 8192 --vocab 128256 --seq 2048 --batch 4}"
if [[ -z $ONLY ]]; then
    step llama 260 "$OUT/llama.log" \
        python3 -m benchmarks.gpu_speed --model llama "${LLAMA_SIZE[@]}" --steps 15 --torch-eager off \
        --compile-timeout 150 --jmp-configs bf16+optax,fp8+optax --compiled-hlo --out "$OUT/gpu_speed_llama.json"
else
    note "llama: skipped (GPU_SESSION_ONLY=$ONLY)"
fi

# --- 3. the fused optimizer kernels ---------------------------------------------------------------------------------
PEAK_GBPS=3350  # H100 SXM HBM3
nvidia-smi -L 2>/dev/null | grep -q H200 && PEAK_GBPS=4800  # H200 HBM3e
if [[ -z $ONLY ]]; then
    step optimizer_kernels 150 "$OUT/optimizer_kernels.log" \
        python3 -m benchmarks.optimizer_kernels --steps 20 --kinds mixed --peak-gbps "$PEAK_GBPS" \
        --out "$OUT/optimizer_kernels.json"
else
    note "optimizer_kernels: skipped (GPU_SESSION_ONLY=$ONLY)"
fi

# --- 4. GPT-2 124M training steps -----------------------------------------------------------------------------------
read -r -a SPEED_ARGS <<<"${GPU_SPEED_ARGS:---steps 20 --torch-eager off --jmp-configs bf16+optax --compile-timeout 120}"
SPEED_SECONDS=130
[[ -n $ONLY ]] && SPEED_SECONDS=$TOTAL  # the only long step: whatever the session has left
step gpt2 "$SPEED_SECONDS" "$OUT/gpt2.log" \
    python3 -m benchmarks.gpu_speed "${SPEED_ARGS[@]}" --out "$OUT/gpu_speed.json"

# --- 5. the tests that skip unless jax.default_backend() == "gpu" -------------------------------------------------
# The GPU-only tests of the fused kernels and offloading's numbers (host memory is a real memory space on a GPU).
# Not the rest of these files: they lay models out over 4 to 8 devices, which the CPU suite emulates and one GPU
# does not have.
PER_TEST=()
python3 -c "import pytest_timeout" 2>/dev/null && PER_TEST=(--timeout 90)
if [[ -z $ONLY ]]; then
    step gpu_tests 120 "$OUT/gpu_tests.log" \
        python3 -m pytest -q -rA -n 0 -p no:cacheprovider ${PER_TEST[@]+"${PER_TEST[@]}"} -k "gpu or offloading_moves" \
        tests/kernels/test_fused_optimizers.py tests/remat/test_offload.py
else
    note "gpu_tests: skipped (GPU_SESSION_ONLY=$ONLY)"
fi

note "done; files in $OUT:"
ls -l "$OUT" | tee -a "$SESSION_LOG"
