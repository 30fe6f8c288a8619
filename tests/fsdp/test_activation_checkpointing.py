"""torch's activation-checkpointing wrappers on an FSDP model: ``apply_activation_checkpointing`` with a
``check_fn`` choosing the decoder layers checkpoints each of them (one ``jax.checkpoint`` per layer in the step)
and trains as the loop without it; ``offload_wrapper`` sends what they keep to host memory.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import jmp as smp
from jmp.fsdp import (
    FSDP,
    CheckpointImpl,
    ShardingStrategy,
    apply_activation_checkpointing,
    checkpoint_wrapper,
    offload_wrapper,
)
from tests.fsdp.helpers import batches, checkpoints_and_host_copies, llama, optimizer_for, pytorch_run, train
from tests.sharding.models import lm_step

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: E402

WRAPPER = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT, checkpoint_fn=None)


def is_layer(module: torch.nn.Module) -> bool:
    return isinstance(module, LlamaDecoderLayer)


def test_checkpointing_the_decoder_layers_trains_as_without_it():
    smp.init({"scan_layers": False})  # counts per-layer checkpoints (inside a scan: tests/stacks)
    model = FSDP(llama(), sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)  # no per-layer resharding checkpoints
    ids = batches()[0]
    assert checkpoints_and_host_copies(lm_step, model, ids) == (0, 0)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=WRAPPER, check_fn=is_layer)
    assert checkpoints_and_host_copies(lm_step, model, ids) == (2, 0)  # one checkpoint per decoder layer
    expected = pytorch_run().losses
    np.testing.assert_allclose(train(model, optimizer_for(model), batches()), expected, rtol=1e-5)
    assert [name for name, _ in model.named_parameters()] == [name for name, _ in llama().named_parameters()]

    offload_wrapper(model)  # SMP v2's sm_activation_offloading: the root offloads what the checkpoints keep
    regions, copies = checkpoints_and_host_copies(lm_step, model, ids)
    assert regions == 2 and copies >= 2  # each layer's input goes to the host


def test_checkpointing_applied_before_wrapping_takes_effect_when_fsdp_wraps():
    smp.init({"scan_layers": False})
    net = llama()
    apply_activation_checkpointing(net, check_fn=is_layer)
    model = FSDP(net, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)
    assert checkpoints_and_host_copies(lm_step, model, batches()[0]) == (2, 0)
