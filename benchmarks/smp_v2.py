"""The same Llama trained through SMP v1's API and through an SMP v2 FSDP script, side by side, under one layout.

    python -m benchmarks.smp_v2 [--steps 10] [--out benchmarks/results/smp_v2.json]

- v1: ``smp.init({"sharded_data_parallel_degree": 8})``, ``smp.DistributedModel``, ``smp.DistributedOptimizer``
  over ``torch.optim.AdamW``, a ``@smp.step`` function (forward, ``model.backward``), ``opt.step()``.
- v2: ``jmp.tsm.init({"hybrid_shard_degree": 8})``, ``jmp.fsdp.FullyShardedDataParallel(model,
  sharding_strategy=FULL_SHARD)``, a plain ``torch.optim.AdamW`` over ``model.parameters()``, and the eager loop
  (``loss = model(...).loss; loss.backward(); optimizer.step()``).

Both: a Llama from config (4 layers, hidden 256, 8 heads / 4 key-value heads, vocab 1024), the same weights
(torch seed 0), batch 8 x 128, fully sharded over 8 emulated CPU devices in one process, the two loops' steps
interleaved (``benchmarks.harness.time_interleaved``). Reports the median step time of each and their ratio
(v2 / v1; target <= 1.05), the median of the per-round ratios (steadier on a shared machine) and the quartiles;
the bytes each device holds of parameters, gradients and AdamW state (from the arrays' ``addressable_shards``:
the fullest device, and every device's); the first losses of both (the same numbers: the same program); and the
programs each loop compiled from its first step on.
"""

from __future__ import annotations

import argparse
import collections
import statistics
from typing import Any

import jax
import torch
from torch.distributed.fsdp import ShardingStrategy

import jmp as smp
import jmp.tsm as tsm
from benchmarks.harness import (
    causal_lm,
    emulate_devices,
    llama_config,
    lm_step,
    machine,
    medians,
    time_interleaved,
    token_ids,
    write_results,
)
from jmp.eager.plain_optimizers import distributed_optimizer_of
from jmp.fsdp import FullyShardedDataParallel

SPEC = llama_config(vocab=1024, positions=128, hidden=256, intermediate=512, layers=4, heads=8, kv_heads=4)
BATCH, LENGTH, LR = 8, 128, 1e-3


def held_bytes(**trees: Any) -> dict[str, Any]:
    """Bytes each device holds of each tree's arrays (their addressable shards), by tree and in all."""
    per_tree: dict[str, dict[int, int]] = {}
    for name, tree in trees.items():
        held: dict[int, int] = collections.Counter()
        for leaf in jax.tree_util.tree_leaves(tree):
            if isinstance(leaf, jax.Array):
                for shard in leaf.addressable_shards:
                    held[shard.device.id] += shard.data.nbytes
        per_tree[name] = dict(sorted(held.items()))
    devices = sorted({d for held in per_tree.values() for d in held})
    total = {d: sum(held.get(d, 0) for held in per_tree.values()) for d in devices}
    return {
        "fullest_device": max(total.values()),
        "per_device": total,
        "fullest_by_tree": {name: max(held.values()) for name, held in per_tree.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results/smp_v2.json")
    options = parser.parse_args()
    emulate_devices(8)
    ids = token_ids(BATCH, LENGTH, SPEC["vocab_size"])
    losses: dict[str, list] = {"v1": [], "v2": []}

    smp.init({"sharded_data_parallel_degree": 8})
    v1_model = smp.DistributedModel(causal_lm(SPEC))
    v1_optimizer = smp.DistributedOptimizer(torch.optim.AdamW(v1_model.parameters(), lr=LR))

    tsm.init({"hybrid_shard_degree": 8})
    v2_model = FullyShardedDataParallel(causal_lm(SPEC), sharding_strategy=ShardingStrategy.FULL_SHARD)
    v2_optimizer = torch.optim.AdamW(v2_model.parameters(), lr=LR)

    def v1():
        v1_optimizer.zero_grad()
        losses["v1"].append(lm_step(v1_model, ids))
        v1_optimizer.step()
        return v1_model.training_state.params

    def v2():
        v2_optimizer.zero_grad()
        loss = v2_model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        v2_optimizer.step()
        losses["v2"].append(loss)
        return v2_model.training_state.params

    models = {"v1": v1_model, "v2": v2_model}
    before = {name: len(m.programs) for name, m in models.items()}
    samples = time_interleaved({"v1": v1, "v2": v2}, options.steps, warmup=2)
    times = medians(samples)
    v2_state = distributed_optimizer_of(v2_optimizer).opt_state
    held = {
        "v1": held_bytes(params=v1_model.params, grads=v1_model.grads, optimizer=v1_optimizer.opt_state),
        "v2": held_bytes(params=v2_model.params, grads=v2_model.grads, optimizer=v2_state),
    }
    result = {
        "machine": machine(),
        "model": SPEC | {"batch": BATCH, "seq": LENGTH, "optimizer": f"AdamW lr {LR}"},
        "layout": {"v1": {"sharded_data_parallel_degree": 8},
                   "v2": {"hybrid_shard_degree": 8, "sharding_strategy": "FULL_SHARD"},
                   "mesh": dict(smp.get_mesh().shape)},
        "steps_timed": options.steps,
        "median_step_ms": {name: 1e3 * t for name, t in times.items()},
        "v2_over_v1": times["v2"] / times["v1"],
        "quartiles_ms": {name: [1e3 * statistics.quantiles(t, n=4)[i] for i in (0, 2)] for name, t in samples.items()},
        "v2_over_v1_per_round": statistics.median(a / b for a, b in zip(samples["v2"], samples["v1"])),
        "held_bytes": held,
        "held_equal": held["v1"]["per_device"] == held["v2"]["per_device"],
        "programs": {name: len(m.programs) - before[name] for name, m in models.items()},
        "first_losses": {name: [float(v.reduce_mean() if hasattr(v, "reduce_mean") else v) for v in values[:3]]
                         for name, values in losses.items()},
    }  # fmt: skip
    print(result)
    write_results(options.out, result)


if __name__ == "__main__":
    main()
