"""Bytes each device holds, read from the arrays' addressable shards."""

from __future__ import annotations

import collections

import jax
import pytest
import torch

import jmp as smp
from tests.sharding.models import causal_lm

pytest.importorskip("transformers")


def _per_device(tree) -> tuple[int, int]:
    """(most bytes any device holds, total bytes of the arrays)."""
    held: collections.Counter = collections.Counter()
    total = 0
    for leaf in jax.tree.leaves(tree):
        total += leaf.nbytes
        for shard in leaf.addressable_shards:
            held[shard.device.id] += shard.data.nbytes
    return max(held.values()), total


def _model_and_optimizer(config: dict):
    smp.init(config)
    model = smp.DistributedModel(causal_lm("gpt2", hidden=128))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.module.parameters(), lr=1e-3))
    return model, optimizer


def test_sharded_data_parallel_holds_an_eighth_of_parameters_and_optimizer_state():
    model, optimizer = _model_and_optimizer({"sharded_data_parallel_degree": 8})
    held, total = _per_device((model.params, optimizer.opt_state))
    assert held <= 1.10 * total / 8, f"{held} bytes on the fullest device vs {total / 8:.0f} ideal"


def test_tensor_parallel_blocks_hold_a_quarter_each():
    model, _ = _model_and_optimizer({"tensor_parallel_degree": 4})
    blocks = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(model.params) if "'h'" in str(path)]
    assert blocks
    held, total = _per_device(blocks)
    assert held <= 1.10 * total / 4, f"{held} bytes on the fullest device vs {total / 4:.0f} ideal"


def test_shard_optimizer_state_splits_only_the_optimizer_state():
    model, optimizer = _model_and_optimizer({"shard_optimizer_state": True})
    held, total = _per_device(optimizer.opt_state)
    assert held <= 1.10 * total / 8
    params_held, params_total = _per_device(model.params)
    assert params_held == params_total  # parameters stay whole on every device (ZeRO-1)
