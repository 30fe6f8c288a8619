"""Models built on the meta device are initialised directly into their shards by their own init code."""

from __future__ import annotations

import math
import os

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import jmp as smp
from jmp.errors import ConfigError, ConversionError
from jmp.torch_bridge import convert
from jmp.wrapped_model import delayed_init
from tests.front_end.helpers import torch_train

transformers = pytest.importorskip("transformers")

LLAMA = dict(
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=64,
)


def _llama_on_meta():
    with smp.delay_param_initialization():
        return transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**LLAMA))


def _bytes_on_device(array: jax.Array, device) -> int:
    return sum(shard.data.nbytes for shard in array.addressable_shards if shard.device == device)


def test_hugging_face_model_is_initialised_in_shards_as_unsharded():
    smp.init({"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 4})
    module = _llama_on_meta()
    assert all(p.is_meta for p in module.parameters())
    sharded = smp.DistributedModel(module)
    assert all(p.is_meta for p in sharded.parameters())  # module-like methods never gather the model
    params = sharded.layout.by_name(sharded.training_state.params)
    device = jax.devices()[0]
    total = sum(p.nbytes for p in params.values())
    held = sum(_bytes_on_device(p, device) for p in params.values())
    assert held <= 1.15 * total / 8
    values = sharded.state_dict()

    smp.init({})  # the same model replicated on every device
    replicated = smp.DistributedModel(_llama_on_meta()).state_dict()
    assert values.keys() == replicated.keys()
    for name in values:
        torch.testing.assert_close(values[name], replicated[name], rtol=0, atol=0, msg=name)

    reference = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**LLAMA))
    for name, tensor in reference.state_dict().items():
        mine = values[name]
        assert mine.shape == tensor.shape and mine.dtype == tensor.dtype, name
        if "norm" in name:  # Hugging Face's _init_weights: ones
            torch.testing.assert_close(mine, tensor, rtol=0, atol=0)
        else:  # normal(0, initializer_range)
            assert abs(float(mine.std()) - 0.02) < 0.002, name
            assert abs(float(mine.mean())) < 0.002, name
    # buffers Hugging Face recomputes in _init_weights (rotary frequencies) equal torch's
    rest = {n: b for n, b in replicated_buffers(sharded).items()}
    torch.testing.assert_close(rest["model.rotary_emb.inv_freq"], reference.model.rotary_emb.inv_freq)


def replicated_buffers(model) -> dict[str, torch.Tensor]:
    module = model.module  # gives the meta-device module CPU tensors holding the current values
    assert not any(t.is_meta for t in (*module.parameters(), *module.buffers()))
    return dict(module.named_buffers())


class Layers(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16, padding_idx=0)
        self.conv = nn.Conv1d(16, 32, 3)
        self.norm = nn.BatchNorm1d(32)
        self.fc = nn.Linear(32, 64)
        self.head = nn.Linear(64, 50)

    def forward(self, ids):
        x = self.norm(self.conv(self.embed(ids).transpose(1, 2))).mean(-1)
        return self.head(F.relu(self.fc(x)))


def test_torch_layers_run_their_reset_parameters():
    smp.init({"sharded_data_parallel_degree": 8})
    with smp.delay_param_initialization():
        module = Layers()
    values = smp.DistributedModel(module).state_dict()
    for name, fan_in in (("conv", 16 * 3), ("fc", 32), ("head", 64)):
        bound = 1 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)) and the bias rule give the same bound
        for kind in ("weight", "bias"):
            tensor = values[f"{name}.{kind}"]
            assert float(tensor.abs().max()) <= bound
            assert float(tensor.abs().max()) > 0.9 * bound
            assert abs(float(tensor.std()) - bound / math.sqrt(3)) < 0.2 * bound, f"{name}.{kind}"
    embedding = values["embed.weight"]
    assert torch.all(embedding[0] == 0)  # padding row zeroed, as nn.Embedding.reset_parameters does
    assert abs(float(embedding[1:].std()) - 1.0) < 0.1
    torch.testing.assert_close(values["norm.weight"], torch.ones(32))
    torch.testing.assert_close(values["norm.bias"], torch.zeros(32))
    torch.testing.assert_close(values["norm.running_mean"], torch.zeros(32))
    torch.testing.assert_close(values["norm.running_var"], torch.ones(32))
    assert int(values["norm.num_batches_tracked"]) == 0


