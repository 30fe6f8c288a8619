"""FP8 training (config ``fp8``: TE's DelayedScaling, HYBRID) against bf16 and float32 on a tiny Llama, side by side.

    python -m benchmarks.fp8 [--steps 200] [--out benchmarks/results/fp8.json]

A Hugging Face Llama (hidden 64, intermediate 128, 2 layers, 4 heads / 2 key-value heads, vocab 256) trained
with AdamW (lr 1e-3) on a new batch every step (8 x 64 tokens) drawn from one fixed random Markov chain (each
token has 4 likely successors), so the loss falls towards the chain's entropy and every precision sees the same
data from the same weights. Precisions: ``fp32``, ``bf16``, ``fp8_bf16`` (``fp8`` with ``bf16``: what TE runs,
fp8 Linear matmuls, bf16 elsewhere) and ``fp8_fp32`` (fp8 matmuls, float32 elsewhere); the recipe's defaults
(history 1024, "max", margin 0). Reports each run's losses, the largest and mean relative gap per step of
``fp8_bf16`` to ``bf16`` and of ``bf16`` to ``fp32`` (over all steps and over the last quarter), the fp8
program's matmuls by operand types (the lowered program: what XLA is asked; the optimised one: what XLA:CPU
runs), and step times, interleaved, of bf16 and fp8_bf16 (on a CPU, which has no fp8 arithmetic: XLA:CPU
converts fp8 operands to a wider type, so the ratio says nothing of a GPU's fp8 tensor cores).
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics

import numpy as np
import torch

import jmp as smp
from benchmarks.harness import (
    causal_lm,
    emulate_devices,
    llama_config,
    lm_step,
    machine,
    medians,
    time_interleaved,
    write_results,
)

SPEC = llama_config(vocab=256, positions=64, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2)
BATCH, LENGTH = 8, 64
PRECISIONS = {
    "fp32": {},
    "bf16": {"bf16": True},
    "fp8_bf16": {"bf16": True, "fp8": True},
    "fp8_fp32": {"fp8": True},
}


def markov_batches(steps: int, seed: int = 0) -> list[torch.Tensor]:
    """``steps`` batches of token sequences from one random chain: each token has 4 successors (probabilities
    0.55, 0.25, 0.15, 0.05)."""
    rng = np.random.default_rng(seed)
    vocab = SPEC["vocab_size"]
    successors = np.stack([rng.choice(vocab, 4, replace=False) for _ in range(vocab)])
    weights = np.array([0.55, 0.25, 0.15, 0.05])
    batches = []
    for _ in range(steps):
        tokens = np.empty((BATCH, LENGTH), np.int64)
        tokens[:, 0] = rng.integers(0, vocab, BATCH)
        for t in range(1, LENGTH):
            choice = rng.choice(4, BATCH, p=weights)
            tokens[:, t] = successors[tokens[:, t - 1], choice]
        batches.append(torch.from_numpy(tokens))
    return batches


class Run:
    def __init__(self, config: dict):
        self.config = config
        smp.init(config)
        self.model = smp.DistributedModel(causal_lm(SPEC))
        self.optimizer = smp.DistributedOptimizer(torch.optim.AdamW(self.model.parameters(), lr=1e-3))

    def step(self, ids: torch.Tensor):
        self.optimizer.zero_grad()
        loss = lm_step(self.model, ids)
        self.optimizer.step()
        return loss


def gaps(losses: list[float], reference: list[float]) -> dict[str, float]:
    relative = np.abs(np.array(losses) - np.array(reference)) / np.array(reference)
    tail = relative[-max(1, len(relative) // 4) :]
    return dict(max=float(relative.max()), mean=float(relative.mean()), tail_max=float(tail.max()))


def matmul_types(text: str, pattern: str) -> dict[str, int]:
    """Counts of the matmuls in ``text`` by operand element types."""
    return dict(collections.Counter(", ".join(types) for types in re.findall(pattern, text)))


def optimised_matmuls(text: str) -> dict[str, int]:
    """The optimised program's dots, and its conversions of fp8 arrays to wider types (XLA:CPU's way)."""
    fp8_values = dict(re.findall(r"(%[\w.]+) = (f8\w+)\[", text))
    converts = collections.Counter(
        f"{fp8_values[source]} -> {wider}"
        for wider, source in re.findall(HLO_FP8_CONVERT, text)
        if source in fp8_values
    )
    return dict(dots=len(re.findall(HLO_DOT, text)), **{f"convert {k}": v for k, v in converts.items()})


STABLEHLO_DOT = r"stablehlo\.dot_general[^\n]*?: \(tensor<[\dx]*x(\w+)>, tensor<[\dx]*x(\w+)>\)"
HLO_DOT = r"= \w+\[[\d,]*\]\S* dot\("
HLO_FP8_CONVERT = r"= (\w+)\[[\d,]*\]\S* convert\((%[\w.]+)\)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--timed-steps", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/fp8.json")
    options = parser.parse_args()
    emulate_devices(1)
    batches = markov_batches(options.steps)
    losses = {}
    for name, config in PRECISIONS.items():
        run = Run(config)
        losses[name] = [float(run.step(ids).reduce_mean()) for ids in batches]
        print(name, "loss", losses[name][0], "->", losses[name][-1], flush=True)

    fp8 = Run(PRECISIONS["fp8_bf16"])
    lowered = lm_step.lower(fp8.model, batches[0])
    programs = dict(
        lowered=matmul_types(lowered.as_text(), STABLEHLO_DOT),
        optimised_cpu=optimised_matmuls(lowered.compile().as_text()),
    )

    runs = {"bf16": Run(PRECISIONS["bf16"]), "fp8_bf16": fp8}
    samples = time_interleaved(
        {name: (lambda run=run: run.step(batches[0]).outputs[0]) for name, run in runs.items()},
        options.timed_steps,
        prepare={name: (lambda run=run: smp.init(run.config)) for name, run in runs.items()},
    )
    times = medians(samples)
    ratios = [f / b for f, b in zip(samples["fp8_bf16"], samples["bf16"], strict=True)]
    result = dict(
        what=__doc__.splitlines()[0],
        machine=machine(),
        model=SPEC,
        batch=[BATCH, LENGTH],
        steps=options.steps,
        recipe=dict(fp8_format="hybrid", amax_history_len=1024, amax_compute_algo="max", margin=0),
        gaps={
            "fp8_bf16 vs bf16": gaps(losses["fp8_bf16"], losses["bf16"]),
            "fp8_fp32 vs fp32": gaps(losses["fp8_fp32"], losses["fp32"]),
            "bf16 vs fp32": gaps(losses["bf16"], losses["fp32"]),
        },  # fmt: skip
        final_loss={name: values[-1] for name, values in losses.items()},
        fp8_program_matmuls=programs,
        cpu_step_seconds=dict(times, fp8_over_bf16=statistics.median(ratios)),
        losses=losses,
    )
    write_results(options.out, result)
    print({k: result[k] for k in ("gaps", "final_loss", "fp8_program_matmuls", "cpu_step_seconds")})


if __name__ == "__main__":
    main()
