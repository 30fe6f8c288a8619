"""Causal-LM training steps on one GPU: PyTorch eager, ``torch.compile`` and jmp, bf16 mixed precision (and jmp
in fp8), side by side.

    python -m benchmarks.gpu_speed [--model gpt2|llama] [--layers 12] [--d-model 768] [--heads 12]
        [--kv-heads H] [--intermediate N] [--seq 1024] [--batch 8] [--vocab 50257] [--steps 20] [--warmup 3]
        [--torch-eager on|off] [--torch-compile auto|on|off] [--jmp-attention auto,xla]
        [--jmp-configs bf16,fp8,bf16+optax] [--compiled-hlo] [--tiny] [--out benchmarks/results/gpu_speed.json]

    # a Llama of 1.2B parameters (Llama 3.2 1B's shapes):
    python -m benchmarks.gpu_speed --model llama --layers 16 --d-model 2048 --heads 32 --kv-heads 8 \
        --intermediate 8192 --vocab 128256 --seq 2048 --batch 4 --jmp-configs bf16,fp8

One Hugging Face GPT-2 (``GPT2Config``, random weights, no dropout; default GPT-2 small, 124M parameters), or
a Llama (``LlamaConfig``, ``--model llama``),
trained with AdamW (lr 1e-4, weight decay 0.01) on one batch of random token ids, from the same initial
weights on every side, one side after the other in one process on the same device:

- ``torch_eager``: the model on the device in float32, forward under ``torch.autocast(device, bfloat16)``,
  ``torch.optim.AdamW(fused=True)`` on CUDA;
- ``torch_compile``: the same with ``torch.compile(model)`` (on CUDA only, unless ``--torch-compile on``);
- ``jmp``: ``smp.init({"microbatches": 1, "bf16": True})`` (float32 master parameters, the forward and
  backward under torch's autocast rules in bf16, gradients kept in bf16), ``smp.DistributedModel``,
  ``smp.DistributedOptimizer(torch.optim.AdamW(...))`` (XLA's fusion of the update), ``@smp.step``;
  once per ``--jmp-attention`` setting (a comma list of ``auto``, ``xla``, ``cudnn``; default ``auto``), each
  a fresh model and optimizer traced under ``JMP_ATTENTION_IMPLEMENTATION`` set to it: sides ``jmp`` (auto:
  cuDNN flash attention where ``jmp.torch_bridge.lowering.attention`` chooses it), ``jmp_xla_attention``,
  ``jmp_cudnn_attention``; and once per ``--jmp-configs`` entry (default ``bf16``), ``+``-joined words each
  adding to the config: ``fp8`` (``fp8: True``, Transformer Engine's delayed-scaling recipe on the Linear
  layers' matmuls), ``kernels`` (``fused_optimizer: True``: the Pallas kernels instead of XLA's fusion of the
  update), ``optax`` (``fused_optimizer: False``, the default since the H100 measurements of 2026-11-26),
  ``scan`` (``scan_layers: True``); a side other than plain ``bf16`` is named ``jmp_<entry>`` (``+`` as ``_``).

The torch sides run first and are freed (``torch.cuda.empty_cache``) before jmp starts, so the two allocators
share the device (``XLA_PYTHON_CLIENT_PREALLOCATE=false``). A step is ``zero_grad``, forward, backward and the
optimizer update, timed until the device is idle (``torch.cuda.synchronize``; for jmp the loss is read back and
the updated parameters are blocked on). Per side: the seconds to set it up (copy to the device; for jmp
``smp.init``, conversion and sharding), the first step's seconds (with compilation; ``compile_s`` is that minus
the median step), the median of ``--steps`` timed steps after ``--warmup`` untimed ones, tokens per second,
model FLOPs utilisation (``flops_per_step`` over the median, over ``peak_flops``), the loss of every step (the
first ones agree to bf16 rounding), and the device's peak memory (torch: ``max_memory_allocated``; jmp:
``memory_stats()["peak_bytes_in_use"]``, the process's peak, so a later jmp side reports at least an earlier
one's). For jmp the first step is also split: ``first_step_call_s`` (the first ``lm_step`` call to its loss:
tracing, the step program's compile, one run) and ``first_optimizer_step_s`` (the first ``optimizer.step()``
until the parameters are updated: the update's compile, with ``kernels`` the Pallas kernels' Triton compile, and
one run). Results are written after each side, so a run cut short keeps the sides it finished.
``step_custom_calls`` names the kernels jmp's step program calls by name (cuDNN's attention is
``__cudnn$fmha...``; XLA's own attention calls none). Each jmp side's timed steps are also split:
``median_step_call_ms`` (the step program until its loss is on the host) and ``median_optimizer_ms``
(``optimizer.step()`` until the parameters are updated). ``--compiled-hlo`` adds ``compiled_hlo``: the custom
calls of the step program as XLA compiled it for the device (cuBLAS's fp8 matmuls are
``__cublas$lt$matmul$f8``), and its dots and convolutions by operand types; this compiles the step again, so run
with ``JMP_COMPILATION_CACHE`` set to a directory to have it loaded from the cache instead.
"""

