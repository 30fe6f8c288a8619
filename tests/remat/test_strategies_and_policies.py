"""Strategies and policies change what the backward pass keeps, never the loss or gradients (dropout on)."""

import pytest

import jmp as smp
from tests.helpers import assert_close
from tests.remat.helpers import (
    assert_same_grads,
    gpt2,
    lm_loss_and_grads,
    lm_step,
    lm_without_checkpointing,
    primitives,
    token_batch,
)


def _checkpointed(microbatches: int = 1, config: dict | None = None, **annotation):
    """Train one step of ``gpt2()`` (3 layers) with its layers annotated; check it against no checkpointing."""
    expected_loss, expected = lm_without_checkpointing(microbatches)
    smp.init({"microbatches": microbatches, **(config or {})})
    model = smp.DistributedModel(gpt2())
    smp.set_activation_checkpointing(model.module.transformer.h, **annotation)
    ids = token_batch(8 * microbatches)
    loss, grads = lm_loss_and_grads(model, ids)
    assert_close(loss, expected_loss, 1e-6)
    assert_same_grads(grads, expected)
    return primitives(lm_step, model, ids)


@pytest.mark.parametrize(("strategy", "microbatches", "checkpoints"), [("group_2", 2, 2), ("contiguous", 1, 1)])
def test_grouping_strategies_checkpoint_runs_of_layers_with_unchanged_gradients(strategy, microbatches, checkpoints):
    # 3 layers: group_2 -> [0, 1], [2]; contiguous -> [0, 1, 2]. Two microbatches trace the layers in a scan.
    assert _checkpointed(microbatches, strategy=strategy)["remat2"] == checkpoints


@pytest.mark.parametrize(
    ("annotation", "config", "named"),
    [
        ({"policy": "save_matmuls"}, {}, 0),
        ({"policy": "save_names:attn,mlp.c_fc"}, {}, 6),
        ({}, {"activation_checkpointing_policy": "offload_names:attn"}, 3),  # the config's default policy
    ],
)
def test_policies_keep_what_they_name_with_unchanged_gradients(annotation, config, named):
    program = _checkpointed(config=config, **annotation)
    assert program["remat2"] == 3
    assert program["name"] == named  # one checkpoint_name per named activation and layer
    offloading = "offload" in str(annotation) + str(config)
    assert program["device_put"] >= (named if offloading else 0)
