"""Expert parallelism on a top-k MoE written in plain torch: equal to PyTorch, and dropped tokens reported."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import jmp as smp
from tests.front_end.helpers import named_grads
from tests.sharding.models import MoENet


@smp.step
def classify_step(model, x, y):
    loss = F.cross_entropy(model(x), y)
    model.backward(loss)
    return loss


def _batch():
    generator = torch.Generator().manual_seed(3)
    return torch.randn(16, 6, 12, generator=generator), torch.randint(0, 5, (16,), generator=generator)


def _torch_loss_and_grads(net):
    x, y = _batch()
    net.zero_grad()
    loss = F.cross_entropy(net(x), y)
    loss.backward()
    return loss.item(), {name: p.grad.numpy() for name, p in net.named_parameters()}


def _jmp_loss_and_grads(net, config):
    smp.init(config)
    model = smp.DistributedModel(net)
    loss = classify_step(model, *_batch()).reduce_mean()
    jax.effects_barrier()  # let the step's dropped-token report reach the log
    return float(loss), named_grads(model.grads), model


@pytest.fixture(scope="module")
def net():
    torch.manual_seed(0)
    return MoENet()


@pytest.mark.parametrize("config", [{"expert_parallel_degree": 4}, {"expert_parallel_degree": 8}])
def test_expert_parallel_plain_torch_moe_equals_pytorch(net, config):
    expected_loss, expected = _torch_loss_and_grads(net)
    loss, grads, model = _jmp_loss_and_grads(net, config)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    for name, value in expected.items():
        error = np.linalg.norm(grads[name] - value) / np.linalg.norm(value)
        assert error <= 1e-5, f"{name}: relative difference {error:.2e}"
    assert model.dropped_tokens == 0
    experts_weight = model.params["moe"]["experts"]["w_in"][...]
    assert experts_weight.addressable_shards[0].data.shape[0] == 8 // config["expert_parallel_degree"]


def test_a_small_capacity_drops_tokens_and_reports_how_many(net, caplog):
    with caplog.at_level(logging.WARNING, logger="jmp"):
        loss, _, model = _jmp_loss_and_grads(net, {"expert_parallel_degree": 4, "expert_capacity_factor": 0.5})
    assert model.dropped_tokens == _expected_drops(net, shards=8, devices=4, slots=3)
    assert f"dropped {model.dropped_tokens} token-expert assignments" in caplog.text
    expected_loss, _ = _torch_loss_and_grads(net)
    assert loss != pytest.approx(expected_loss, rel=1e-5)  # dropping changes the result


def _expected_drops(net, shards: int, devices: int, slots: int) -> int:
    """Rows beyond ``slots`` per (data shard, expert device), from torch's own routing.

    16 sequences x 6 tokens x top-2 = 192 rows over 8 data shards: 24 rows each;
    factor 0.5 x 24 rows / 4 expert devices = 3 slots per device pair.
    """
    x, _ = _batch()
    with torch.no_grad():
        tokens = net.embed(x).reshape(-1, 32)
        _, index = net.moe.router(tokens).softmax(-1).topk(2, dim=-1)
    per_shard = (index // (8 // devices)).reshape(shards, -1)  # expert -> its device; rows of each data shard
    counts = torch.stack([torch.bincount(row, minlength=devices) for row in per_shard])
    return int((counts - slots).clamp(min=0).sum())


def test_a_capacity_that_fits_every_token_drops_none(net):
    expected_loss, _ = _torch_loss_and_grads(net)
    loss, _, model = _jmp_loss_and_grads(net, {"expert_parallel_degree": 4, "expert_capacity_factor": 4.0})
    assert model.dropped_tokens == 0
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
