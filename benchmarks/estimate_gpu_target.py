"""``smp.estimate_memory(..., target="h100")`` from this CPU host against the peaks measured on an H100.

    python -m benchmarks.estimate_gpu_target [--plans] [--out benchmarks/results/estimate_gpu_target.json]

Needs JAX's CUDA plugin and cuDNN (``jmp.compiled_step.gpu_target``), no GPU. The two H100 runs on record
(``benchmarks/results/gpu_speed_gpt2_h100.json``, ``gpu_speed_llama_h100.json``: jmp bf16, AdamW, one device; the
peak is ``memory_stats()["peak_bytes_in_use"]``) are rebuilt on the meta device from their recorded configs and
estimated for one H100, with layers one by one as they ran (``scan_layers`` was off then; the estimate with today's
default, scanned layers, is given beside it). ``--plans`` adds two cluster plans, timed: a Llama 3 8B at
``sharded_data_parallel_degree`` 64 on 64 H100s and a Llama 3 70B at fsdp64 x tp8 on 512 H100s, each decoder layer
checkpointed, one 4,096-token sequence per data shard.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import pathlib
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a planning host: the CUDA plugin compiles, nothing runs on a GPU
os.environ["JMP_COMPILATION_CACHE"] = "off"  # compile-only executables cannot be loaded back from the cache

import torch  # noqa: E402
import transformers  # noqa: E402

import jmp as smp  # noqa: E402
from benchmarks.harness import machine, write_results  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
MEASURED = {"gpt2_124m": "gpu_speed_gpt2_h100.json", "llama_1p5b": "gpu_speed_llama_h100.json"}
LLAMA3 = dict(vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, num_key_value_heads=8)
PLANS = {  # name -> (model config, smp config, devices)
    "llama3_8b_fsdp64": (
        dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, **LLAMA3),
        {"sharded_data_parallel_degree": 64, "bf16": True},
        64,
    ),
    "llama3_70b_fsdp64_tp8": (
        dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, **LLAMA3),
        {"sharded_data_parallel_degree": 64, "tensor_parallel_degree": 8, "bf16": True},
        512,
    ),
}


def meta_model(kind: str, spec: dict) -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(getattr(transformers, kind)(**spec))


def estimate(model, config: dict, batch: int, seq: int, devices: int, **options) -> dict:
    ids = torch.zeros(batch, seq, dtype=torch.long)
    start = time.perf_counter()
    result = smp.estimate_memory(model, config, {"input_ids": ids, "labels": ids}, target="h100", devices=devices,
                                 **options)  # fmt: skip
    return {"seconds": time.perf_counter() - start, **result.as_dict()}


def measured_row(name: str) -> dict:
    record = json.loads((RESULTS / MEASURED[name]).read_text())
    run, side = record["config"], record["sides"]["jmp_bf16_optax"]
    spec = {k: v for k, v in run["model"].items() if k != "kind"}
    model = meta_model(run["model"]["kind"], spec)
    row = {"model": run["model"], "batch": run["batch"], "seq": run["seq"], "config": side["config"]}
    row["measured_peak_bytes"] = side["peak_memory_bytes"]
    row["measured_with"] = {k: record["machine"][k] for k in ("jax", "jax_device")}
    for scan in (False, True):
        config = {**side["config"], "scan_layers": scan}
        row["layers_scanned" if scan else "layers_one_by_one"] = found = estimate(
            model, config, run["batch"], run["seq"], 1
        )
        found["ratio_to_measured"] = found["total"] / side["peak_memory_bytes"]
        print(f"{name} scan_layers={scan}: {found['total'] / 1e9:.2f} GB ({found['ratio_to_measured']:.3f} of the "
              f"{side['peak_memory_bytes'] / 1e9:.2f} GB measured), {found['seconds']:.1f} s")  # fmt: skip
    return row


def plan_row(name: str) -> dict:
    spec, config, devices = PLANS[name]
    data_shards = devices // config.get("tensor_parallel_degree", 1)
    found = estimate(meta_model("LlamaConfig", spec), config, data_shards, 4096, devices,
                     activation_checkpointing={"model.layers": "each"})  # fmt: skip
    print(f"{name}: {found['total'] / 2**30:.2f} GiB a device, {found['seconds']:.1f} s")
    return {"config": config, "devices": devices, "sequence": 4096, "sequences": data_shards, **found}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", action="store_true", help="also time the 8B and 70B cluster plans")
    parser.add_argument("--out", default=str(RESULTS / "estimate_gpu_target.json"))
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    result = {
        "what": __doc__.split("\n\n")[0],
        "machine": {**machine(), "jax_cuda12_plugin": importlib.metadata.version("jax-cuda12-plugin")},
        "target": "h100",
        "load_average_1_5_15_min": os.getloadavg(),
        "measured": {name: measured_row(name) for name in MEASURED},
    }
    if args.plans:
        result["plans"] = {name: plan_row(name) for name in PLANS}
    write_results(args.out, result)


if __name__ == "__main__":
    main()
