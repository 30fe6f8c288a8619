"""AdamW updates: the fused Pallas kernels (``jmp.optim.kernels``) against the optax path and torch's fused AdamW.

    python -m benchmarks.optimizer_kernels [--steps 20] [--kinds fp32,mixed] [--tensors-per-launch N]
        [--out benchmarks/results/optimizer_kernels.json]

The parameters are a transformer's: 16 layers of 12 tensors (attention, MLP, norms, biases) plus embeddings,
about 100M float32 parameters in ~200 tensors on a GPU (width 724), 3M on other backends (width 128). The
gradients carry a loss scale, in float32 (``fp32``) or bf16 as a mixed-precision backward leaves them
(``mixed``; jmp keeps no half-precision copy of the parameters between steps, so none is written). One update
reads parameter, gradient and two moments and writes parameter and moments: 28 bytes per parameter (26 with
bf16 gradients), so ``bytes * params / seconds`` is the bandwidth an update achieves, reported as a fraction of
``--peak-gbps`` (default: an H100 SXM's 3350 GB/s) on a GPU.

- ``fused``: ``jmp.optim.kernels.fused_adamw`` compiled (Triton): unscaling, update and the new parameters and
  moments written in place, one launch per 73 tensors, in one jitted program with the state donated (what
  ``DistributedOptimizer`` runs on a GPU).
- ``optax``: the gradients unscaled, ``jmp.optim.torch_rules.adamw``, ``optax.apply_updates``, the same way
  (what it runs elsewhere, and with ``fused_optimizer: False``).
- ``torch``: ``torch.optim.AdamW(fused=True)`` on the same shapes (float32 gradients), when torch sees a CUDA
  device.

Each run's first call (tracing, compiling, one update) is timed apart: ``first_call_seconds``. The fused
kernels' compile grows with the tensors in one launch (each tensor's body is a branch of the one Triton kernel);
``--tensors-per-launch`` caps them below what the kernel's argument space allows, to measure that trade.

On a CPU Pallas runs only in interpret mode, which checks the kernels' numbers but says nothing about their
speed: the script then reports the largest difference from the optax path and the interpret-mode time,
labelled as such.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch

from benchmarks.harness import machine, time_interleaved, write_results
from jmp.optim import torch_rules as torch_optimizers
from jmp.optim.kernels import fused_adamw, multi_tensor
from jmp.precision import loss_scaling

LAYERS, VOCAB = 16, 32000
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
SCALE = 2.0**12  # the loss scale the gradients carry
ADAM_OPERANDS = 7  # parameter, gradient, two moments in; parameter and two moments out


def transformer_shapes(width: int, vocab: int) -> dict[str, tuple[int, ...]]:
    shapes = {"embed": (vocab, width)}
    for i in range(LAYERS):
        shapes |= {
            f"h{i}.qkv": (width, 3 * width),
            f"h{i}.qkv_bias": (3 * width,),
            f"h{i}.out": (width, width),
            f"h{i}.out_bias": (width,),
            f"h{i}.fc": (width, 4 * width),
            f"h{i}.fc_bias": (4 * width,),
            f"h{i}.proj": (4 * width, width),
            f"h{i}.proj_bias": (width,),
            f"h{i}.ln1": (width,),
            f"h{i}.ln1_bias": (width,),
            f"h{i}.ln2": (width,),
            f"h{i}.ln2_bias": (width,),
        }
    return shapes


def _tree(shapes: dict, seed: int) -> dict:
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    return {name: jax.random.normal(k, shape) * 0.02 for k, (name, shape) in zip(keys, shapes.items())}


def _stepper(factory, fused: bool):
    """A jitted AdamW update of the whole tree: the parameters and state donated, the gradients loss-scaled by
    ``SCALE`` in their own dtype (float32, or bf16 as a mixed-precision backward leaves them)."""
    tx = optax.inject_hyperparams(factory, static_args=("amsgrad", "maximize"))(**HYPER, amsgrad=False, maximize=False)

    @functools.partial(jax.jit, donate_argnums=(0, 2))
    def step(params, grads, state):
        if fused:  # unscaled in the kernel, which writes the parameters and moments in place
            return tx.update(grads, state, params, grad_scale=1 / SCALE, return_params=True)
        updates, state = tx.update(loss_scaling.unscaled(grads, 1 / SCALE), state, params)
        return optax.apply_updates(params, updates), state

    return tx, step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--peak-gbps", type=float, default=3350.0)
    parser.add_argument("--kinds", default="fp32,mixed", help="comma list of gradient kinds: fp32, mixed")
    parser.add_argument("--tensors-per-launch", type=int, default=None, help="fewer tensors per fused launch")
    parser.add_argument("--out", default="benchmarks/results/optimizer_kernels.json")
    args = parser.parse_args()
    kinds = [kind.strip() for kind in args.kinds.split(",") if kind.strip()]
    if not kinds or set(kinds) - {"fp32", "mixed"}:
        parser.error(f"--kinds {args.kinds!r}: a comma list of fp32, mixed")
    if args.tensors_per_launch:  # the argument space multi_tensor.launches divides, sized for this many tensors
        multi_tensor.ARGUMENT_BYTES = (args.tensors_per_launch * ADAM_OPERANDS + 1) * 8
    on_gpu = jax.default_backend() == "gpu"
    shapes = transformer_shapes(724 if on_gpu else 128, VOCAB if on_gpu else 4096)
    count = sum(int(np.prod(s)) for s in shapes.values())
    gradients = {"fp32": _tree(shapes, 1), "mixed": jax.tree.map(lambda g: g.astype(jnp.bfloat16), _tree(shapes, 1))}
    gradients = {kind: gradients[kind] for kind in kinds}
    gradients = {kind: jax.tree.map(lambda g: g * SCALE, tree) for kind, tree in gradients.items()}
    factories = {"fused": functools.partial(fused_adamw, interpret=not on_gpu), "optax": torch_optimizers.adamw}
    runs = {}
    for kind, grads in gradients.items():
        for name, factory in factories.items():
            tx, step = _stepper(factory, fused=name == "fused")
            box = {"params": _tree(shapes, 0)}
            box["state"] = tx.init(box["params"])

            def run(step=step, box=box, grads=grads):
                box["params"], box["state"] = step(box["params"], grads, box["state"])
                return box["params"]

            runs[f"{name}-{kind}"] = run
    if on_gpu and torch.cuda.is_available():
        tensors = [torch.randn(s, device="cuda") * 0.02 for s in shapes.values()]
        for t in tensors:
            t.grad = torch.randn_like(t)
        adamw = torch.optim.AdamW(tensors, lr=1e-3, weight_decay=0.01, fused=True)

        def torch_run():
            adamw.step()
            torch.cuda.synchronize()

        runs["torch-fp32"] = torch_run
    first_calls = {}
    for name, run in runs.items():  # tracing and compiling, apart from the timed updates
        start = time.perf_counter()
        jax.block_until_ready(run())
        first_calls[name] = time.perf_counter() - start
        print(f"{name}: first call {first_calls[name]:.1f} s", flush=True)
    samples = time_interleaved(runs, args.steps, warmup=1)
    finals = {name: run() for name, run in runs.items() if not name.startswith("torch")}  # one more update each
    differences = {
        kind: max(float(jnp.max(jnp.abs(finals[f"fused-{kind}"][k] - finals[f"optax-{kind}"][k]))) for k in shapes)
        for kind in gradients
    }
    results = {}
    for name, times in samples.items():
        seconds = statistics.median(times)
        moved = (26 if name.endswith("mixed") else 28) * count
        results[name] = {"median_seconds": seconds, "gbps": moved / seconds / 1e9}
        results[name]["first_call_seconds"] = first_calls[name]
        if on_gpu:
            results[name]["fraction_of_peak"] = results[name]["gbps"] / args.peak_gbps
    print(f"{count / 1e6:.1f}M float32 parameters in {len(shapes)} tensors on {jax.default_backend()}")
    if not on_gpu:
        print("Pallas runs in interpret mode here: the fused times below are not the kernels' speed")
    for name, row in results.items():
        peak = f", {row['fraction_of_peak']:.0%} of peak" if "fraction_of_peak" in row else ""
        print(
            f"{name:>12}: {row['median_seconds'] * 1e3:8.2f} ms per update, {row['gbps']:7.1f} GB/s{peak}, "
            f"first call {row['first_call_seconds']:.1f} s"
        )
    for kind, difference in differences.items():
        print(f"largest |fused - optax| ({kind}) after {args.steps + 3} updates: {difference:.3g}")
    write_results(
        args.out,
        {
            "what": __doc__.split("\n\n")[0],
            "machine": machine(),
            "config": {
                "parameters": count,
                "tensors": len(shapes),
                "tensors_per_launch": len(multi_tensor.launches(range(len(shapes)), ADAM_OPERANDS)[0]),
                "steps": args.steps,
                "loss_scale": SCALE,
                **HYPER,
            },
            "interpret_mode": not on_gpu,
            "max_abs_difference_fused_vs_optax": differences,
            "rows": results,
        },
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
