"""Compile time and program size against depth, layer stacks scanned (``scan_layers``) and unrolled.

    python -m benchmarks.compile_time [--depths 2 8 32 80] [--repeats 3] [--configs unrolled scanned pipelined]
        [--out benchmarks/results/compile_time.json]

A Hugging Face Llama (hidden 64, 4 heads, 2 key/value heads) under fsdp over 8 emulated devices, the default config
(``{"sharded_data_parallel_degree": 8}``: stacks scanned) against ``scan_layers: False``, and pipelines
(``pipelined``: pp2 x dp4; ``pipelined_pp4``: pp4 x dp2; each stage's layers one scan, or one by one with
``_unrolled``), one training step (forward and backward) on a batch of 8 x 32 tokens. For each depth and
config: seconds to trace and
lower the step, seconds for XLA to compile it (each the least over ``--repeats`` rounds that compile every program
once, JAX's in-memory caches cleared before each: one compile on this shared machine varies by 0.2-1 s, and a
burst of load then falls on one round of all programs), the StableHLO text's size and the
program's argument count, and the step's median time (scanned vs unrolled interleaved, after warm-up). Then the
optimizer's update (AdamW, compiled apart from the step) at its first call, compile included, and after. The
persistent compilation cache is off, so every program is compiled here.
"""

from __future__ import annotations

import argparse
import os
import re
import time
from typing import Any

os.environ["JMP_COMPILATION_CACHE"] = "off"

import jax  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import jmp as smp  # noqa: E402
from benchmarks.harness import emulate_devices, time_interleaved, write_results  # noqa: E402


def llama(layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=64,
    )
    return transformers.AutoModelForCausalLM.from_config(config)


