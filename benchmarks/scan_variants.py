"""What was tried on the GPT-2 CPU step that misses torch.compile: the scanned stack's choices side by side.

    python -m benchmarks.scan_variants [--rounds 12] [--out benchmarks/results/scan_variants.json]

The GPT-2 and step of ``benchmarks.step_speed`` (4 layers, d_model 256, batch 8 x 128, AdamW, float32, JAX's
one CPU device), trained as:

- ``scanned``: jmp's default, the 4 blocks as one ``lax.scan`` whose body keeps its matmul outputs for the
  backward (``jax.checkpoint`` with ``dots_saveable``) and recomputes the elementwise work between them;
- ``scan_unrolled``: the same scan fully unrolled (``unroll=True``: no while loop, so no zero-filled
  ``[layers, ...]`` buffers for the residuals and per-layer gradients, the 7% ``wrapped_broadcast`` of
  ``cpu_profile``), which gives back compile time flat in depth;
- ``scan_keeps_everything``: the scan body without its checkpoint (the backward reads every saved intermediate);
- ``unscanned``: ``scan_layers`` off, the blocks one by one;
- PyTorch eager and ``torch.compile`` (inductor on the loss and on ``optimizer.step``) beside them.

Steps run in blocks, as a training loop runs them: each round calls each run ``--block`` times in a row and times
all but the first (the caches warm for the run, as in training), the order reversed every other round. The
variants other than the default are made by replacing ``jax.lax.scan`` / ``jax.checkpoint`` while the first step
traces; every run's first loss is recorded (all equal: the variants change the program, not the numbers).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
from unittest import mock

import jax
import torch
import transformers

from benchmarks import step_speed
from benchmarks.harness import (
    lm_step,
    machine,
    medians,
    time_interleaved,
    token_ids,
    write_results,
)

_SCAN = jax.lax.scan


def _variant(name: str):
    if name == "scan_unrolled":
        return mock.patch("jax.lax.scan", functools.partial(_SCAN, unroll=True))
    if name == "scan_keeps_everything":
        return mock.patch("jax.checkpoint", lambda fun, **_: fun)
    return contextlib.nullcontext()


def _config(name: str) -> dict:
    return {"microbatches": 1, **({"scan_layers": False} if name == "unscanned" else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--block", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/scan_variants.json")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    if len(jax.devices()) != 1:
        raise SystemExit(f"run with JAX's one CPU device, not {len(jax.devices())} (unset XLA_FLAGS)")
    load_at_start = list(os.getloadavg())
    ids = token_ids(step_speed.GPT2_BATCH, step_speed.GPT2_SEQUENCE, step_speed.GPT2["vocab"])

    make_model, make_optimizer, loss_of = step_speed.gpt2_model, step_speed.gpt2_optimizer, step_speed.gpt2_loss(ids)
    runs, first = {}, {}
    runs["torch_eager"], first["torch_eager"] = step_speed.torch_run(make_model, make_optimizer, loss_of)
    runs["torch_compile"], first["torch_compile"], _ = step_speed.torch_compiled_run(
        make_model, make_optimizer, loss_of
    )
    variants = ("scanned", "scan_unrolled", "scan_keeps_everything", "unscanned")
    for name in variants:
        with _variant(name):  # the first step traces and compiles
            runs[name], first[name] = step_speed.jmp_run(
                make_model, make_optimizer, _config(name), 1, lambda model: lm_step(model, ids)
            )
    prepare = {name: functools.partial(step_speed.init, _config(name), 1) for name in variants}
    median = medians(time_interleaved(runs, args.rounds, warmup=0, prepare=prepare, block=args.block))
    result = {
        "machine": machine(),
        "command": f"python -m benchmarks.scan_variants --rounds {args.rounds} --block {args.block}",
        "torch_threads": torch.get_num_threads(),
        "load_average_at_start": load_at_start,
        "load_average_after": list(os.getloadavg()),
        "first_loss": first,
        "median_step_ms": {k: v * 1e3 for k, v in median.items()},
        "over_torch_compile": {k: v / median["torch_compile"] for k, v in median.items()},
        "over_scanned": {k: v / median["scanned"] for k, v in median.items()},
    }
    print({k: round(v, 1) for k, v in result["median_step_ms"].items()}, flush=True)
    write_results(args.out, result)


if __name__ == "__main__":
    main()