from __future__ import annotations

import os

# before JAX starts its GPU backend: torch allocates on the same device, so JAX must not take 75% of it upfront
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# the first step's time is a real compile on every run (an empty directory does as well, and lets --compiled-hlo
# load the step program from it instead of compiling it twice)
os.environ.setdefault("JMP_COMPILATION_CACHE", "off")

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
from benchmarks.harness import (  # noqa: E402
    causal_lm,
    gpt2_config,
    llama_config,
    lm_step,
    machine,
    token_ids,
    write_results,
)
from jmp.precision import fp8_matmul  # noqa: E402
from jmp.torch_bridge.lowering.attention import ENVIRONMENT_VARIABLE as ATTENTION_VARIABLE  # noqa: E402

LR, WEIGHT_DECAY = 1e-4, 0.01
ATTENTION_SIDES = {"auto": "jmp", "xla": "jmp_xla_attention", "cudnn": "jmp_cudnn_attention"}
# dense bf16 tensor-core peak of an H100 / H200 SXM (without sparsity); the H200 has the H100's compute
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12}
TINY = dict(layers=2, d_model=128, heads=4, seq=128, batch=4, vocab=1024, steps=5, warmup=2)
# what each word of a --jmp-configs entry adds to smp.init's config
CONFIG_WORDS = {
    "bf16": {},
    "fp32": {"bf16": False},  # float32 throughout, as the CPU benchmarks run
    "fp8": {"fp8": True},
    "kernels": {"fused_optimizer": True},
    "optax": {"fused_optimizer": False},
    "scan": {"scan_layers": True},  # the default since scan_layers went on
    "unrolled": {"scan_layers": False},
    "bf16ops": {},  # fp8 products on operands dequantised to bf16, not float32 (jmp.precision.fp8_matmul)
}


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


def jmp_config(entry: str) -> dict:
    """smp.init's config for a ``--jmp-configs`` entry ("bf16", "fp8+optax", ...)."""
    config = {"microbatches": 1, "bf16": True}
    for word in entry.split("+"):
        config.update(CONFIG_WORDS[word])
    return config


@contextlib.contextmanager
def fp8_operands(compute_dtype: bool):
    """fp8 products on operands dequantised to the compute dtype (bf16) instead of float32, for one side."""
    kept = fp8_matmul.OPERAND_DTYPE
    fp8_matmul.OPERAND_DTYPE = None if compute_dtype else kept
    try:
        yield
    finally:
        fp8_matmul.OPERAND_DTYPE = kept


def jmp_side_name(attention: str, entry: str) -> str:
    name = ATTENTION_SIDES[attention]
    return name if entry == "bf16" else f"{name}_{entry.replace('+', '_')}"


