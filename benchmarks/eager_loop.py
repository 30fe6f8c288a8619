"""The same GPT-2 training loop written both ways, side by side: with ``@smp.step`` and as plain PyTorch
(``loss = model(...).loss; loss.backward(); optimizer.step()``, recorded into an implicit step).

    python -m benchmarks.eager_loop [--steps 20] [--out benchmarks/results/eager_loop.json]

GPT-2 (4 layers, d_model 256, batch 8 x 128, ``clip_grad_norm_(model.parameters(), 1.0)``, AdamW) on one
device. Reports the median step time of each loop
and their ratio (eager / step), the Python time the eager loop spends recording per step (the model call and the
calls on its outputs, before ``backward()`` starts the program), the first losses of both (the same program, so
the same numbers) and how many programs each loop compiled over the timed steps.
"""

from __future__ import annotations

import argparse
import time

import torch

import jmp as smp
from benchmarks.harness import causal_lm, gpt2_config, machine, medians, time_interleaved, token_ids, write_results

SPEC = gpt2_config(vocab=512, positions=128, d_model=256, layers=4, heads=4)


@smp.step
def step_loop(model, ids):
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    model.backward(loss)
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/eager_loop.json")
    options = parser.parse_args()
    smp.init({})
    ids = token_ids(8, 128, SPEC["vocab_size"])
    models, optimizers, losses, recording = {}, {}, {"step": [], "eager": []}, []
    for name in ("step", "eager"):
        torch.manual_seed(0)
        models[name] = smp.DistributedModel(causal_lm(SPEC))
        optimizers[name] = smp.DistributedOptimizer(torch.optim.AdamW(models[name].parameters(), lr=1e-3))

    def with_step():
        optimizers["step"].zero_grad()
        loss = step_loop(models["step"], ids)
        torch.nn.utils.clip_grad_norm_(models["step"].parameters(), 1.0)
        optimizers["step"].step()
        losses["step"].append(loss)
        return models["step"].training_state.params

    def eager():
        optimizers["eager"].zero_grad()
        start = time.perf_counter()
        loss = models["eager"](input_ids=ids, labels=ids, use_cache=False).loss
        recording.append(time.perf_counter() - start)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(models["eager"].parameters(), 1.0)
        optimizers["eager"].step()
        losses["eager"].append(loss)
        return models["eager"].training_state.params

    before = {name: len(m.programs) for name, m in models.items()}
    samples = time_interleaved({"step": with_step, "eager": eager}, options.steps, warmup=2)
    times = medians(samples)
    result = {
        "machine": machine(),
        "model": SPEC | {"batch": 8, "seq": 128, "optimizer": "AdamW lr 1e-3", "clip_grad_norm": 1.0},
        "median_step_ms": {name: 1e3 * t for name, t in times.items()},
        "eager_over_step": times["eager"] / times["step"],
        "median_recording_ms": 1e3 * sorted(recording)[len(recording) // 2],
        "programs": {name: len(m.programs) - before[name] for name, m in models.items()},
        "first_losses": {name: [float(v.reduce_mean() if hasattr(v, "reduce_mean") else v) for v in values[:3]]
                         for name, values in losses.items()},
    }  # fmt: skip
    print(result)
    write_results(options.out, result)


if __name__ == "__main__":
    main()
