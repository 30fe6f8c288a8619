"""Per-step time of ``@smp.step`` + ``DistributedOptimizer`` against a hand-written ``jax.jit`` train step.

    python -m benchmarks.step_overhead [--steps 60] [--out benchmarks/results/step_overhead.json]

Both train the same converted MLP (4 x 1024 hidden, batch 256, SGD with
momentum), data parallel over the same devices (8 emulated CPU devices unless
XLA_FLAGS says otherwise); the hand-written step fuses gradient and update in
one program. Medians of interleaved steps after warm-up; the ratio is the front
end's overhead.
"""

from __future__ import annotations

import argparse
import json
import statistics

import jax
import optax
import torch
import torch.nn.functional as F
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from torch import nn

import jmp as smp
from benchmarks.harness import emulate_devices, machine, medians, time_interleaved, write_results

BATCH, WIDTH, DEPTH, CLASSES, LR, MOMENTUM = 256, 1024, 4, 10, 0.01, 0.9


def mlp() -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(WIDTH, WIDTH) if i else nn.Linear(64, WIDTH) for i in range(DEPTH)]
    return nn.Sequential(*[m for layer in layers for m in (layer, nn.ReLU())], nn.Linear(WIDTH, CLASSES))


@smp.step
def train_step(model, data, target):
    loss = F.cross_entropy(model(data), target)
    model.backward(loss)
    return loss


def handwritten(mesh):
    """The same training, written directly: convert, split, one jitted step with optax."""
    converted = smp.torch_bridge.convert(mlp())
    graphdef, params, rest = nnx.split(converted, nnx.Param, ...)
    replicated = NamedSharding(mesh, PartitionSpec())
    params, rest = jax.device_put((params, rest), replicated)
    tx = optax.sgd(LR, momentum=MOMENTUM)
    opt_state = jax.jit(tx.init, out_shardings=replicated)(params)

    @jax.jit
    def step(params, rest, opt_state, x, y):
        def loss_fn(params):
            logits = nnx.merge(graphdef, params, rest, copy=True)(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    return step, [params, rest, opt_state]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default="benchmarks/results/step_overhead.json")
    args = parser.parse_args()

    emulate_devices()
    smp.init()
    mesh = smp.get_mesh()
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, 64, generator=generator), torch.randint(0, CLASSES, (BATCH,), generator=generator)
    batch_sharding = NamedSharding(mesh, PartitionSpec(("dp", "fsdp")))

    module = mlp()
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM))

    def run_smp():
        optimizer.zero_grad()
        loss = train_step(model, x, y)
        optimizer.step()
        return loss.reduce_mean()

    step, state = handwritten(mesh)

    def run_handwritten():  # the batch comes from the host each step, as in the smp loop
        xj, yj = jax.device_put((x.numpy(), y.numpy()), batch_sharding)
        loss, state[0], state[2] = step(state[0], state[1], state[2], xj, yj)
        return loss

    samples = time_interleaved({"smp_step": run_smp, "handwritten_jit": run_handwritten}, args.steps, warmup=3)
    median = medians(samples)
    paired = [a / b for a, b in zip(samples["smp_step"], samples["handwritten_jit"])]
    result = {
        "config": dict(
            batch=BATCH, width=WIDTH, depth=DEPTH, optimizer="SGD momentum", steps=args.steps, mesh=dict(mesh.shape)
        ),
        "machine": machine(),
        "median_step_seconds": median,
        "ratio_smp_over_handwritten": median["smp_step"] / median["handwritten_jit"],
        "median_of_paired_ratios": statistics.median(paired),
    }
    write_results(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