def jmp_side(base: torch.nn.Module, ids: torch.Tensor, args, attention: str = "auto", entry: str = "bf16") -> dict:
    if torch.cuda.is_available() and jax.default_backend() != "gpu":  # a GPU-sized model on the CPU: hours
        raise RuntimeError(f"torch sees a GPU but JAX runs on {jax.default_backend()}: see env.txt")
    with attention_implementation(attention), fp8_operands("bf16ops" in entry.split("+")):
        result = _jmp_side(base, ids, args, jmp_side_name(attention, entry), jmp_config(entry))
    result["attention"] = f"{ATTENTION_VARIABLE}={attention}"
    return result


def _jmp_side(base: torch.nn.Module, ids: torch.Tensor, args, name: str, config: dict) -> dict:
    messages = _Messages()
    log = logging.getLogger("jmp")
    level = log.level
    log.addHandler(messages)
    log.setLevel(logging.INFO)
    try:
        start = time.perf_counter()
        smp.init(config)
        model = smp.DistributedModel(copy.deepcopy(base))
        optimizer = smp.DistributedOptimizer(
            torch.optim.AdamW(model.module.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        )
        setup = time.perf_counter() - start

        def sync():
            jax.block_until_ready(model.training_state.params)

        first: dict = {}
        parts: dict[str, list[float]] = {"step_call": [], "optimizer": []}

        def iteration():
            start = time.perf_counter()
            optimizer.zero_grad()
            loss = lm_step(model, ids).reduce_mean()  # a torch tensor: the step has run
            called = time.perf_counter()
            optimizer.step()
            sync()
            done = time.perf_counter()
            if not first:  # the update's compile shows here, apart from the step program's
                first.update(first_step_call_s=called - start, first_optimizer_step_s=done - called)
                print(f"  {name}: first step call {first['first_step_call_s']:.1f} s, first optimizer.step() "
                      f"{first['first_optimizer_step_s']:.1f} s", flush=True)  # fmt: skip
            else:
                parts["step_call"].append(called - start)
                parts["optimizer"].append(done - called)
            return loss

        result = {"setup_s": setup, **run_side(name, iteration, sync, args.steps, args.warmup), **first}
        timed = slice(args.warmup - 1, None)  # the parts of the timed steps (the first step is not in parts)
        for part, seconds in parts.items():
            if seconds[timed]:
                result[f"median_{part}_ms"] = statistics.median(seconds[timed]) * 1e3
    finally:
        log.removeHandler(messages)
        log.setLevel(level)
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        result["peak_memory_bytes"] = stats["peak_bytes_in_use"]
    result["config"] = config
    result["optimizer"] = f"smp.DistributedOptimizer(torch.optim.AdamW), fused: {getattr(optimizer, 'fused', None)}"
    result["compile_log"] = [line for line in messages.lines if re.match(r"(compiled|loaded) ", line)]
    try:  # which kernels the step program asks for by name (cuDNN attention would show here)
        lowered = lm_step.lower(model, ids)
        text = lowered.as_text()
        result["step_custom_calls"] = dict(collections.Counter(re.findall(r"custom_call @([\w$.]+)", text)))
        result["step_dots"] = dot_operand_types(text)
        if args.compiled_hlo:
            start = time.perf_counter()
            result["compiled_hlo"] = compiled_hlo_summary(lowered.compile().as_text())
            result["compiled_hlo"]["seconds"] = time.perf_counter() - start
    except Exception as error:  # a diagnostic only
        result["step_custom_calls"] = f"not lowered: {error!r}"
    return result


_LOWERED_DOT = re.compile(r"stablehlo\.dot_general[^\n]*?:\s*\(tensor<(?:\d+x)*(\w+)>, tensor<(?:\d+x)*(\w+)>\)")
_HLO_DEFINITION = re.compile(r"%([\w.\-]+) = (\w+)\[")
_HLO_DOT = re.compile(r"= (\w+)\[[^\n]*? (dot|convolution)\(%([\w.\-]+), %([\w.\-]+)\)")


def dot_operand_types(lowered_text: str) -> dict[str, int]:
    """The lowered program's ``dot_general``s counted by operand element types ("f8E4M3FN x f8E4M3FN": 15)."""
    return dict(collections.Counter(f"{a} x {b}" for a, b in _LOWERED_DOT.findall(lowered_text)))


def compiled_hlo_summary(text: str) -> dict:
    """What the device runs: custom-call targets (cuBLAS / cuDNN / Triton kernels) and XLA's own dots and
    convolutions by operand types, from the compiled HLO's text."""
    dots: collections.Counter = collections.Counter()
    for computation in text.split("\n\n"):  # operands are named within their computation
        types = dict(_HLO_DEFINITION.findall(computation))
        for out, kind, a, b in _HLO_DOT.findall(computation):
            dots[f"{kind} {types.get(a, '?')} x {types.get(b, '?')} -> {out}"] += 1
    return {
        "custom_call_targets": dict(collections.Counter(re.findall(r'custom_call_target="([^"]+)"', text))),
        "dots": dict(dots),
        "fp8_instructions": len(re.findall(r"\bf8e\w+\[", text)),
    }


# --- main ---------------------------------------------------------------------------------------------------------


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("gpt2", "llama"), default="gpt2")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=None, help="llama: key/value heads (default: --heads)")
    parser.add_argument("--intermediate", type=int, default=None, help="llama: MLP width (default: 4 * d-model)")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per side, the first included")
    parser.add_argument("--torch-eager", choices=("on", "off"), default="on")
    parser.add_argument("--torch-compile", choices=("auto", "on", "off"), default="auto", help="auto: on CUDA")
    parser.add_argument("--compile-timeout", type=int, default=150, help="seconds torch.compile's first step gets")
    parser.add_argument(
        "--jmp-attention",
        default="auto",
        help="comma list of JMP_ATTENTION_IMPLEMENTATION settings (auto, xla, cudnn), one jmp side each",
    )
    parser.add_argument(
        "--jmp-configs",
        default="bf16",
        help=f"comma list of config entries, words joined by + ({', '.join(CONFIG_WORDS)}), one jmp side each",
    )
    parser.add_argument("--compiled-hlo", action="store_true", help="summarise each jmp step as compiled (see above)")
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
    args.jmp_configs = [entry.strip() for entry in args.jmp_configs.split(",") if entry.strip()]
    words = {word for entry in args.jmp_configs for word in entry.split("+")}
    if words - set(CONFIG_WORDS) or not args.jmp_configs:
        parser.error(f"--jmp-configs: {sorted(words - set(CONFIG_WORDS)) or 'nothing'}; words are {list(CONFIG_WORDS)}")
    return args


