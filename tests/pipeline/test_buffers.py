"""Buffers the forward updates pass from microbatch to microbatch in order, with and without the pipeline.

PyTorch runs the microbatches one after the other in train mode; the references below do the same on
the rows jmp puts in each microbatch (an equal slice of every data shard).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import jmp as smp
from jmp.torch_bridge import torch_name
from tests.pipeline.models import Dropping, NormNet, RunningCenter, nll_step, predict

MICROBATCHES, SHARDS, ROWS = 4, 4, 32


def batch():
    generator = torch.Generator().manual_seed(5)
    return torch.randn(ROWS, 16, generator=generator) * 3 + 1, torch.randint(0, 4, (ROWS,), generator=generator)


def microbatch_rows() -> list[list[int]]:
    """The batch rows of each microbatch as jmp splits a batch over ``SHARDS`` data shards."""
    per_shard, per = ROWS // SHARDS, ROWS // (SHARDS * MICROBATCHES)
    return [[k * per_shard + m * per + j for k in range(SHARDS) for j in range(per)] for m in range(MICROBATCHES)]


def torch_step(net: nn.Module, data, target) -> None:
    """One training step of ``net`` in train mode, microbatch by microbatch, gradients averaged."""
    net.train()
    for rows in microbatch_rows():
        (F.nll_loss(net(data[rows]), target[rows]) / MICROBATCHES).backward()


def jmp_step(net: nn.Module, data, target, pp: int):
    # pp=1 gets tensor_parallel_degree 2 (nothing is split over it): dp is then 4 at both degrees, so the
    # microbatches hold the same rows
    degrees = {"pipeline_parallel_degree": 2} if pp == 2 else {"tensor_parallel_degree": 2}
    smp.init(degrees | {"microbatches": MICROBATCHES, "auto_partition": False, "default_partition": 0})
    model = smp.DistributedModel(net)
    nll_step(model, data, target)
    return model


def assert_state_matches(model, reference: nn.Module) -> None:
    trained = model.state_dict()
    for name, value in reference.state_dict().items():
        np.testing.assert_allclose(trained[name].numpy(), value.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
    grads = {torch_name(path): np.asarray(g) for path, g in jax.tree_util.tree_leaves_with_path(model.grads)}
    for name, parameter in reference.named_parameters():
        expected = parameter.grad.numpy()
        # atol: under batch norm the first bias gets no gradient, only rounding noise
        np.testing.assert_allclose(grads[name], expected, rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("norm_stage", [0, 1])
def test_batch_norm_statistics_follow_the_microbatches_in_order(norm_stage):
    data, target = batch()
    net = NormNet(norm_stage)
    reference = NormNet(norm_stage)
    reference.load_state_dict(net.state_dict())
    single = NormNet(norm_stage)
    single.load_state_dict(net.state_dict())
    torch_step(reference, data, target)

    pipelined = jmp_step(net, data, target, pp=2)
    assert pipelined.state_dict()["norm.num_batches_tracked"].item() == MICROBATCHES
    assert_state_matches(pipelined, reference)
    unpipelined = jmp_step(single, data, target, pp=1)
    for name in ("norm.running_mean", "norm.running_var", "norm.num_batches_tracked"):
        # atol: a running mean near 0 (7e-4 here) of values around 1 carries float32 roundings of ~1e-8
        np.testing.assert_allclose(
            pipelined.state_dict()[name].numpy(),
            unpipelined.state_dict()[name].numpy(),
            rtol=1e-5,
            atol=1e-7,
            err_msg=name,
        )


def test_the_backward_sees_the_buffers_its_forward_saw():
    # stage 0 runs up to three forwards before its first backward: the buffer has moved on by then
    data, target = batch()
    net = NormNet(0, RunningCenter)
    reference = NormNet(0, RunningCenter)
    reference.load_state_dict(net.state_dict())
    torch_step(reference, data, target)
    assert_state_matches(jmp_step(net, data, target, pp=2), reference)


def test_a_buffer_read_on_another_stage_than_the_one_updating_it_is_refused():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            with smp.partition(0):
                self.fc1 = nn.Linear(16, 32)
            with smp.partition(1):
                self.fc2 = nn.Linear(32, 4)
            self.register_buffer("scale", torch.ones(()))

        def forward(self, x):
            out = F.log_softmax(self.fc2(self.fc1(x) * self.scale), dim=1)  # read on stage 0
            self.scale.mul_(0.9)  # after fc2: stage 1
            return out

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False, "default_partition": 0})
    model = smp.DistributedModel(Scaled())
    with pytest.raises(smp.PipelineError, match=r"buffer 'scale' is updated on pipeline stage 1 but also read on"):
        nll_step(model, *batch())


def test_dropout_on_every_stage_draws_anew_for_each_microbatch():
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False, "default_partition": 0})
    model = smp.DistributedModel(Dropping())
    data = torch.randn(1, 16).expand(ROWS // 2, 16)  # the same row everywhere: only the masks differ
    first, second = (np.asarray(o) for o in predict(model, data).outputs)
    assert not np.allclose(first, second)
    again = np.asarray(predict(model, data).outputs[0])
    assert not np.allclose(first, again)  # the stream moved on between steps
