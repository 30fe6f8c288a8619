"""``tsm.transform``: the decoder layers become ``TransformerLayer``s (what FSDP's auto-wrap policy and the
checkpointing predicate of SMP v2 scripts select), and the transformed model, wrapped by jmp over tp 2 x hybrid
shard 4, gives PyTorch's logits and state-dict keys with its layers split by jmp's tensor-parallel rules."""

from __future__ import annotations

import functools
import pickle

import pytest
import torch
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

import jmp
import jmp.tsm as tsm
from jmp.errors import ConfigError
from jmp.tsm.moe.moe_config import MoEConfig
from jmp.tsm.tensor_parallel.transformer import TransformerLayer

transformers = pytest.importorskip("transformers")


def _llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.fixture(scope="module")
def transformed():
    """(the transformed Llama, PyTorch's logits and state-dict keys before the transformation, the input ids)."""
    torch.manual_seed(0)
    tsm.init({"tensor_parallel_degree": 2, "hybrid_shard_degree": 4})
    model = _llama()
    ids = torch.randint(0, 128, (8, 12))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    keys = list(model.state_dict())
    return tsm.transform(model), logits, keys, ids


def test_decoder_layers_are_transformer_layers_and_keep_their_own_class(transformed):
    model, *_ = transformed
    layers = list(model.model.layers)
    assert all(isinstance(layer, TransformerLayer) for layer in layers)
    assert all(isinstance(layer, transformers.models.llama.modeling_llama.LlamaDecoderLayer) for layer in layers)
    assert type(layers[0]) is type(layers[1]) and type(layers[0]).__name__ == "LlamaDecoderLayer"
    assert sum(isinstance(m, TransformerLayer) for m in model.modules()) == 2
    # the scripts' FSDP auto-wrap policy, keyed on TransformerLayer, wraps exactly the decoder layers
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerLayer})
    wrapped = [name for name, m in model.named_modules() if policy(module=m, recurse=False, nonwrapped_numel=0)]
    assert wrapped == ["model.layers.0", "model.layers.1"]


def test_the_transformed_model_gives_pytorchs_logits_and_keys_split_over_tp(transformed):
    model, logits, keys, ids = transformed
    assert list(model.state_dict()) == keys
    wrapped = jmp.DistributedModel(model)
    specs = wrapped.layout.specs
    assert "tp" in specs["model.layers.0.self_attn.q_proj.weight"]  # column-parallel
    assert "tp" in specs["model.layers.1.mlp.down_proj.weight"]  # row-parallel
    with torch.no_grad():
        out = wrapped(input_ids=ids).logits
    torch.testing.assert_close(out, logits, rtol=1e-5, atol=1e-5)
    assert list(wrapped.state_dict()) == keys


def test_a_transformed_model_pickles_and_loads_with_its_layer_classes(transformed):
    model = tsm.transform(_llama())
    assert type(model.model.layers[0]) is type(transformed[0].model.layers[0])  # one derived class per layer class
    loaded = pickle.loads(pickle.dumps(model))
    assert type(loaded.model.layers[0]) is type(model.model.layers[0])
    torch.testing.assert_close(loaded.state_dict(), model.state_dict())


def test_transformer_layer_is_not_built_by_itself():
    with pytest.raises(TypeError, match="isinstance"):
        TransformerLayer()


def test_what_transform_cannot_take_is_refused():
    tsm.init({})
    with pytest.raises(ConfigError, match="no decoder layers"):
        tsm.transform(torch.nn.Linear(4, 4))
    with pytest.raises(ConfigError, match="no experts module"):
        tsm.transform(_llama(), config=MoEConfig(smp_moe=True))
    with pytest.raises(ConfigError, match="moe_load_balancing"):
        MoEConfig(moe_load_balancing="random")


def test_a_mixtrals_experts_are_split_over_ep():
    tsm.init({"expert_parallel_degree": 2, "hybrid_shard_degree": 4})
    config = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
    )
    model = tsm.transform(
        transformers.AutoModelForCausalLM.from_config(config), config=MoEConfig(moe_load_balancing="aux_loss")
    )
    assert isinstance(model.model.layers[0], TransformerLayer)
    specs = jmp.DistributedModel(model).layout.specs
    experts = [name for name in specs if ".experts." in name]
    assert experts and all(specs[name][0] == "ep" for name in experts)
