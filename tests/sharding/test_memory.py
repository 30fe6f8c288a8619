"""Bytes each device holds, read from the arrays' addressable shards."""

from __future__ import annotations

import collections

import jax
import pytest
import torch

import jmp as smp
from tests.sharding.models import causal_lm, lm_step, token_batches

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


def test_fsdp8_reshards_after_forward_within_1_3x_of_an_eighth_of_one_device():
    """Args + temporaries of the compiled step per device at fsdp=8, against one device's over 8: a layer's
    gathered weights are freed after its forward (gathered again for its backward), unless turned off."""
    ids = token_batches(1, batch=16, length=32)[0]

    def args_and_temporaries(config: dict, devices=None) -> int:
        smp.init(config, devices=devices)
        model = smp.DistributedModel(causal_lm("gpt2", hidden=128, layers=4))
        memory = lm_step.lower(model, ids).compile().memory_analysis()
        return memory.argument_size_in_bytes + memory.temp_size_in_bytes

    ideal = args_and_temporaries({}, devices=jax.devices()[:1]) / 8
    resharded = args_and_temporaries({"sharded_data_parallel_degree": 8})
    gathered_once = args_and_temporaries({"sharded_data_parallel_degree": 8, "reshard_after_forward": False})
    assert resharded <= 1.3 * ideal, f"{resharded / ideal:.2f}x the ideal"
    assert gathered_once > 1.3 * ideal  # the weights gathered once and kept through the backward
