"""SMP's tensor-parallel API: options of ``tensor_parallelism``, ``tp_register``, and ``smp.nn``'s layers."""

from __future__ import annotations

import copy
import logging

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from jax.sharding import PartitionSpec as P
from torch import nn

import jmp as smp
from jmp.runtime import notices
from jmp.sharding import tensor_parallel
from tests.front_end.helpers import named_grads


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch):
    monkeypatch.setattr(tensor_parallel, "_REGISTERED", {})
    monkeypatch.setattr(notices, "_SAID", set())


class MyLinear(nn.Module):
    """A user's linear layer with its own parameter names: weight ``w`` [out, in], bias ``b``."""

    def __init__(self, features_in: int, features_out: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(features_out, features_in) * 0.1)
        self.b = nn.Parameter(torch.zeros(features_out))

    def forward(self, x):
        return x @ self.w.t() + self.b


class MyTable(nn.Module):
    def __init__(self, vocabulary: int, dim: int):
        super().__init__()
        self.table = nn.Parameter(torch.randn(vocabulary, dim))

    def forward(self, ids):
        return self.table[ids]


def _specs(module: nn.Module, degree: int = 2) -> dict[str, P]:
    smp.init({"tensor_parallel_degree": degree})
    return smp.DistributedModel(module).layout.specs


def test_tensor_parallel_options_are_accepted_and_logged_once(caplog):
    caplog.set_level(logging.INFO, logger="jmp")
    with smp.tensor_parallelism(enabled=True, fused_softmax=True, attention_in_fp32=False):
        first = nn.Linear(4, 4)
    with smp.tensor_parallelism(fused_softmax=True, distribute_embedding=True):
        nn.Linear(4, 4)
    smp.set_tensor_parallelism(first, True, fused_bias_gelu=True, fused_softmax=False)
    lines = [r.getMessage() for r in caplog.records if "no effect on jmp's split" in r.getMessage()]
    assert len(lines) == 3
    assert sum("fused_softmax" in line for line in lines) == 1  # each option once per process
    assert "attention_in_fp32" in lines[0] and "distribute_embedding" in lines[1] and "fused_bias_gelu" in lines[2]


def test_a_registered_class_splits_like_distributed_linear_whatever_its_names():
    smp.tp_register_with_module(MyLinear, smp.nn.DistributedLinear)
    specs = _specs(nn.Sequential(MyLinear(8, 16), nn.GELU(), MyLinear(16, 6)))
    assert specs["0.w"] == P("tp", None) and specs["0.b"] == P("tp")  # first of a chained pair: column
    assert specs["2.w"] == P(None, "tp") and specs["2.b"] == P(None)  # second: row


def test_a_lone_registered_linear_is_column_parallel_and_the_decorator_registers():
    @smp.tp_register(smp.nn.DistributedLinear)
    class Projection(MyLinear):
        pass

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = Projection(8, 16)
            self.other = MyLinear(16, 8)  # not registered: whole

        def forward(self, x):
            return self.other(self.proj(x))

    specs = _specs(Net())
    assert specs["proj.w"] == P("tp", None) and specs["proj.b"] == P("tp")
    assert specs["other.w"] == P(None, None)


def test_a_registered_table_splits_over_the_vocabulary():
    smp.tp_register_with_module(MyTable, smp.nn.DistributedEmbedding)
    assert _specs(MyTable(10, 4))["table"] == P("tp", None)


def test_registered_modules_split_only_where_tensor_parallelism_is_on():
    smp.tp_register_with_module(MyLinear, smp.nn.DistributedLinear)
    with smp.tensor_parallelism():
        split = MyLinear(8, 16)
    model = nn.Sequential(split, nn.GELU(), nn.Linear(16, 3), MyLinear(3, 5))
    specs = _specs(model)
    assert specs["0.w"] == P("tp", None)
    assert specs["3.w"] == P(None, None)


def test_unknown_dist_module_and_hooks_are_errors():
    with pytest.raises(smp.ArgumentTypeError, match="DistributedLinear, smp.nn.DistributedEmbedding"):
        smp.tp_register_with_module(MyLinear, nn.Linear)
    with pytest.raises(smp.ArgumentTypeError, match="nn.Module class"):
        smp.tp_register_with_module(MyLinear(2, 2), smp.nn.DistributedLinear)
    with pytest.raises(smp.ArgumentTypeError, match="forward_hook.*own forward"):
        smp.tp_register(smp.nn.DistributedLinear, forward_hook=lambda *a: a)(MyLinear)
    assert MyLinear not in tensor_parallel._REGISTERED


def test_smp_nn_layers_take_smps_arguments():
    linear = smp.nn.DistributedLinear(4, 6)
    embedding = smp.nn.DistributedEmbedding(10, 4, padding_idx=0, initializer_range=0.02, _skip_allgather=True)
    norm = smp.nn.FusedLayerNorm(4, eps=1e-6, elementwise_affine=True)
    assert isinstance(linear, nn.Linear) and linear.weight.shape == (6, 4)
    assert isinstance(embedding, nn.Embedding) and float(embedding.weight.detach().std()) < 0.05
    assert float(embedding.weight[0].detach().abs().sum()) == 0.0
    assert isinstance(norm, nn.LayerNorm) and norm.eps == 1e-6


