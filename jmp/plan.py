"""``python -m jmp.plan``: a training job on GPUs this host does not have, planned from its compiled step.

    python -m jmp.plan llama3-8b --gpu h100 --devices 64 --layout '{"sharded_data_parallel_degree": 64}'
        --batch 64 --seq 4096 [--checkpoint model.layers] [--search]

MODEL is a Hugging Face ``config.json`` (or a folder holding one) or one of ``MODELS``; ``--search`` takes the
first layout ``smp.what_fits`` finds (cheapest communication first) instead of ``--layout``. Printed per device:
memory by kind (``smp.estimate_memory(target=...)``); the bytes each kind of collective sends in one step, read
from the program compiled for the GPUs (ring algorithms, as NCCL's: an all-gather sends (n-1)/n of its result,
a reduce-scatter n-1 times it, an all-reduce twice (n-1)/n; a loop body's as often as it runs); the model's FLOPs
(6 x matmul parameters x tokens + 12 x layers x sequence x width x tokens, a third more with checkpointed
layers); and a roofline: each resource's seconds at its peak (HBM traffic bounded below by every byte the step
holds written and read once; groups wider than a host over the network), the largest bounding the step.
MaxText's ``train_compile`` is the model for this command.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

import jax
import torch
import transformers

from jmp.compiled_step import gpu_target
from jmp.compiled_step.memory_estimate import estimate_memory, what_fits

LLAMA3 = dict(vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, num_key_value_heads=8)
MODELS = {  # name -> (model type, its config's values); GPT2Config's defaults are GPT-2 124M's
    "gpt2": ("gpt2", {}),
    "llama3-8b": ("llama", dict(LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32)),
    "llama3-70b": ("llama", dict(LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                 num_attention_heads=64)),
}  # fmt: skip


def model_config(name: str) -> transformers.PretrainedConfig:
    if name in MODELS:
        kind, values = MODELS[name]
        return transformers.AutoConfig.for_model(kind, **values)
    path = pathlib.Path(name)
    return transformers.AutoConfig.from_pretrained(path.parent if path.name == "config.json" else path)


def model_flops(model: torch.nn.Module, tokens: int, seq: int, checkpointed: bool) -> float:
    """The step's matmul FLOPs, all devices together (the input embedding is a lookup, not a matmul)."""
    config, embedding = model.config, model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    matmul = sum(p.numel() for p in model.parameters()) - (
        0 if output and output.weight is embedding else embedding.numel()
    )
    flops = 6 * matmul * tokens + 12 * config.num_hidden_layers * seq * config.hidden_size * tokens
    return flops * (4 / 3 if checkpointed else 1)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--gpu", default="h100", choices=sorted(gpu_target.TARGETS))
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--layout", default="{}", help="an smp config as JSON (bf16 unless it says otherwise)")
    parser.add_argument("--search", action="store_true", help="the layout smp.what_fits would list first")
    parser.add_argument("--batch", type=int, default=8, help="sequences a step, all devices together")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--checkpoint", default=None, help="torch path of the layers to checkpoint each")
    args = parser.parse_args(argv)
    gpu, checkpointing = gpu_target.get(args.gpu), {args.checkpoint: "each"} if args.checkpoint else None
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(model_config(args.model))
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids}
    config = {"bf16": True, **json.loads(args.layout)}
    if args.search:
        found = what_fits(model, gpu.memory_bytes, batch, activation_checkpointing=checkpointing, target=gpu,
                          devices=args.devices, config=config)  # fmt: skip
        if not found:
            raise SystemExit(f"no layout of {args.devices} x {gpu.name} fits {args.model}")
        config, memory = found[0]
    else:
        memory = estimate_memory(model, config, batch, activation_checkpointing=checkpointing, target=gpu,
                                 devices=args.devices)  # fmt: skip
    sent = memory.collectives
    flops = model_flops(model, args.batch * args.seq, args.seq, checkpointing is not None) / args.devices
    link = sum(k["bytes"] - k["network_bytes"] for k in sent.values())
    network = sum(k["network_bytes"] for k in sent.values())
    seconds = {"compute": flops / gpu.bf16_flops, "memory": 2 * memory.total / gpu.memory_bandwidth,
               "interconnect": link / gpu.link_bandwidth + network / gpu.network_bandwidth}  # fmt: skip
    bound = max(seconds, key=seconds.get)
    print(f"{args.model} on {args.devices} x {gpu.name}, {json.dumps(config)}, {args.batch} x {args.seq} tokens")
    print(repr(memory))
    print(f"  fits {gpu.memory_bytes / 2**30:.1f} GiB: {memory.total <= gpu.memory_bytes}")
    print("collectives, bytes sent per device a step (over the network):")
    for kind, row in sent.items():
        print(f"  {kind:<20} {row['bytes'] / 2**30:10.4g} GiB ({row['network_bytes'] / 2**30:.4g})")
    print(f"FLOPs per device a step: {flops:.3e}")
    print("roofline: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in seconds.items()) + f"; bound by {bound}")
    return {"config": config, "memory": memory.as_dict(), "collectives": sent, "flops": flops, "seconds": seconds}


if __name__ == "__main__":
    if "JAX_PLATFORMS" not in os.environ:  # planning: nothing runs on a GPU, and the CUDA plugin skips its checks
        jax.config.update("jax_platforms", "cpu")
    main()
