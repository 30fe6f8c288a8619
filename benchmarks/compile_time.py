"""Compile time and program size against depth, layer stacks scanned (``scan_layers``) and unrolled.

    python -m benchmarks.compile_time [--depths 2 8 32 80] [--out benchmarks/results/compile_time.json]

A Hugging Face Llama (hidden 64, 4 heads, 2 key/value heads) under fsdp over 8 emulated devices, one AdamW-free
training step (forward and backward) on a batch of 8 x 32 tokens. For each depth, scanned and unrolled: seconds to
trace and lower the step, seconds for XLA to compile it, the StableHLO text's size, and the step's median time
(scanned vs unrolled interleaved, after warm-up). The persistent compilation cache is off, so every program is
compiled here.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ["JMP_COMPILATION_CACHE"] = "off"

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


def _config(scanned: bool) -> dict:
    return {"sharded_data_parallel_degree": 8, "scan_layers": scanned}


def measure(layers: int, scanned: bool, ids: torch.Tensor) -> tuple[dict, smp.DistributedModel, object]:
    smp.init(_config(scanned))
    model = smp.DistributedModel(llama(layers))

    @smp.step
    def train_step(model, ids):
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        return loss

    start = time.perf_counter()
    lowered = train_step.lower(model, ids)
    traced = time.perf_counter() - start
    start = time.perf_counter()
    lowered.compile()
    compiled = time.perf_counter() - start
    return (
        {
            "trace_and_lower_s": traced,
            "xla_compile_s": compiled,
            "compile_s": traced + compiled,
            "hlo_chars": len(lowered.as_text()),
        },
        model,
        train_step,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 8, 32, 80])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/compile_time.json")
    args = parser.parse_args()
    emulate_devices(8)
    transformers.logging.set_verbosity_error()
    ids = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))
    rows = []
    for layers in args.depths:
        row: dict = {"layers": layers}
        runs, prepare = {}, {}
        for scanned in (False, True):
            name = "scanned" if scanned else "unrolled"
            row[name], model, step = measure(layers, scanned, ids)
            runs[name] = lambda model=model, step=step: step(model, ids).reduce_mean()
            prepare[name] = lambda scanned=scanned: smp.init(_config(scanned))
            print(f"{layers:3d} layers {name:>8}: {row[name]}", flush=True)
        samples = time_interleaved(runs, args.steps, prepare=prepare)
        for name, seconds in samples.items():
            row[name]["step_s"] = sorted(seconds)[len(seconds) // 2]
        row["compile_ratio_scanned_to_unrolled"] = row["scanned"]["compile_s"] / row["unrolled"]["compile_s"]
        row["step_ratio_scanned_to_unrolled"] = row["scanned"]["step_s"] / row["unrolled"]["step_s"]
        rows.append(row)
    shallowest, deepest = rows[0], rows[-1]
    summary = {
        f"compile({deepest['layers']}) / compile({shallowest['layers']})": {
            name: deepest[name]["compile_s"] / shallowest[name]["compile_s"] for name in ("scanned", "unrolled")
        },
        f"hlo({deepest['layers']}) / hlo({shallowest['layers']})": {
            name: deepest[name]["hlo_chars"] / shallowest[name]["hlo_chars"] for name in ("scanned", "unrolled")
        },
    }
    print(summary)
    write_results(args.out, {"model": "HF Llama hidden 64, fsdp8, batch 8 x 32", "rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
