"""Training-step time of a converted Hugging Face GPT-2 against PyTorch eager and hand-written Flax NNX.

    python -m benchmarks.bridge_overhead [--steps 20] [--out benchmarks/results/bridge_overhead.json]

GPT-2 with 4 layers, d_model 256, 4 heads, vocab 2048; batch 8 x sequence 128;
one step = forward, backward and AdamW update. The three are measured side by
side in one process on one CPU device, medians of interleaved steps after
warm-up, and written as JSON with the ratios.
"""

from __future__ import annotations

import argparse
import json

import jax.numpy as jnp
import numpy as np
import optax
import torch
from flax import nnx

import jmp
from benchmarks.harness import causal_lm, gpt2_config, machine, medians, time_interleaved, token_ids, write_results
from benchmarks.reference_gpt2 import GPT2, causal_lm_loss, from_hf

LAYERS, D_MODEL, HEADS, VOCAB, SEQUENCE, BATCH = 4, 256, 4, 2048, 128, 8
LR = 1e-4


def hf_model() -> torch.nn.Module:
    return causal_lm(gpt2_config(vocab=VOCAB, positions=SEQUENCE, d_model=D_MODEL, layers=LAYERS, heads=HEADS))


def nnx_train_step(loss_of_module):
    @nnx.jit
    def step(module, optimizer, ids):
        loss, grads = nnx.value_and_grad(lambda m: loss_of_module(m, ids))(module)
        optimizer.update(module, grads)
        return loss

    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/bridge_overhead.json")
    args = parser.parse_args()

    ids_torch = token_ids(BATCH, SEQUENCE, VOCAB)
    ids = jnp.asarray(ids_torch.numpy())

    # (a) the converted Hugging Face model under jax.jit
    converted = jmp.torch_bridge.convert(hf_model())
    converted_opt = nnx.Optimizer(converted, optax.adamw(LR), wrt=nnx.Param)
    converted_step = nnx_train_step(lambda m, x: m(input_ids=x, labels=x, use_cache=False).loss)
    converted_first = float(converted_step(converted, converted_opt, ids))

    # (b) the same model in PyTorch eager
    torch_model = hf_model()
    torch_opt = torch.optim.AdamW(torch_model.parameters(), lr=LR, weight_decay=1e-4)

    def torch_step():
        torch_opt.zero_grad(set_to_none=True)
        loss = torch_model(input_ids=ids_torch, labels=ids_torch, use_cache=False).loss
        loss.backward()
        torch_opt.step()
        return loss

    torch_first = float(torch_step())

    # (c) a hand-written Flax NNX GPT-2 with the same weights
    reference = GPT2(VOCAB, SEQUENCE, D_MODEL, LAYERS, HEADS)
    from_hf(reference, hf_model())
    reference_opt = nnx.Optimizer(reference, optax.adamw(LR), wrt=nnx.Param)
    reference_step = nnx_train_step(lambda m, x: causal_lm_loss(m(x), x))
    reference_first = float(reference_step(reference, reference_opt, ids))

    def run_converted():
        return converted_step(converted, converted_opt, ids)

    def run_reference():
        return reference_step(reference, reference_opt, ids)

    runs = {"converted_jax": run_converted, "torch_eager": torch_step, "handwritten_nnx": run_reference}
    median = medians(time_interleaved(runs, args.steps, warmup=3))
    result = {
        "config": dict(
            layers=LAYERS,
            d_model=D_MODEL,
            heads=HEADS,
            vocab=VOCAB,
            sequence=SEQUENCE,
            batch=BATCH,
            optimizer="AdamW",
            steps=args.steps,
        ),
        "machine": machine(),
        "first_step_loss": dict(
            converted_jax=converted_first, torch_eager=torch_first, handwritten_nnx=reference_first
        ),
        "median_step_seconds": median,
        "ratios": {
            "converted_over_handwritten": median["converted_jax"] / median["handwritten_nnx"],
            "converted_over_torch_eager": median["converted_jax"] / median["torch_eager"],
        },
    }
    write_results(args.out, result)
    print(json.dumps(result, indent=2))
    np.testing.assert_allclose([converted_first, reference_first], torch_first, rtol=1e-4)


if __name__ == "__main__":
    main()