def test_delayed_gpt2_trains_like_torch_from_the_same_values():
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )
    smp.init({"delayed_parameter_initialization": True, "tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2})
    with smp.model_creation():
        module = transformers.AutoModelForCausalLM.from_config(config)
    assert module.transformer.h[0].attn.c_attn.weight.is_meta
    model = smp.DistributedModel(module)
    reference = transformers.AutoModelForCausalLM.from_config(config)
    reference.load_state_dict(model.state_dict())
    assert reference.lm_head.weight is reference.transformer.wte.weight
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    generator = torch.Generator().manual_seed(3)
    data = [(ids, ids) for ids in (torch.randint(0, 64, (4, 16), generator=generator) for _ in range(3))]

    @smp.step
    def step(model, ids):
        loss = model(input_ids=ids, labels=ids)["loss"]
        model.backward(loss)
        return loss

    losses = []
    for ids, _ in data:
        optimizer.zero_grad()
        losses.append(float(step(model, ids).reduce_mean()))
        optimizer.step()

    class LM(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, ids):
            return self.inner(input_ids=ids)["logits"][:, :-1].reshape(-1, 64)

    targets = [(ids, ids[:, 1:].reshape(-1)) for ids, _ in data]
    expected = torch_train(LM(reference), torch.optim.AdamW(reference.parameters(), lr=1e-2), targets)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert losses[-1] < losses[0]


class Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))  # set in __init__ only: lost on the meta device

    def forward(self, x):
        return self.fc(x) * self.scale


def test_a_tensor_without_init_code_is_an_error_naming_it():
    smp.init({})
    with smp.delay_param_initialization():
        module = Custom()
    with pytest.raises(ConfigError, match=r"left 1 tensor\(s\) without values: scale\. .*reset_parameters"):
        smp.DistributedModel(module)

    class WithReset(Custom):
        def reset_parameters(self):
            nn.init.ones_(self.scale)

    with smp.delay_param_initialization():
        module = WithReset()
    torch.testing.assert_close(smp.DistributedModel(module).state_dict()["scale"], torch.ones(4))


def test_a_partly_materialised_model_is_refused():
    smp.init({})
    with smp.delay_param_initialization():
        module = Custom()
    module.fc.to_empty(device="cpu")
    with pytest.raises(ConfigError, match="on the meta device .* and .* with values"):
        smp.DistributedModel(module)
    with pytest.raises(ConversionError, match="meta device"):
        convert(module)


def test_delay_param_initialization_disabled_builds_values():
    with smp.delay_param_initialization(enabled=False):
        assert not nn.Linear(2, 2).weight.is_meta
    smp.init({})  # without the config key, model_creation builds values
    with smp.model_creation():
        assert not nn.Linear(2, 2).weight.is_meta
    smp.init({"delayed_parameter_initialization": True})  # a model built with values outside model_creation
    module = nn.Linear(2, 2)
    torch.testing.assert_close(smp.DistributedModel(module).state_dict()["weight"], module.weight.detach())


class _Compiled(Exception):
    """Stops DistributedModel once its initialisation program is compiled (the model is too big to run here)."""


def test_a_model_bigger_than_this_machine_compiles_to_per_device_shares(monkeypatch):
    smp.init({"sharded_data_parallel_degree": 8})
    config = transformers.LlamaConfig(
        num_hidden_layers=8,
        hidden_size=8192,
        intermediate_size=28672,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=32000,
    )
    with smp.delay_param_initialization():
        module = transformers.AutoModelForCausalLM.from_config(config)
    total = sum(4 * p.numel() for p in module.parameters())  # fp32 bytes
    assert total > os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # more than this machine holds
    captured = {}
    initialisation = delayed_init.initialisation

    def compile_only(*args, **kwargs):
        lowered, _ = initialisation(*args, **kwargs)
        captured["memory"] = lowered.compile().memory_analysis()
        raise _Compiled

    monkeypatch.setattr(delayed_init, "initialisation", compile_only)
    with pytest.raises(_Compiled):
        smp.DistributedModel(module)
    memory = captured["memory"]
    share = total / 8
    assert memory.output_size_in_bytes <= 1.01 * share  # each device's outputs: its shard of every parameter
    assert memory.temp_size_in_bytes <= 0.01 * share  # drawn where they are stored, never gathered