def model_spec(args) -> dict:
    if args.model == "gpt2":
        return gpt2_config(
            vocab=args.vocab, positions=args.seq, d_model=args.d_model, layers=args.layers, heads=args.heads
        )
    return llama_config(
        vocab=args.vocab, positions=args.seq, hidden=args.d_model, intermediate=args.intermediate or 4 * args.d_model,
        layers=args.layers, heads=args.heads, kv_heads=args.kv_heads or args.heads,
    )  # fmt: skip


def matmul_params(model: torch.nn.Module) -> int:
    """Parameters that take part in matmuls: all, less input embeddings that are only looked up (a tied
    embedding is the output layer's weight too, so it counts once, as ``parameters()`` lists it once)."""
    params = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    if output is None or output.weight is not embedding:
        params -= embedding.numel()
    return params


def main() -> None:
    args = parse_args()
    transformers.logging.set_verbosity_error()
    start = time.perf_counter()
    cuda = torch.cuda.is_available()
    gpu = torch.cuda.get_device_name() if cuda else None
    peak = device_peak_flops(gpu, args.peak_tflops and args.peak_tflops * 1e12)
    spec = model_spec(args)
    base = causal_lm(spec)
    ids = token_ids(args.batch, args.seq, args.vocab)
    params = sum(p.numel() for p in base.parameters())  # a tied embedding once
    # GPT-2's figures count every parameter (as the results before --model did; its position embeddings are 0.6%)
    counted = params if args.model == "gpt2" else matmul_params(base)
    tokens = args.batch * args.seq
    flops = flops_per_step(counted, args.layers, args.d_model, args.seq, tokens)
    print(f"{spec['kind']} {params / 1e6:.1f}M parameters, {tokens} tokens a step, {flops / 1e12:.2f} TFLOP a step",
          flush=True)  # fmt: skip
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
            model=spec,
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
            jmp_configs={entry: jmp_config(entry) for entry in args.jmp_configs},
            flops_per_step=flops,
            flops_formula="6 * params * tokens + 12 * layers * seq * d_model * tokens"
            + ("" if args.model == "gpt2" else ", params less the input embedding"),
            matmul_params=counted,
            peak_flops=peak,
            peak_flops_source="dense bf16, H100/H200 SXM" if peak and not args.peak_tflops else None,
        ),  # fmt: skip
        "sides": {},
    }
    compile_torch = args.torch_compile == "on" or (args.torch_compile == "auto" and cuda)
    sides = []
    if args.torch_eager == "on":
        sides.append(("torch_eager", lambda: torch_side(base, ids, args, compiled=False)))
    if compile_torch:
        sides.append(("torch_compile", lambda: torch_side(base, ids, args, compiled=True)))
    else:
        result["sides"]["torch_compile"] = {"skipped": "not on CUDA (--torch-compile on runs it)"}
    for setting in dict.fromkeys(args.jmp_attention):
        for entry in dict.fromkeys(args.jmp_configs):
            sides.append((jmp_side_name(setting, entry), functools.partial(jmp_side, base, ids, args, setting, entry)))

    for name, side in sides:
        print(f"{name} ({time.perf_counter() - start:.0f} s)", flush=True)
        try:
            row = side()
        except Exception as error:  # one side failing (torch.compile without a compiler, ...) keeps the others
            traceback.print_exc()
            row = {"error": f"{type(error).__name__}: {error}"[:2000]}
        gc.collect()  # an error's traceback frames are gone now, and with them the side's tensors
        if cuda:
            torch.cuda.empty_cache()
        # what JAX still holds once the side is over: an earlier jmp side's model must not crowd a later one
        row["jax_live_bytes_after"] = sum(array.nbytes for array in jax.live_arrays())
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
    torch_sides = [name for name in ("torch_eager", "torch_compile") if name in done]
    if torch_sides:
        reference = done[torch_sides[0]]["losses"][0]
        result[f"first_loss_rel_diff_vs_{torch_sides[0]}"] = {
            name: abs(row["losses"][0] - reference) / abs(reference) for name, row in done.items()
        }
    result["seconds"] = time.perf_counter() - start
    write_results(args.out, result)
    print(f"\n{'side':<26}{'first s':>9}{'step ms':>9}{'fwd+bwd':>9}{'update':>8}{'tokens/s':>11}{'MFU':>7}"
          f"{'peak GiB':>10}{'loss[0]':>9}")  # fmt: skip
    for name, row in result["sides"].items():
        if "median_step_ms" not in row:
            print(f"{name:<26}{row.get('error') or row.get('skipped')}")
            continue
        mfu = f"{row['mfu']:.1%}" if row.get("mfu") else "-"
        memory = f"{row['peak_memory_bytes'] / 2**30:.2f}" if "peak_memory_bytes" in row else "-"
        parts = [f"{row[key]:>{width}.1f}" if key in row else f"{'-':>{width}}" for key, width in
                 (("median_step_call_ms", 9), ("median_optimizer_ms", 8))]  # fmt: skip
        print(
            f"{name:<26}{row['first_step_s']:>9.1f}{row['median_step_ms']:>9.1f}{''.join(parts)}"
            f"{row['tokens_per_s']:>11.0f}{mfu:>7}{memory:>10}{row['losses'][0]:>9.4f}"
        )
        if "compiled_hlo" in row:
            print(f"{'':<26}compiled: {row['compiled_hlo']['custom_call_targets']}")
    for key in [key for key in result if key.startswith("first_loss_rel_diff")]:
        print(f"{key}: {result[key]}")
    print(f"wrote {args.out} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
