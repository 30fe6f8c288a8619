#!/usr/bin/env bash
# One prepared session on a GPU machine, about 8 minutes at most, every step bounded by `timeout`:
#   1. the machine and versions                        -> $OUT/env.txt
#   2. the tests that run only on a GPU                -> $OUT/gpu_tests.log
#   3. GPT-2 training steps: torch eager, torch.compile, jmp (benchmarks/gpu_speed.py)
#                                                      -> $OUT/gpu_speed.log, $OUT/gpu_speed.json
#   4. the fused AdamW kernels against optax and torch (benchmarks/optimizer_kernels.py), if time is left
#                                                      -> $OUT/optimizer_kernels.log, $OUT/optimizer_kernels.json
# Each step's exit status and seconds -> $OUT/session.log. No arguments; environment variables:
#   bash benchmarks/gpu_session.sh          (OUT defaults to /tmp/gpu_out)
#   GPU_SESSION_ONLY=speed                  steps 1 and 3 only (the machine, GPT-2 steps; step 3 may take all
#                                           the time left rather than 250 s)
#   GPU_SPEED_ARGS="..."                    step 3's arguments instead of "--steps 30 --compile-timeout 120",
#                                           e.g. "--steps 20 --torch-compile off --jmp-attention auto,xla"
#   GPU_SESSION_SECONDS=480                 the whole session's seconds
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

TOTAL=${GPU_SESSION_SECONDS:-480}  # seconds for the whole session; each step gets its share, at most what is left
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

# --- 2. the tests that skip unless jax.default_backend() == "gpu" -------------------------------------------------
# The two GPU-only tests, the test that lowers the fused update for CUDA, and offloading's numbers (host memory
# is a real memory space on a GPU). Not the rest of these files: they lay models out over 4 to 8 devices,
# which the CPU suite emulates and one GPU does not have.
TESTS=(
    "tests/kernels/test_fused_optimizers.py::test_on_a_gpu_the_compiled_kernels_compute_what_the_optax_chain_computes"
    "tests/kernels/test_fused_optimizers.py::test_the_gpu_program_has_one_kernel_per_param_group_and_dtype"
    "tests/remat/test_offload.py::test_on_a_gpu_offloading_lowers_device_temporaries"
    "tests/remat/test_offload.py::test_offloading_moves_each_checkpointed_layers_input_to_the_host_and_keeps_gradients"
)
PER_TEST=()
python3 -c "import pytest_timeout" 2>/dev/null && PER_TEST=(--timeout 120)
if [[ -z $ONLY ]]; then
    step gpu_tests 150 "$OUT/gpu_tests.log" \
        python3 -m pytest -q -rA -n 0 -p no:cacheprovider ${PER_TEST[@]+"${PER_TEST[@]}"} "${TESTS[@]}"
else
    note "gpu_tests: skipped (GPU_SESSION_ONLY=$ONLY)"
fi

# --- 3. GPT-2 training steps on the GPU ---------------------------------------------------------------------------
# GPU_SPEED_ARGS="--tiny" checks this script on a CPU
read -r -a SPEED_ARGS <<<"${GPU_SPEED_ARGS:---steps 30 --compile-timeout 120}"
SPEED_SECONDS=250
[[ -n $ONLY ]] && SPEED_SECONDS=$TOTAL  # the only long step: whatever the session has left
step gpu_speed "$SPEED_SECONDS" "$OUT/gpu_speed.log" \
    python3 -m benchmarks.gpu_speed "${SPEED_ARGS[@]}" --out "$OUT/gpu_speed.json"

# --- 4. the fused optimizer kernels, if time is left --------------------------------------------------------------
PEAK_GBPS=3350  # H100 SXM HBM3
nvidia-smi -L 2>/dev/null | grep -q H200 && PEAK_GBPS=4800  # H200 HBM3e
if [[ -z $ONLY ]]; then
    step optimizer_kernels 120 "$OUT/optimizer_kernels.log" \
        python3 -m benchmarks.optimizer_kernels --steps 20 --peak-gbps "$PEAK_GBPS" --out "$OUT/optimizer_kernels.json"
else
    note "optimizer_kernels: skipped (GPU_SESSION_ONLY=$ONLY)"
fi

note "done; files in $OUT:"
ls -l "$OUT" | tee -a "$SESSION_LOG"
