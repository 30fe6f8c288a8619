"""Temporary memory and step time of each activation-checkpointing strategy and policy, against none.

    python benchmarks/remat.py [--steps 10] [--out benchmarks/results/remat.json]

GPT-2 (Hugging Face, from a config) with 4 layers, d_model 256, 4 heads, vocab 512; batch 8 x sequence
512, data parallel over the devices (8 emulated CPU devices unless XLA_FLAGS says otherwise); dropout on.
One step = forward and backward through ``@smp.step``. Temporaries are ``memory_analysis()`` of the
compiled step (bytes per device); times are medians of interleaved steps after warm-up. Every variant
is written with its ratios to no checkpointing, as a table on stdout and as JSON.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import jmp as smp  # noqa: E402
from benchmarks.results_io import machine, write_results  # noqa: E402

LAYERS, D_MODEL, HEADS, VOCAB, SEQUENCE, BATCH = 4, 256, 4, 512, 512, 8

# name -> (config, set_activation_checkpointing arguments or None for no checkpointing);
# qkv, fc: the outputs of each layer's attention input projection (attn.c_attn) and first MLP matmul (mlp.c_fc)
VARIANTS = {
    "none": ({}, None),
    "each": ({}, {"strategy": "each"}),
    "group_2": ({}, {"strategy": "group_2"}),
    "contiguous": ({}, {"strategy": "contiguous"}),
    "each, save_matmuls": ({}, {"strategy": "each", "policy": "save_matmuls"}),
    "each, save_names:qkv,fc": ({}, {"strategy": "each", "policy": "save_names:attn.c_attn,mlp.c_fc"}),
    "each, offload_names:qkv,fc": ({}, {"strategy": "each", "policy": "offload_names:attn.c_attn,mlp.c_fc"}),
    "each, offload_activations": ({"offload_activations": True}, {"strategy": "each"}),
}


@smp.step
def train_step(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    model.backward(loss)
    return loss


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQUENCE,
        n_embd=D_MODEL,
        n_layer=LAYERS,
        n_head=HEADS,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.AutoModelForCausalLM.from_config(config).train()


def build(config: dict, annotation: dict | None, ids: torch.Tensor):
    """The model of one variant, its step compiled: (step runner, temporary bytes)."""
    smp.init(config)
    model = smp.DistributedModel(gpt2())
    if annotation is not None:
        smp.set_activation_checkpointing(model.module.transformer.h, **annotation)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.module.parameters(), lr=0.0))
    temporaries = train_step.lower(model, ids).compile().memory_analysis().temp_size_in_bytes

    def run():
        optimizer.zero_grad()
        loss = train_step(model, ids)
        jax.block_until_ready((loss.reduce_mean().value, model.grads))

    return run, temporaries


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results/remat.json")
    args = parser.parse_args()

    ids = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(1))
    runs, temporaries = {}, {}
    for name, (config, annotation) in VARIANTS.items():
        runs[name], temporaries[name] = build(config, annotation, ids)
        for _ in range(2):  # warm-up: compilation and first runs
            runs[name]()
    samples = {name: [] for name in VARIANTS}
    order = list(VARIANTS)
    for i in range(args.steps):
        for name in order if i % 2 else order[::-1]:  # alternate the order: drift falls on all
            start = time.perf_counter()
            runs[name]()
            samples[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(times) for name, times in samples.items()}
    variants = {
        name: {
            "temp_bytes": temporaries[name],
            "temp_ratio": temporaries[name] / temporaries["none"],
            "median_step_seconds": medians[name],
            "step_time_ratio": medians[name] / medians["none"],
        }
        for name in VARIANTS
    }
    mesh = smp.get_mesh()
    result = {
        "config": dict(
            layers=LAYERS,
            d_model=D_MODEL,
            heads=HEADS,
            vocab=VOCAB,
            sequence=SEQUENCE,
            batch=BATCH,
            steps=args.steps,
            mesh=dict(mesh.shape),
            dropout=0.1,
        ),
        "machine": machine(),
        "variants": variants,
    }
    write_results(args.out, result)
    print(f"{'variant':<28}{'temp MiB':>10}{'temp ratio':>12}{'step s':>10}{'time ratio':>12}")
    for name, v in variants.items():
        print(
            f"{name:<28}{v['temp_bytes'] / 2**20:>10.1f}{v['temp_ratio']:>12.2f}"
            f"{v['median_step_seconds']:>10.3f}{v['step_time_ratio']:>12.2f}"
        )


if __name__ == "__main__":
    main()
