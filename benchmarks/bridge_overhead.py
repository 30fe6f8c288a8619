"""Training-step time of a converted Hugging Face GPT-2 against PyTorch eager and hand-written Flax NNX.

    python benchmarks/bridge_overhead.py [--steps 20] [--out benchmarks/results/bridge_overhead.json]

GPT-2 with 4 layers, d_model 256, 4 heads, vocab 2048; batch 8 x sequence 128;
one step = forward, backward and AdamW update. The three are measured side by
side in one process, medians after warm-up, and written as JSON with the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from flax import nnx  # noqa: E402

import jmp  # noqa: E402
from benchmarks.reference_gpt2 import GPT2, causal_lm_loss, from_hf  # noqa: E402
from benchmarks.results_io import machine, write_results  # noqa: E402

LAYERS, D_MODEL, HEADS, VOCAB, SEQUENCE, BATCH = 4, 256, 4, 2048, 128, 8
LR = 1e-4


def timed(step, steps: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def hf_model() -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQUENCE,
        n_embd=D_MODEL,
        n_layer=LAYERS,
        n_head=HEADS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).train()


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

    ids_torch = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(1))
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
        converted_step(converted, converted_opt, ids).block_until_ready()

    def run_reference():
        reference_step(reference, reference_opt, ids).block_until_ready()

    # interleave the three so that machine noise falls on all of them alike
    samples = {"converted_jax": [], "torch_eager": [], "handwritten_nnx": []}
    for _ in range(args.steps):
        samples["converted_jax"] += timed(run_converted, 1, warmup=0 if samples["converted_jax"] else 3)
        samples["torch_eager"] += timed(torch_step, 1, warmup=0 if samples["torch_eager"] else 3)
        samples["handwritten_nnx"] += timed(run_reference, 1, warmup=0 if samples["handwritten_nnx"] else 3)
    medians = {name: statistics.median(times) for name, times in samples.items()}
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
        "median_step_seconds": medians,
        "ratios": {
            "converted_over_handwritten": medians["converted_jax"] / medians["handwritten_nnx"],
            "converted_over_torch_eager": medians["converted_jax"] / medians["torch_eager"],
        },
    }
    write_results(args.out, result)
    print(json.dumps(result, indent=2))
    np.testing.assert_allclose([converted_first, reference_first], torch_first, rtol=1e-4)


if __name__ == "__main__":
    main()