CONFIGS = {
    "unrolled": {"sharded_data_parallel_degree": 8, "scan_layers": False},  # the way out of the default
    "scanned": {"sharded_data_parallel_degree": 8},  # the default config: layer stacks scanned
    # pipeline stages x data parallelism: each stage's layers one scan (the default), or one by one
    "pipelined": {"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True},
    "pipelined_unrolled": {"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True, "scan_layers": False},
    "pipelined_pp4": {"pipeline_parallel_degree": 4, "microbatches": 4, "ddp": True},
    "pipelined_pp4_unrolled": {"pipeline_parallel_degree": 4, "microbatches": 4, "ddp": True, "scan_layers": False},
}


def build(layers: int, name: str) -> tuple[smp.DistributedModel, Any, Any, float]:
    """The model, its step, its AdamW optimizer (made before the first step, as SMP scripts do: a pipeline lays
    out its stages by the param groups) and the seconds building the optimizer took (its state's init program
    compiled)."""
    smp.init(CONFIGS[name])
    model = smp.DistributedModel(llama(layers))
    start = time.perf_counter()
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    jax.block_until_ready(optimizer.opt_state)
    optimizer_built = time.perf_counter() - start

    @smp.step
    def train_step(model, ids):
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        return loss

    return model, train_step, optimizer, optimizer_built


def compile_once(model: smp.DistributedModel, step: Any, ids: torch.Tensor) -> tuple[float, float, str]:
    """(seconds to trace and lower, seconds for XLA to compile, the StableHLO text), JAX's caches cleared first."""
    jax.clear_caches()
    start = time.perf_counter()
    lowered = step.lower(model, ids)
    traced = time.perf_counter() - start
    start = time.perf_counter()
    lowered.compile()
    return traced, time.perf_counter() - start, lowered.as_text()


def compile_figures(seconds: list[tuple[float, float]], text: str) -> dict:
    """The least trace and compile seconds over the rounds, the program's size and argument count."""
    traced, compiled = min(t for t, _ in seconds), min(c for _, c in seconds)
    main_function = next(line for line in text.splitlines() if "func.func public @main" in line)
    return {
        "trace_and_lower_s": traced,
        "xla_compile_s": compiled,
        "compile_s": traced + compiled,
        "compile_rounds_s": [t + c for t, c in seconds],
        "hlo_chars": len(text),
        "program_arguments": len(re.findall(r"%arg\d+:", main_function)),
    }


def update_seconds(model, step, optimizer, built: float, ids: torch.Tensor, calls: int = 4) -> dict:
    """Building the AdamW optimizer (``built``), the update's first call (its program compiled) and the median of
    the next ones."""
    step(model, ids).reduce_mean()
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        optimizer.step()
        jax.block_until_ready(model.training_state.params)
        seconds.append(time.perf_counter() - start)
    later = sorted(seconds[1:])
    return {"optimizer_build_s": built, "update_first_call_s": seconds[0], "update_s": later[len(later) // 2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 8, 32, 80])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="compiles per program; the least is kept")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=["unrolled", "scanned"])
    parser.add_argument("--out", default="benchmarks/results/compile_time.json")
    args = parser.parse_args()
    names = args.configs  # every model stays built until the end: 80 layers of all three took 24 GiB
    emulate_devices(8)
    transformers.logging.set_verbosity_error()
    ids = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))
    load_before = os.getloadavg()  # other work on this shared machine slows every compile alike
    built = {(layers, name): build(layers, name) for layers in args.depths for name in names}
    seconds: dict = {key: [] for key in built}
    texts: dict = {}
    for _ in range(args.repeats):  # every program once per round: a burst of load falls on one round only
        for key in built:
            smp.init(CONFIGS[key[1]])
            traced, compiled, texts[key] = compile_once(*built[key][:2], ids)
            seconds[key].append((traced, compiled))
    rows = []
    for layers in args.depths:
        row: dict = {"layers": layers}
        runs, prepare = {}, {}
        for name in names:
            model, step = built[(layers, name)][:2]
            row[name] = compile_figures(seconds[(layers, name)], texts[(layers, name)])
            runs[name] = lambda model=model, step=step: step(model, ids).reduce_mean()
            prepare[name] = lambda name=name: smp.init(CONFIGS[name])
        samples = time_interleaved(runs, args.steps, prepare=prepare)
        for name, samples_of in samples.items():
            row[name]["step_s"] = sorted(samples_of)[len(samples_of) // 2]
        for name in names:
            prepare[name]()
            row[name] |= update_seconds(*built[(layers, name)], ids)
            print(f"{layers:3d} layers {name:>8}: {row[name]}", flush=True)
        if {"scanned", "unrolled"} <= set(names):
            row["compile_ratio_scanned_to_unrolled"] = row["scanned"]["compile_s"] / row["unrolled"]["compile_s"]
            row["step_ratio_scanned_to_unrolled"] = row["scanned"]["step_s"] / row["unrolled"]["step_s"]
            row["update_first_call_ratio_scanned_to_unrolled"] = (
                row["scanned"]["update_first_call_s"] / row["unrolled"]["update_first_call_s"]
            )
        rows.append(row)
    shallowest, deepest = rows[0], rows[-1]
    summary = {
        f"compile({deepest['layers']}) / compile({shallowest['layers']})": {
            name: deepest[name]["compile_s"] / shallowest[name]["compile_s"] for name in names
        },
        f"hlo({deepest['layers']}) / hlo({shallowest['layers']})": {
            name: deepest[name]["hlo_chars"] / shallowest[name]["hlo_chars"] for name in names
        },
        f"update first call({deepest['layers']}) / ({shallowest['layers']})": {
            name: deepest[name]["update_first_call_s"] / shallowest[name]["update_first_call_s"] for name in names
        },
    }
    print(summary)
    write_results(
        args.out,
        {
            "model": "HF Llama hidden 64, 8 devices, batch 8 x 32",
            "configs": {name: CONFIGS[name] for name in names},
            "load_average_1_5_15_min": {"start": load_before, "end": os.getloadavg()},
            "rows": rows,
            "summary": summary,
        },
    )


if __name__ == "__main__":
    main()
