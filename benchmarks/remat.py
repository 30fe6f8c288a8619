"""Temporary memory and step time of each activation-checkpointing strategy and policy, against none.

    python -m benchmarks.remat [--steps 10] [--out benchmarks/results/remat.json]

GPT-2 (Hugging Face, from a config) with 4 layers, d_model 256, 4 heads, vocab 512; batch 8 x sequence
512, data parallel over the devices (8 emulated CPU devices unless XLA_FLAGS says otherwise); dropout on.
One step = forward and backward through ``@smp.step``. Temporaries are ``memory_analysis()`` of the
compiled step (bytes per device); times are medians of interleaved steps after warm-up. Every variant
is written with its ratios to no checkpointing, as a table on stdout and as JSON.
"""

from __future__ import annotations

import argparse
import functools

import torch

import jmp as smp
from benchmarks.harness import (
    causal_lm,
    emulate_devices,
    gpt2_config,
    machine,
    medians,
    time_interleaved,
    token_ids,
    write_results,
)

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
    return causal_lm(
        gpt2_config(vocab=VOCAB, positions=SEQUENCE, d_model=D_MODEL, layers=LAYERS, heads=HEADS, dropout=True)
    )


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
        return loss.reduce_mean(), model.grads

    return run, temporaries


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results/remat.json")
    args = parser.parse_args()

    emulate_devices()
    ids = token_ids(BATCH, SEQUENCE, VOCAB)
    runs, temporaries = {}, {}
    for name, (config, annotation) in VARIANTS.items():
        runs[name], temporaries[name] = build(config, annotation, ids)
    # a model runs only under the config it was built with: smp.init again (untimed) before each of its steps
    prepare = {name: functools.partial(smp.init, config) for name, (config, _) in VARIANTS.items()}
    median = medians(time_interleaved(runs, args.steps, warmup=2, prepare=prepare))
    variants = {
        name: {
            "temp_bytes": temporaries[name],
            "temp_ratio": temporaries[name] / temporaries["none"],
            "median_step_seconds": median[name],
            "step_time_ratio": median[name] / median["none"],
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
