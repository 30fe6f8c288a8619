"""GPT-2 training steps on one GPU: PyTorch eager, ``torch.compile`` and jmp, bf16 mixed precision, side by side.

    python -m benchmarks.gpu_speed [--layers 12] [--d-model 768] [--heads 12] [--seq 1024] [--batch 8]
        [--vocab 50257] [--steps 20] [--warmup 3] [--torch-compile auto|on|off] [--jmp-attention auto,xla]
        [--tiny] [--out benchmarks/results/gpu_speed.json]

One Hugging Face GPT-2 (``GPT2Config``, random weights, no dropout; default GPT-2 small, 124M parameters)
trained with AdamW (lr 1e-4, weight decay 0.01) on one batch of random token ids, from the same initial
weights on every side, one side after the other in one process on the same device:

- ``torch_eager``: the model on the device in float32, forward under ``torch.autocast(device, bfloat16)``,
  ``torch.optim.AdamW(fused=True)`` on CUDA;
- ``torch_compile``: the same with ``torch.compile(model)`` (on CUDA only, unless ``--torch-compile on``);
- ``jmp``: ``smp.init({"microbatches": 1, "bf16": True})`` (float32 master parameters, the forward and
  backward under torch's autocast rules in bf16, gradients kept in bf16), ``smp.DistributedModel``,
  ``smp.DistributedOptimizer(torch.optim.AdamW(...))`` (the fused Pallas update on a GPU), ``@smp.step``;
  once per ``--jmp-attention`` setting (a comma list of ``auto``, ``xla``, ``cudnn``; default ``auto``), each
  a fresh model and optimizer traced under ``JMP_ATTENTION_IMPLEMENTATION`` set to it: sides ``jmp`` (auto:
  cuDNN flash attention where ``jmp.torch_bridge.lowering.attention`` chooses it), ``jmp_xla_attention``,
  ``jmp_cudnn_attention``.

The torch sides run first and are freed (``torch.cuda.empty_cache``) before jmp starts, so the two
allocators share the device (``XLA_PYTHON_CLIENT_PREALLOCATE=false``). A step is ``zero_grad``, forward,
backward and the optimizer update, timed until the device is idle (``torch.cuda.synchronize``; for jmp the
loss is read back and the updated parameters are blocked on). Per side: the seconds to set it up (copy to
the device; for jmp ``smp.init``, conversion and sharding), the first step's seconds (with
compilation; ``compile_s`` is that minus the median step), the median of ``--steps`` timed steps after
``--warmup`` untimed ones, tokens per second, model FLOPs utilisation (``flops_per_step`` over the median,
over ``peak_flops``), the loss of every step (the first ones agree to bf16 rounding), and the device's peak
memory (torch: ``max_memory_allocated``; jmp: ``memory_stats()["peak_bytes_in_use"]``, the process's peak,
so a later jmp side reports at least an earlier one's). For jmp the first step is also split:
``first_step_call_s`` (the first ``lm_step`` call to its loss: tracing, the step program's compile, one run)
and ``first_optimizer_step_s`` (the first ``optimizer.step()`` until the parameters are updated: the
update's compile, the fused Pallas kernels on a GPU, and one run). Results are written after each side, so
a run cut short keeps the sides it finished. ``step_custom_calls`` names the kernels jmp's step program
calls by name (cuDNN's attention is ``__cudnn$fmha...``; XLA's own attention calls none).
"""

from __future__ import annotations

import os

# before JAX starts its GPU backend: torch allocates on the same device, so JAX must not take 75% of it upfront
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("JMP_COMPILATION_CACHE", "off")  # the first step's time is a real compile on every run

import argparse  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import logging  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import jmp as smp  # noqa: E402
from benchmarks.harness import causal_lm, gpt2_config, lm_step, machine, token_ids, write_results  # noqa: E402
from jmp.torch_bridge.lowering.attention import ENVIRONMENT_VARIABLE as ATTENTION_VARIABLE  # noqa: E402

LR, WEIGHT_DECAY = 1e-4, 0.01
ATTENTION_SIDES = {"auto": "jmp", "xla": "jmp_xla_attention", "cudnn": "jmp_cudnn_attention"}
# dense bf16 tensor-core peak of an H100 / H200 SXM (without sparsity); the H200 has the H100's compute
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12}
TINY = dict(layers=2, d_model=128, heads=4, seq=128, batch=4, vocab=1024, steps=5, warmup=2)


