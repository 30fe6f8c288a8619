"""Strategies and policies change what the backward pass keeps, never the loss or gradients (dropout on)."""

import jax
import pytest

import jmp as smp
from tests.helpers import assert_close
from tests.remat.helpers import (
    assert_same_grads,
    gpt2,
    host_transfers,
    lm_loss_and_grads,
    lm_step,
    lm_without_checkpointing,
    recomputations,
    saved_shapes,
    token_batch,
)


def _checkpointed(microbatches: int = 1, config: dict | None = None, **annotation):
    """Train one step of ``gpt2()`` (3 layers) with its layers annotated; check it against no checkpointing."""
    expected_loss, expected = lm_without_checkpointing(microbatches)
    smp.init({"microbatches": microbatches, "scan_layers": False, **(config or {})})  # per-layer programs
    model = smp.DistributedModel(gpt2())
    smp.set_activation_checkpointing(model.module.transformer.h, **annotation)
    ids = token_batch(8 * microbatches)
    loss, grads = lm_loss_and_grads(model, ids)
    assert_close(loss, expected_loss, 1e-6)
    assert_same_grads(grads, expected)
    return model, ids


@pytest.mark.parametrize(("strategy", "microbatches", "checkpoints"), [("group_2", 2, 2), ("contiguous", 1, 1)])
def test_grouping_strategies_checkpoint_runs_of_layers_with_unchanged_gradients(strategy, microbatches, checkpoints):
    # 3 layers: group_2 -> [0, 1], [2]; contiguous -> [0, 1, 2]. Two microbatches trace the layers in a scan.
    model, ids = _checkpointed(microbatches, strategy=strategy)
    assert recomputations(lm_step, model, ids) == checkpoints


# Shapes in gpt2() on token_batch(8): batch 8, sequence 16, width 32, 4 heads, MLP width 128.
SCORES, QKV, MLP_HIDDEN = (8, 4, 16, 16), (8, 16, 96), (8, 16, 128)


@pytest.mark.parametrize(
    ("annotation", "config", "kept", "offloaded"),
    [
        ({"policy": "save_matmuls"}, {}, {SCORES: 3}, 0),  # attention scores are a matmul output
        ({"policy": smp.RematPolicy("save_names", ("attn.c_attn", "mlp.c_fc"))}, {}, {QKV: 3, MLP_HIDDEN: 3}, 0),
        ({}, {"activation_checkpointing_policy": "offload_names:mlp.c_fc"}, {MLP_HIDDEN: 3}, 3),  # the config's
    ],
)
def test_policies_keep_what_they_name_for_the_backward_pass_with_unchanged_gradients(
    annotation, config, kept, offloaded
):
    model, ids = _checkpointed(config=config, **annotation)
    saved = saved_shapes(lm_step, model, ids)
    assert {shape: saved[shape] for shape in kept} == kept  # one per layer
    assert host_transfers(lm_step, model, ids) == offloaded


def test_a_jax_policy_function_can_be_given_directly():
    smp.init({"scan_layers": False})
    model = smp.DistributedModel(gpt2())
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable  # keeps projections, not attention scores
    smp.set_activation_checkpointing(model.module.transformer.h, policy=policy)
    saved = saved_shapes(lm_step, model, token_batch())
    assert saved[(128, 96)] == saved[(128, 128)] == 3 and saved[SCORES] == 0  # (the projections flatten the batch)
