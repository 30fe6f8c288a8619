"""3D parallelism: pipeline stages split over sharded-data and tensor parallelism, per-device bytes and step time.

    python -m benchmarks.pipeline_3d [--steps 5] [--out benchmarks/results/pipeline_3d.json]

GPT-2 and Llama (``transformers`` configs, random weights, no download: 4 layers, hidden 192, vocabulary 640)
on 8 emulated CPU devices, trained with ``torch.optim.AdamW`` through ``@smp.step`` and
``smp.DistributedOptimizer`` on one global batch (32 rows of 64 tokens), ``microbatches`` 4. Layouts: no
pipeline (dp8, the reference), and ``pipeline_parallel_degree`` 2 with the other four devices as dp4,
fsdp4, tp2 x fsdp2, tp4, and fsdp2 x dp2 with ``shard_optimizer_state``.

Per layout:

- ``held``: bytes of parameters + AdamW state resident on the most loaded device (``addressable_shards``),
  and ``held / (total / 8)``: 1.0 would be every byte split 8 ways. Under pp x dp a stage's parameters are
  whole on its 4 devices (ratio about 4); fsdp and tp split them further.
- ``temp``: ``memory_analysis().temp_size_in_bytes`` of the compiled step (per device).
- ``uneven stages`` (``--uneven``, kept in the same results file): the seed's GroupedNet in 2 stages over dp4
  (automatic cut, Adadelta: 2 slots a parameter), whose fully connected layer outweighs the rest: per stage, the
  bytes of parameters + optimizer state its own parameters make on one device, and what its devices hold
  (``addressable_shards``). One program runs every stage, so every device holds the largest stage's row.
- ``step s``: median seconds of a training step (forward, backward, AdamW update), each layout timed in
  turn after two warm-up steps. On this 2-core CPU the 8 "devices" share the cores, so the times say how
  much work each layout adds, not how it scales on real devices.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import torch
import transformers

import jmp as smp
from benchmarks.harness import (
    causal_lm,
    emulate_devices,
    gpt2_config,
    llama_config,
    lm_step,
    machine,
    time_interleaved,
    token_ids,
    write_results,
)
from benchmarks.step_speed import grouped_net_step
from jmp.examples.models import GroupedNet

BATCH, SEQUENCE, POSITIONS, VOCAB, LR, MICROBATCHES = 32, 64, 96, 640, 1e-3, 4
MODELS = {
    "gpt2": gpt2_config(vocab=VOCAB, positions=POSITIONS, d_model=192, layers=4, heads=8),
    "llama": llama_config(
        vocab=VOCAB, positions=POSITIONS, hidden=192, intermediate=384, layers=4, heads=8, kv_heads=8
    ),
}
LAYOUTS = {
    "dp8": {},
    "pp2xdp4": {"pipeline_parallel_degree": 2},
    "pp2xfsdp4": {"pipeline_parallel_degree": 2, "sharded_data_parallel_degree": 4},
    "pp2xtp2xfsdp2": {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2},
    "pp2xtp4": {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 4},
    "pp2xfsdp2xdp2-zero1": {
        "pipeline_parallel_degree": 2,
        "sharded_data_parallel_degree": 2,
        "shard_optimizer_state": True,
    },
}
MIB = 2**20


def held_bytes(*trees) -> tuple[int, int]:
    """(bytes on the most loaded device, total logical bytes) of the arrays in ``trees``."""
    per_device: dict = {}
    total = 0
    for leaf in jax.tree.leaves(trees):
        total += leaf.nbytes
        for shard in leaf.addressable_shards:
            per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
    return max(per_device.values()), total


def measure(name: str, layout: str, steps: int) -> dict:
    config = {"microbatches": MICROBATCHES, **LAYOUTS[layout]}
    smp.init(config)
    model = smp.DistributedModel(causal_lm(MODELS[name]))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.module.parameters(), lr=LR))
    ids = token_ids(BATCH, SEQUENCE, VOCAB)

    def step():
        optimizer.zero_grad()
        loss = lm_step(model, ids)
        optimizer.step()
        return loss.reduce_mean(), model.training_state.params  # ready once the update is done

    start = time.perf_counter()
    first_loss = float(step()[0])  # the first call partitions a pipelined model and compiles
    first_call = time.perf_counter() - start
    temp = lm_step.lower(model, ids).compile().memory_analysis().temp_size_in_bytes
    held, total = held_bytes(model.training_state.params, optimizer.opt_state)
    times = time_interleaved({"step": step}, steps, warmup=2)["step"]
    row = {
        "model": name,
        "layout": layout,
        "config": config,
        "held_bytes": held,
        "held_ratio": held / (total / jax.device_count()),
        "temp_bytes": temp,
        "first_loss": first_loss,
        "first_call_seconds": first_call,
        "median_step_seconds": statistics.median(times),
        "step_seconds": times,
    }
    print(
        f"  {name:<6} {layout:<20} held {held / MIB:6.2f} MiB ({row['held_ratio']:.2f}x an eighth)  "
        f"temp {temp / MIB:6.2f} MiB  step {row['median_step_seconds']:.3f} s",
        flush=True,
    )
    return row


def uneven_stages() -> dict:
    """GroupedNet at pp2 x dp4: each stage's own bytes per device against what its devices hold."""
    smp.init({"microbatches": MICROBATCHES, "pipeline_parallel_degree": 2, "auto_partition": True})
    torch.manual_seed(0)
    model = smp.DistributedModel(GroupedNet())
    optimizer = smp.DistributedOptimizer(torch.optim.Adadelta(model.module.parameters(), lr=1.0))
    images = torch.randn(64, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    grouped_net_step(model, images, torch.randint(0, 10, (64,), generator=torch.Generator().manual_seed(1)))
    optimizer.step()
    per_device: dict = {}
    for leaf in jax.tree.leaves((model.training_state.params, optimizer.opt_state)):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    mesh = model.layout.mesh
    own, _ = model.pipeline.layout.device_bytes()
    slots = 2  # Adadelta's square_avg and acc_delta, each the size of its parameter
    stages = []
    for stage in range(mesh.shape["pp"]):
        devices = mesh.devices.take(stage, axis=mesh.axis_names.index("pp")).flat
        held = max(per_device[d] for d in devices)
        stages.append(
            {
                "own_bytes": own[stage] * (1 + slots),
                "held_bytes": held,
                "held_over_own": held / (own[stage] * (1 + slots)),
            }
        )
    total = sum(p.numel() * p.element_size() for p in GroupedNet().parameters()) * (1 + slots)
    for stage, row in enumerate(stages):
        print(
            f"  GroupedNet pp2xdp4 stage {stage}: own {row['own_bytes'] / MIB:.2f} MiB, held "
            f"{row['held_bytes'] / MIB:.2f} MiB ({row['held_over_own']:.1f}x its own; "
            f"{row['held_bytes'] / total:.2f}x the whole model's)",
            flush=True,
        )
    return {"model": "GroupedNet", "layout": "pp2xdp4", "total_bytes": total, "stages": stages}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/pipeline_3d.json")
    parser.add_argument("--uneven", action="store_true", help="only the uneven stages' bytes, into the results file")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    emulate_devices()
    if args.uneven:
        with open(args.out) as f:
            result = json.load(f)
    else:
        rows = [measure(name, layout, args.steps) for name in MODELS for layout in LAYOUTS]
        result = {
            "what": __doc__.split("\n\n")[0],
            "machine": {**machine(), "transformers": transformers.__version__},
            "config": dict(batch=BATCH, sequence=SEQUENCE, microbatches=MICROBATCHES, models=MODELS),
            "rows": rows,
        }
    result["uneven_stages"] = uneven_stages()
    write_results(args.out, result)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
