"""Side outputs: a value sown inside the forward reaches the model's training state, combined over the step.

A kind of side output needs only its ``sow`` call: it passes microbatches, checkpointed regions and the
pipeline with no threading of its own.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import jmp as smp
from jmp.torch_bridge import side_outputs
from jmp.torch_bridge.tensor import unwrap


class Sowing(nn.Module):
    """A linear layer that sows how many of its inputs are positive (summed) and its largest input (max)."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        side_outputs.sow("positive", (unwrap(x) > 0).sum())
        side_outputs.sow("largest", unwrap(x).max(), reduce="max")
        return self.linear(x)


class SowingNet(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        with smp.partition(0):
            self.first = Sowing(width)
        with smp.partition(1):
            self.second = Sowing(width)
            self.head = nn.Linear(width, 3)

    def forward(self, x):
        return self.head(torch.relu(self.second(self.first(x))))


@smp.step
def classify_step(model, x, y):
    loss = F.cross_entropy(model(x), y)
    model.backward(loss)
    return loss


@smp.step
def predict_step(model, x):
    return model(x)


def _expected(net: SowingNet, x: torch.Tensor) -> dict[str, float]:
    with torch.no_grad():
        inner = net.first.linear(x)
    return {"positive": int((x > 0).sum() + (inner > 0).sum()), "largest": float(max(x.max(), inner.max()))}


@pytest.mark.parametrize(
    "config",
    [
        {"microbatches": 1},
        {"microbatches": 4},
        {"microbatches": 4, "checkpointed": True},
        {"microbatches": 4, "pipeline_parallel_degree": 2, "auto_partition": False, "default_partition": 0},
    ],
    ids=["one-microbatch", "microbatches", "checkpointed", "pipeline"],
)
def test_sown_values_are_combined_over_the_step_by_their_reduction(config):
    config = dict(config)
    checkpointed = config.pop("checkpointed", False)
    smp.init(config)
    torch.manual_seed(0)
    net = SowingNet()
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 8, generator=generator), torch.randint(0, 3, (32,), generator=generator)
    expected = _expected(net, x)
    model = smp.DistributedModel(net)
    if checkpointed:
        smp.set_activation_checkpointing(model.module.first)
        smp.set_activation_checkpointing(model.module.second)

    classify_step(model, x, y)
    sown = model.training_state.side_outputs
    assert sown.keys() == {"positive", "largest"}
    assert int(sown["positive"]) == expected["positive"]
    np.testing.assert_allclose(float(sown["largest"]), expected["largest"], rtol=1e-6)
    assert model.dropped_tokens == 0  # no experts: nothing sown under that name

    predict_step(model, x)  # an evaluation step sows as well
    assert int(model.training_state.side_outputs["positive"]) == expected["positive"]


def test_a_name_sown_with_two_reductions_is_refused():
    with side_outputs.collecting(), pytest.raises(ValueError, match="different reductions"):
        side_outputs.sow("count", 1)
        side_outputs.sow("count", 2, reduce="max")


def test_sowing_outside_a_step_is_ignored():
    side_outputs.sow("count", 1)
    with side_outputs.collecting() as sown:
        pass
    assert sown == {}