# --- what a step computes -----------------------------------------------------------------------------------


def flops_per_step(params: int, layers: int, d_model: int, seq: int, tokens: int) -> float:
    """Model FLOPs of one training step: 6 per parameter per token (forward and backward matmuls) plus
    attention's score and value products, 12 * layers * seq * d_model per token (causal masking not subtracted)."""
    return 6 * params * tokens + 12 * layers * seq * d_model * tokens


def device_peak_flops(name: str | None, override: float | None) -> float | None:
    if override:
        return override
    return next((peak for key, peak in PEAK_FLOPS.items() if name and key in name), None)


# --- timing one side ------------------------------------------------------------------------------------------


class CompileTimeout(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: int):
    """Raise CompileTimeout in the main thread after ``seconds`` (0: no limit)."""

    def expire(*_):
        raise CompileTimeout(f"no first step after {seconds} s")

    if not seconds:
        yield
        return
    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_side(name: str, iteration, sync, steps: int, warmup: int, first_step_limit: int = 0) -> dict:
    """Time ``iteration`` (returns the loss): the first call alone, then ``warmup`` untimed, ``steps`` timed."""
    losses, times = [], []
    start = time.perf_counter()
    with deadline(first_step_limit):
        losses.append(iteration())
        sync()
    first = time.perf_counter() - start
    print(f"  {name}: first step {first:.1f} s, loss {float(losses[0]):.4f}", flush=True)
    for i in range(warmup - 1 + steps):
        start = time.perf_counter()
        losses.append(iteration())
        sync()
        if i >= warmup - 1:
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    print(f"  {name}: median step {median * 1e3:.1f} ms over {steps} steps", flush=True)
    return {
        "first_step_s": first,
        "median_step_ms": median * 1e3,
        "step_ms": [t * 1e3 for t in times],
        "losses": [float(loss) for loss in losses],
    }


# --- the sides ----------------------------------------------------------------------------------------------------