class SmpNet(nn.Module):
    def __init__(self, vocabulary=16, dim=8, hidden=32):
        super().__init__()
        self.embed = smp.nn.DistributedEmbedding(vocabulary, dim)
        self.norm = smp.nn.FusedLayerNorm(dim)
        self.up = smp.nn.DistributedLinear(dim, hidden)
        self.down = smp.nn.DistributedLinear(hidden, dim)
        self.head = smp.nn.DistributedLinear(dim, vocabulary, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.down(F.gelu(self.up(self.norm(h))))
        return self.head(h)


@smp.step
def _lm_step(model, ids, target):
    logits = model(ids)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    model.backward(loss)
    return loss


def test_a_model_of_smp_nn_layers_at_tp2_matches_torch():
    module = SmpNet()
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 16, (8, 6), generator=generator)
    target = torch.randint(0, 16, (8, 6), generator=generator)

    reference = copy.deepcopy(module)
    logits = reference(ids)
    expected_loss = F.cross_entropy(logits.reshape(-1, 16), target.reshape(-1))
    expected_loss.backward()
    expected = {name: p.grad.numpy() for name, p in reference.named_parameters()}

    smp.init({"tensor_parallel_degree": 2})
    model = smp.DistributedModel(module)
    specs = model.layout.specs
    assert specs["embed.weight"] == P("tp", None)
    assert specs["up.weight"] == P("tp", None) and specs["up.bias"] == P("tp")
    assert specs["down.weight"] == P(None, "tp") and specs["down.bias"] == P(None)
    assert specs["head.weight"] == P("tp", None)  # a lone DistributedLinear: column-parallel
    assert specs["norm.weight"] == P(None)
    arrays = {
        ".".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(model.params)[0]
    }
    assert arrays["up.weight"].sharding.shard_shape((32, 8)) == (16, 8)  # each device holds its half
    assert arrays["embed.weight"].sharding.shard_shape((16, 8)) == (8, 8)

    loss = float(_lm_step(model, ids, target).reduce_mean())
    np.testing.assert_allclose(loss, expected_loss.item(), rtol=1e-5)
    grads = named_grads(model.grads)
    assert grads.keys() == expected.keys()
    for key, value in grads.items():
        error = np.linalg.norm(value - expected[key]) / max(np.linalg.norm(expected[key]), 1e-12)
        assert error <= 1e-5, f"{key}: relative difference {error:.2e}"


def _lm_head() -> nn.Module:
    return smp.nn.DistributedTransformerLMHead(
        num_layers=2, num_attention_heads=4, attention_head_size=4, hidden_size=16, intermediate_size=32,
        vocab_size=32, num_positions=8, attention_dropout_prob=0.0, hidden_dropout_prob=0.0, causal_mask_size=8,
        use_normal_initialization=True, pre_layernorm=True, post_layernorm=False,
    )  # fmt: skip


@smp.step
def _masked_lm_step(model, ids, mask, target):
    logits = model((ids, mask))
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    model.backward(loss)
    return loss


def test_distributed_transformer_lm_head_at_tp2_matches_torch_and_splits_by_heads():
    module = _lm_head()
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 32, (4, 8), generator=generator)
    target = torch.randint(0, 32, (4, 8), generator=generator)
    mask = torch.ones(4, 8)
    mask[0, 6:] = 0  # padding at the end of one sequence

    reference = copy.deepcopy(module)
    expected_loss = F.cross_entropy(reference((ids, mask)).reshape(-1, 32), target.reshape(-1))
    expected_loss.backward()
    expected = {name: p.grad.numpy() for name, p in reference.named_parameters()}

    smp.init({"tensor_parallel_degree": 2})
    model = smp.DistributedModel(module)
    specs = model.layout.specs
    layer = "transformer.layers.0."
    assert specs["word_embeddings.weight"] == P("tp", None)
    assert specs["position_embeddings.weight"] == P(None, None)
    for name in ("query", "key", "value"):
        assert specs[f"{layer}attention.{name}.weight"] == P("tp", None)
    assert specs[f"{layer}attention.out_proj.weight"] == P(None, "tp")
    assert specs[f"{layer}output.fc1.weight"] == P("tp", None)
    assert specs[f"{layer}output.fc2.weight"] == P(None, "tp")

    loss = float(_masked_lm_step(model, ids, mask, target).reduce_mean())
    np.testing.assert_allclose(loss, expected_loss.item(), rtol=1e-5)
    grads = named_grads(model.grads)
    assert grads.keys() == expected.keys()
    scale = max(np.linalg.norm(g) for g in expected.values())
    for key, value in grads.items():  # key biases get ~0 gradients (softmax ignores them): compare to the scale
        error = np.linalg.norm(value - expected[key]) / max(np.linalg.norm(expected[key]), 1e-3 * scale)
        assert error <= 1e-5, f"{key}: relative difference {error:.2e}"


def test_distributed_transformer_layer_takes_and_returns_hidden_and_mask():
    layer = smp.nn.DistributedTransformerLayer(
        num_attention_heads=2, attention_head_size=4, hidden_size=8, intermediate_size=16
    )
    hidden = torch.randn(2, 3, 8)
    out, mask = layer((hidden, None))
    assert out.shape == hidden.shape and mask is None
    with pytest.raises(smp.ArgumentTypeError, match="cross-attention"):
        smp.nn.DistributedAttentionLayer(cross_attention=True)
