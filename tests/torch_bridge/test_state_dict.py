"""``to_state_dict``: converted values back into torch, under torch's names, loadable strictly."""

import jax
import jax.numpy as jnp
import pytest
import torch
from flax import nnx
from torch import nn

import jmp
from jmp.errors import ConversionError
from jmp.examples.models import GroupedNet
from jmp.torch_bridge.module import hooked_call
from tests.helpers import assert_close, assert_grad_parity, to_jax

transformers = pytest.importorskip("transformers")


def _sgd_step(converted, loss):
    """One plain SGD step in JAX, so the exported values differ from the original ones (the gradient compiled: op
    by op, its ~200 small programs took most of a test's time)."""
    grads = nnx.jit(nnx.grad(loss))(converted)
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


def test_a_tied_parameter_is_held_under_the_name_torch_reports():
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
    model = transformers.GPT2LMHeadModel(config).eval()
    assert model.lm_head.weight is model.transformer.wte.weight  # tie_word_embeddings (the default)
    converted = jmp.torch_bridge.convert(model)
    _, params, _ = nnx.split(converted, nnx.Param, ...)
    held = [jmp.torch_bridge.torch_name(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)]
    assert len(held) == len(set(held))
    assert set(held) == {name for name, _ in model.named_parameters()}  # "transformer.wte.weight", no "lm_head.weight"
    assert converted.lm_head.weight is converted.transformer.wte.weight

    ids = torch.randint(0, 100, (2, 8))
    _sgd_step(converted, lambda m: jnp.mean(m(to_jax(ids)).logits ** 2))
    assert converted.lm_head.weight is converted.transformer.wte.weight  # still one Variable after NNX rebuilt it
    state = jmp.torch_bridge.to_state_dict(converted)
    assert list(state) == list(model.state_dict())
    fresh = transformers.GPT2LMHeadModel(config)
    fresh.load_state_dict(state, strict=True)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    torch.testing.assert_close(fresh.lm_head.weight, state["transformer.wte.weight"])
    assert not torch.allclose(fresh.transformer.wte.weight, model.transformer.wte.weight)
    assert_close(converted(to_jax(ids)).logits, fresh.eval()(ids).logits, rtol=1e-4)


class TiedHead(nn.Module):
    """The head's weight is the embedding's: torch names it 'embed.weight' first, NNX's sorted order 'head.weight'."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.mix = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.embed(ids))))


def _run_a_copy(module, call, *args, **kwargs):
    """A call hook that runs a copy of the module split from the model alone (as a checkpointed region does)."""
    copy = nnx.merge(*nnx.split(module))
    return hooked_call(copy, _run_a_copy)(*args, **kwargs)


def test_a_copy_split_without_the_tied_owner_reads_it_from_the_running_model():
    model = TiedHead()
    converted = jmp.torch_bridge.convert(model)
    assert "head.weight" not in {
        jmp.torch_bridge.torch_name(path) for path, _ in jax.tree_util.tree_leaves_with_path(nnx.state(converted))
    }
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with jmp.torch_bridge.call_hooks({"head": _run_a_copy}):
        assert_close(converted(to_jax(ids)), model(ids))
        assert_grad_parity(model, converted, lambda m: (m(ids) ** 2).sum(), lambda m: jnp.sum(m(to_jax(ids)) ** 2))


def test_a_copy_split_from_the_model_alone_says_where_its_tied_tensor_is():
    converted = jmp.torch_bridge.convert(TiedHead())
    copy = nnx.merge(*nnx.split(converted.head))
    with pytest.raises(ConversionError, match="'head.weight' is tied to 'embed.weight'"):
        copy(jnp.ones((1, 4)))


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