def torch_iteration(base: torch.nn.Module, ids: torch.Tensor, device: str, compiled: bool):
    """A training step of a fresh copy of ``base`` on ``device`` (bf16 autocast, AdamW): returns the loss."""
    model = copy.deepcopy(base).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=device == "cuda")
    forward = torch.compile(model) if compiled else model
    ids = ids.to(device)

    def iteration():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = forward(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        return loss.detach()

    return iteration


def torch_side(base: torch.nn.Module, ids: torch.Tensor, args, compiled: bool) -> dict:
    cuda = torch.cuda.is_available()
    start = time.perf_counter()
    iteration = torch_iteration(base, ids, "cuda" if cuda else "cpu", compiled)
    setup = time.perf_counter() - start
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    name = "torch_compile" if compiled else "torch_eager"
    sync = torch.cuda.synchronize if cuda else lambda: None
    try:
        result = run_side(name, iteration, sync, args.steps, args.warmup, args.compile_timeout if compiled else 0)
        if cuda:
            result["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
            result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        result["optimizer"] = f"torch.optim.AdamW(fused={cuda})"
        return {"setup_s": setup, **result}
    finally:  # the device's memory back for the next side, whether this one finished or not
        iteration = None  # the only reference to the model, its optimizer and compiled forward
        if compiled:
            torch._dynamo.reset()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


class _Messages(logging.Handler):
    """Keeps jmp's log lines (its "compiled <program> in ..." notices)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def attention_implementation(setting: str):
    """``JMP_ATTENTION_IMPLEMENTATION`` set to ``setting`` ("auto", "xla", "cudnn") meanwhile, read by jmp's
    attention lowering as it traces."""
    previous = os.environ.get(ATTENTION_VARIABLE)
    os.environ[ATTENTION_VARIABLE] = setting
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(ATTENTION_VARIABLE, None)
        else:
            os.environ[ATTENTION_VARIABLE] = previous


def jmp_side(base: torch.nn.Module, ids: torch.Tensor, args, attention: str = "auto") -> dict:
    if torch.cuda.is_available() and jax.default_backend() != "gpu":  # a GPU-sized model on the CPU: hours
        raise RuntimeError(f"torch sees a GPU but JAX runs on {jax.default_backend()}: see env.txt")
    with attention_implementation(attention):
        result = _jmp_side(base, ids, args, ATTENTION_SIDES[attention])
    result["attention"] = f"{ATTENTION_VARIABLE}={attention}"
    return result


def _jmp_side(base: torch.nn.Module, ids: torch.Tensor, args, name: str) -> dict:
    messages = _Messages()
    log = logging.getLogger("jmp")
    level = log.level
    log.addHandler(messages)
    log.setLevel(logging.INFO)
    try:
        start = time.perf_counter()
        smp.init({"microbatches": 1, "bf16": True})
        model = smp.DistributedModel(copy.deepcopy(base))
        optimizer = smp.DistributedOptimizer(
            torch.optim.AdamW(model.module.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        )
        setup = time.perf_counter() - start

        def sync():
            jax.block_until_ready(model.training_state.params)

        first: dict = {}

        def iteration():
            start = time.perf_counter()
            optimizer.zero_grad()
            loss = lm_step(model, ids).reduce_mean()  # a torch tensor: the step has run
            called = time.perf_counter()
            optimizer.step()
            if not first:  # the update's compile shows here, apart from the step program's
                sync()
                first.update(first_step_call_s=called - start, first_optimizer_step_s=time.perf_counter() - called)
                print(f"  {name}: first step call {first['first_step_call_s']:.1f} s, first optimizer.step() "
                      f"{first['first_optimizer_step_s']:.1f} s", flush=True)  # fmt: skip
            return loss

        result = {"setup_s": setup, **run_side(name, iteration, sync, args.steps, args.warmup), **first}
    finally:
        log.removeHandler(messages)
        log.setLevel(level)
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        result["peak_memory_bytes"] = stats["peak_bytes_in_use"]
    result["optimizer"] = f"smp.DistributedOptimizer(torch.optim.AdamW), fused: {getattr(optimizer, 'fused', None)}"
    result["compile_log"] = [line for line in messages.lines if re.match(r"(compiled|loaded) ", line)]
    try:  # which kernels the step program asks for by name (cuDNN attention would show here)
        text = lm_step.lower(model, ids).as_text()
        result["step_custom_calls"] = dict(collections.Counter(re.findall(r"custom_call @([\w$.]+)", text)))
    except Exception as error:  # a diagnostic only
        result["step_custom_calls"] = f"not lowered: {error!r}"
    return result


# --- main ---------------------------------------------------------------------------------------------------------


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per side, the first included")
    parser.add_argument("--torch-compile", choices=("auto", "on", "off"), default="auto", help="auto: on CUDA")
    parser.add_argument("--compile-timeout", type=int, default=150, help="seconds torch.compile's first step gets")
    parser.add_argument(
        "--jmp-attention",
        default="auto",
        help="comma list of JMP_ATTENTION_IMPLEMENTATION settings (auto, xla, cudnn), one jmp side each",
    )
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's bf16 peak (default: by name)")
    parser.add_argument("--tiny", action="store_true", help=f"a CPU-sized check, unless given otherwise: {TINY}")
    parser.add_argument("--out", default="benchmarks/results/gpu_speed.json")
    args = parser.parse_args()
    if args.tiny:  # the sizes of TINY where the command line gave none
        for key, value in TINY.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
    args.warmup = max(args.warmup, 1)
    args.jmp_attention = [setting.strip() for setting in args.jmp_attention.split(",") if setting.strip()]
    unknown = sorted(set(args.jmp_attention) - set(ATTENTION_SIDES))
    if unknown or not args.jmp_attention:
        parser.error(f"--jmp-attention: {unknown or 'nothing'}; expected a comma list of {', '.join(ATTENTION_SIDES)}")
    return args


def main() -> None:
    args = parse_args()
    transformers.logging.set_verbosity_error()
    start = time.perf_counter()
    cuda = torch.cuda.is_available()
    gpu = torch.cuda.get_device_name() if cuda else None
    peak = device_peak_flops(gpu, args.peak_tflops and args.peak_tflops * 1e12)
    spec = gpt2_config(vocab=args.vocab, positions=args.seq, d_model=args.d_model, layers=args.layers, heads=args.heads)
    base = causal_lm(spec)
    ids = token_ids(args.batch, args.seq, args.vocab)
    params = sum(p.numel() for p in base.parameters())  # the tied embedding once
    tokens = args.batch * args.seq
    flops = flops_per_step(params, args.layers, args.d_model, args.seq, tokens)
    print(f"GPT-2 {params / 1e6:.1f}M parameters, {tokens} tokens a step, {flops / 1e12:.2f} TFLOP a step", flush=True)
    print(f"torch on {gpu or 'cpu'}; jax on {jax.devices()[0].device_kind} ({jax.default_backend()})", flush=True)

    result = {
        "what": __doc__.split("\n\n")[0],
        "machine": {
            **machine(),
            "transformers": transformers.__version__,
            "torch_device": gpu or "cpu",
            "jax_device": jax.devices()[0].device_kind,
        },
        "config": dict(
            layers=args.layers,
            d_model=args.d_model,
            heads=args.heads,
            seq=args.seq,
            batch=args.batch,
            vocab=args.vocab,
            params=params,
            tokens_per_step=tokens,
            steps=args.steps,
            warmup=args.warmup,
            optimizer=f"AdamW lr {LR} weight_decay {WEIGHT_DECAY}",
            precision="bf16 autocast, float32 masters",
            jmp_config={"microbatches": 1, "bf16": True},
            flops_per_step=flops,
            flops_formula="6 * params * tokens + 12 * layers * seq * d_model * tokens",
            peak_flops=peak,
            peak_flops_source="dense bf16, H100/H200 SXM" if peak and not args.peak_tflops else None,
        ),  # fmt: skip
        "sides": {},
    }
    compile_torch = args.torch_compile == "on" or (args.torch_compile == "auto" and cuda)
    sides = [("torch_eager", lambda: torch_side(base, ids, args, compiled=False))]
    if compile_torch:
        sides.append(("torch_compile", lambda: torch_side(base, ids, args, compiled=True)))
    else:
        result["sides"]["torch_compile"] = {"skipped": "not on CUDA (--torch-compile on runs it)"}
    for setting in dict.fromkeys(args.jmp_attention):
        sides.append((ATTENTION_SIDES[setting], functools.partial(jmp_side, base, ids, args, setting)))

    for name, side in sides:
        print(f"{name} ({time.perf_counter() - start:.0f} s)", flush=True)
        try:
            row = side()
        except Exception as error:  # one side failing (torch.compile without a compiler, ...) keeps the others
            traceback.print_exc()
            row = {"error": f"{type(error).__name__}: {error}"[:2000]}
        if "error" in row:  # the traceback's frames are gone now, and with them the side's tensors
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        if "median_step_ms" in row:
            seconds = row["median_step_ms"] / 1e3
            row["tokens_per_s"] = tokens / seconds
            row["tflops_per_s"] = flops / seconds / 1e12
            row["mfu"] = flops / seconds / peak if peak else None
            if name != "torch_eager":
                row["compile_s"] = row["first_step_s"] - seconds
        result["sides"][name] = row
        result["seconds"] = time.perf_counter() - start
        write_results(args.out, result)

    done = {name: row for name, row in result["sides"].items() if "losses" in row}
    if "torch_eager" in done:
        reference = done["torch_eager"]["losses"][0]
        result["first_loss_rel_diff_vs_torch_eager"] = {
            name: abs(row["losses"][0] - reference) / abs(reference) for name, row in done.items()
        }
    result["seconds"] = time.perf_counter() - start
    write_results(args.out, result)
    print(f"\n{'side':<20}{'first s':>9}{'step ms':>9}{'tokens/s':>11}{'MFU':>7}{'peak GiB':>10}{'loss[0]':>9}")
    for name, row in result["sides"].items():
        if "median_step_ms" not in row:
            print(f"{name:<20}{row.get('error') or row.get('skipped')}")
            continue
        mfu = f"{row['mfu']:.1%}" if row.get("mfu") else "-"
        memory = f"{row['peak_memory_bytes'] / 2**30:.2f}" if "peak_memory_bytes" in row else "-"
        print(
            f"{name:<20}{row['first_step_s']:>9.1f}{row['median_step_ms']:>9.1f}{row['tokens_per_s']:>11.0f}"
            f"{mfu:>7}{memory:>10}{row['losses'][0]:>9.4f}"
        )
    print(f"first-loss relative difference from torch eager: {result.get('first_loss_rel_diff_vs_torch_eager')}")
    print(f"wrote {args.out} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
