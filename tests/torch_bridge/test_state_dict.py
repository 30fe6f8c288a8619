"""``to_state_dict``: converted values back into torch, under torch's names, loadable strictly."""

import jax
import jax.numpy as jnp
import pytest
import torch
from flax import nnx
from torch import nn

import jmp
from jmp.examples.models import GroupedNet
from tests.helpers import assert_close, to_jax

transformers = pytest.importorskip("transformers")


def _sgd_step(converted, loss):
    """One plain SGD step in JAX, so the exported values differ from the original ones."""
    grads = nnx.grad(loss)(converted)
    params = nnx.state(converted, nnx.Param)
    nnx.update(converted, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))


def test_round_trip_after_training_loads_strictly_and_reproduces_outputs():
    model = GroupedNet().eval()
    converted = jmp.torch_bridge.convert(model)
    x = torch.randn(2, 1, 28, 28)
    _sgd_step(converted, lambda m: jnp.mean(m(to_jax(x)) ** 2))

    fresh = GroupedNet().eval()
    fresh.load_state_dict(jmp.torch_bridge.to_state_dict(converted), strict=True)
    assert_close(converted(to_jax(x)), fresh(x))
    assert not torch.allclose(fresh.net2.fc2.weight, model.net2.fc2.weight)


def test_tied_weights_export_under_both_names_and_buffers_keep_their_dtype():
    config = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=16)
    model = transformers.AutoModelForCausalLM.from_config(config)
    state = jmp.torch_bridge.to_state_dict(jmp.torch_bridge.convert(model))
    assert list(state) == list(model.state_dict())
    torch.testing.assert_close(state["lm_head.weight"], state["transformer.wte.weight"])

    bn = nn.BatchNorm1d(3)
    exported = jmp.torch_bridge.to_state_dict(jmp.torch_bridge.convert(bn))
    assert exported["num_batches_tracked"].dtype == torch.int64


def test_non_persistent_buffers_are_not_exported():
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    converted = jmp.torch_bridge.convert(model)
    state = jmp.torch_bridge.to_state_dict(converted)
    assert set(state) == set(model.state_dict())
    assert "model.rotary_emb.inv_freq" not in state
    fresh = transformers.AutoModelForCausalLM.from_config(config)
    fresh.load_state_dict(state, strict=True)
