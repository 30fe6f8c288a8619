"""The step program's XLA:CPU options: convolutions on XLA's own (Eigen) path, dots still through YNNPACK, and the
step's gradients torch's (at XLA's real kernels: tests/compiled_step/test_cnn_numerics.py)."""

from __future__ import annotations

import re

import jax
import torch
import torch.nn.functional as F

import jmp as smp
from tests.front_end.helpers import named_grads
from tests.helpers import PooledNet, assert_close, classifier_step


def _library_computations(hlo: str) -> dict[str, str]:
    """The bodies of the computations XLA:CPU hands to YNNPACK, by name."""
    called = set(re.findall(r'calls=%?([\w.\-]+), .*"kind":"__ynn_fusion"', hlo))
    bodies = re.findall(r"^%?([\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo, re.MULTILINE | re.DOTALL)
    return {name: body for name, body in bodies if name in called}


def test_cpu_step_keeps_convolutions_out_of_ynnpack_and_dots_in_and_matches_torch():
    torch.manual_seed(0)
    net = PooledNet()
    images = torch.randn(
        64, 1, 12, 12, generator=torch.Generator().manual_seed(1)
    )  # YNNPACK takes convolutions this big
    labels = torch.arange(64) % 10
    F.nll_loss(net(images), labels).backward()
    smp.init({"microbatches": 1}, devices=jax.devices()[:1])
    model = smp.DistributedModel(PooledNet())
    model.load_state_dict(net.state_dict())

    hlo = classifier_step.lower(model, images, labels).compile().as_text()
    library = _library_computations(hlo)
    assert len(re.findall(r" convolution\(", hlo)) >= 5  # two forward, two filter gradients, one input gradient
    assert not [name for name, body in library.items() if " convolution(" in body], library
    assert any(" dot(" in body for body in library.values()), "the linear layer's dots left YNNPACK too"

    classifier_step(model, images, labels)
    grads = named_grads(model.grads)
    for name, p in net.named_parameters():
        assert_close(grads[name], p.grad, 1e-5, floor=1e-6)
