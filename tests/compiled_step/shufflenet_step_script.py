"""One train-mode step of torchvision's ShuffleNetV2 (vendored) under ``@smp.step`` on one device, against float64
PyTorch; prints the largest gradient error as JSON. Run by ``test_cpu_convolutions.py`` in a process of its own, with
XLA:CPU's optimisation passes on (the suite turns them off, and the wrong gradients came only with them on)."""

from __future__ import annotations

import copy
import json

import numpy as np
import torch
import torch.nn.functional as F

import jmp as smp
from tests.front_end.helpers import named_grads
from tests.vendored.torchvision.shufflenetv2 import ShuffleNetV2


@smp.step
def train_step(model, images, labels):
    loss = F.cross_entropy(model(images), labels)
    model.backward(loss)
    return loss


def largest_gradient_error() -> tuple[float, str]:
    """(error, parameter name): each gradient against float64 PyTorch's, relative to the tensor's largest entry
    floored at 1e-3 of the model's largest gradient entry."""
    torch.manual_seed(0)
    net = ShuffleNetV2([4, 8, 4], [24, 48, 96, 192, 1024], num_classes=10).train()  # shufflenet_v2_x0_5
    generator = torch.Generator().manual_seed(1)
    images, labels = torch.randn(8, 3, 64, 64, generator=generator), torch.randint(0, 10, (8,), generator=generator)
    reference = copy.deepcopy(net).double()
    F.cross_entropy(reference(images.double()), labels).backward()
    smp.init({"scan_layers": False})
    model = smp.DistributedModel(net)
    train_step(model, images, labels)
    grads = named_grads(model.grads)
    expected = {name: p.grad.numpy() for name, p in reference.named_parameters()}
    largest = max(np.abs(g).max() for g in expected.values())
    errors = {
        name: float(np.abs(np.asarray(grads[name]) - g).max() / max(np.abs(g).max(), 1e-3 * largest))
        for name, g in expected.items()
    }
    name = max(errors, key=errors.get)
    return errors[name], name


if __name__ == "__main__":
    error, name = largest_gradient_error()
    print(json.dumps({"error": error, "parameter": name}))
