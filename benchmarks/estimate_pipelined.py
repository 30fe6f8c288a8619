"""``smp.estimate_memory`` of a Llama 3 70B pipeline on 512 emulated devices: how long planning takes, and the cut.

    python -m benchmarks.estimate_pipelined [--layers 80] [--configs pp8_fsdp8_tp8 fsdp64_tp8]
        [--out benchmarks/results/estimate_pipelined.json]

The model is transformers' ``LlamaForCausalLM`` with Llama 3 70B's shape (hidden 8192, 64 heads, 8 key/value heads,
intermediate 28,672, vocabulary 128,256) built on the meta device, in bf16 (``"bf16": True``), each decoder layer
checkpointed, AdamW, a batch of 64 x 512 tokens in 8 microbatches. For each config: the seconds
``smp.estimate_memory`` takes (the step traced, cut into stages and compiled ahead of time, nothing run), its
per-device figures, and for a pipeline the decoder layers and parameter bytes of each stage (from its partition log).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import time

os.environ["JMP_COMPILATION_CACHE"] = "off"
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=512")

import torch  # noqa: E402
import transformers  # noqa: E402

import jmp as smp  # noqa: E402
from benchmarks.harness import write_results  # noqa: E402

CONFIGS = {
    "pp8_fsdp8_tp8": {
        "pipeline_parallel_degree": 8,
        "microbatches": 8,
        "sharded_data_parallel_degree": 8,
        "tensor_parallel_degree": 8,
        "bf16": True,
    },
    "fsdp64_tp8": {"sharded_data_parallel_degree": 64, "tensor_parallel_degree": 8, "bf16": True},
}


def llama_70b(layers: int) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=layers,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    )
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


class _PartitionLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("Partition assignments"):
            self.messages.append(record.getMessage())


def stages_of(message: str) -> dict[str, list]:
    """Decoder layers and MiB of parameters on each stage, read from the partition log line."""
    stages = re.split(r"; stage \d+: ", message.split(": stage 0: ", 1)[1])
    return {
        "layers": [sum(int(b) - int(a) + 1 for a, b in re.findall(r"model\.layers\.(\d+)-(\d+)", s)) for s in stages],
        "parameter_mib": [float(re.search(r"\[([\d.]+) MiB of parameters\]", stage).group(1)) for stage in stages],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--out", default="benchmarks/results/estimate_pipelined.json")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    log = _PartitionLog()
    logging.getLogger("jmp").addHandler(log)
    logging.getLogger("jmp").setLevel(logging.INFO)
    batch = {"input_ids": torch.zeros(64, 512, dtype=torch.long), "labels": torch.zeros(64, 512, dtype=torch.long)}
    rows = {}
    for name in args.configs:
        smp.init(CONFIGS[name])
        model = llama_70b(args.layers)
        log.messages.clear()
        start = time.perf_counter()
        estimate = smp.estimate_memory(model, batch=batch, activation_checkpointing={"model.layers": "each"})
        seconds = time.perf_counter() - start
        row = {"config": CONFIGS[name], "seconds": seconds, "per_device_gib": estimate.total / 2**30}
        row["estimate"] = {k: v / 2**30 for k, v in vars(estimate).items() if isinstance(v, int)}
        if log.messages:
            row["stages"] = stages_of(log.messages[-1])
        rows[name] = row
        print(f"{name}: {seconds:.1f} s, {row['per_device_gib']:.1f} GiB a device, {row.get('stages')}")
    write_results(
        args.out,
        {
            "model": f"transformers LlamaForCausalLM, Llama 3 70B's shape, {args.layers} layers, meta device, bf16",
            "devices": 512,
            "batch": "64 x 512 tokens",
            "load_average_1_5_15_min": os.getloadavg(),
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
