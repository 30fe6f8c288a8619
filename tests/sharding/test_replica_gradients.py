"""Data parallelism with microbatches reduces the gradients once per step, after the microbatch loop (DDP's
``no_sync``), with the numbers of PyTorch on the same microbatches."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import jmp as smp
from benchmarks.harness import all_reduce_bytes
from jmp.compiled_step import replica_gradients
from tests.front_end.helpers import named_grads
from tests.helpers import assert_close
from tests.remat.helpers import equations
from tests.sharding.models import causal_lm, lm_step, token_batches

ROWS, MICROBATCHES, SHARDS = 16, 2, 8


class NormedNet(torch.nn.Module):
    """Every kind of row-local call on parameters (convolution, linear, layer norm, a broadcast scale) beside one
    that couples the batch's rows (batch norm's statistics)."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 4, 3)
        self.norm1 = torch.nn.BatchNorm2d(4)
        self.conv2 = torch.nn.Conv2d(4, 8, 3)
        self.norm2 = torch.nn.LayerNorm(8 * 8 * 8)
        self.fc = torch.nn.Linear(8 * 8 * 8, 10)
        self.temperature = torch.nn.Parameter(torch.linspace(0.5, 1.5, 10))

    def forward(self, x):
        x = F.relu(self.norm1(self.conv1(x)))
        x = self.norm2(torch.flatten(F.relu(self.conv2(x)), 1))
        return F.log_softmax(self.fc(x) * self.temperature, dim=1)


@smp.step
def classifier_step(model, images, labels):
    loss = F.nll_loss(model(images), labels)
    model.backward(loss)
    return loss


def _microbatch_rows(rows: int, shards: int) -> list[list[int]]:
    """Under SMP each data-parallel shard splits its own rows: microbatch m takes the m-th run of every shard."""
    per_shard = rows // shards
    run = per_shard // MICROBATCHES
    return [[s * per_shard + m * run + i for s in range(shards) for i in range(run)] for m in range(MICROBATCHES)]


def _loop_all_reduce_bytes(hlo: str, group: int) -> int:
    """Bytes of the all-reduces over groups of ``group`` devices (the data-parallel ones) inside the compiled step's
    while loops (the microbatch loop's body)."""
    return all_reduce_bytes(hlo, group, SHARDS)["in_loop"]


def _parameter_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


@pytest.fixture
def plain_loop(monkeypatch):
    """The step as before: replicated gradients reduced wherever each microbatch's backward makes them."""
    monkeypatch.setattr(replica_gradients, "replicated_axes", lambda model, signature: ())


def test_data_parallel_microbatches_reduce_gradients_after_the_loop_with_torch_numbers():
    torch.manual_seed(0)
    net = NormedNet()
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(ROWS, 1, 12, 12, generator=generator)
    labels = torch.randint(0, 10, (ROWS,), generator=generator)
    losses = []
    for rows in _microbatch_rows(ROWS, SHARDS):  # SMP's loss: the mean over microbatches, batch norm over each
        loss = F.nll_loss(net(images[rows]), labels[rows]) / MICROBATCHES
        loss.backward()
        losses.append(loss.item() * MICROBATCHES)

    smp.init({"microbatches": MICROBATCHES, "ddp": True})
    model = smp.DistributedModel(NormedNet())
    model.load_state_dict(net.state_dict())
    hlo = classifier_step.lower(model, images, labels).compile().as_text()
    # what stays in the loop: batch norm's statistics and the loss
    assert _loop_all_reduce_bytes(hlo, SHARDS) < 0.05 * _parameter_bytes(net)
    out = classifier_step(model, images, labels)
    np.testing.assert_allclose(out.stack().numpy(), losses, rtol=1e-5)
    grads = named_grads(model.grads)
    for name, p in net.named_parameters():  # conv1's bias, which batch norm cancels, has float noise for gradient
        assert_close(grads[name], p.grad, 1e-5, floor=1e-2)


def test_without_replica_gradients_the_loop_reduces_every_microbatch(plain_loop):
    """What the per-replica copies remove: the same step reduces all its gradients inside the loop."""
    smp.init({"microbatches": MICROBATCHES, "ddp": True})
    net = NormedNet()
    model = smp.DistributedModel(net)
    images, labels = torch.randn(ROWS, 1, 12, 12), torch.randint(0, 10, (ROWS,))
    hlo = classifier_step.lower(model, images, labels).compile().as_text()
    assert _loop_all_reduce_bytes(hlo, SHARDS) >= _parameter_bytes(net)


@pytest.mark.parametrize(
    "name, layers, degrees, checkpointed",
    [
        ("gpt2", 2, {}, True),
        ("llama", 2, {"tensor_parallel_degree": 2}, False),
        ("llama", 4, {"scan_layers": True}, True),
    ],
    ids=["gpt2-dp8-first-layer-checkpointed", "llama-dp4xtp2", "llama-dp8-scanned-stacked-layers"],
)
def test_language_model_reduces_gradients_after_the_loop_with_torch_numbers(name, layers, degrees, checkpointed):
    """GPT-2's ``Conv1D`` (``addmm``), tied embedding and head, layer norms, a checkpointed layer beside a plain one;
    Llama's RMS norms (a parameter times the rows) under tensor parallelism; Llama's layers as one scan over
    weights stored stacked, each layer checkpointed: per replica, as PyTorch computes them."""
    reference = causal_lm(name, layers=layers)
    ids = token_batches(1, batch=ROWS, length=16)[0]
    shards = SHARDS // degrees.get("tensor_parallel_degree", 1)
    for rows in _microbatch_rows(ids.shape[0], shards):
        (reference(input_ids=ids[rows], labels=ids[rows]).loss / MICROBATCHES).backward()

    smp.init({"microbatches": MICROBATCHES, "ddp": True, **degrees})
    model = smp.DistributedModel(causal_lm(name, layers=layers))
    if checkpointed:
        stack = model.module.transformer.h if name == "gpt2" else model.module.model.layers
        for layer in stack[: 1 if name == "gpt2" else layers]:
            smp.set_activation_checkpointing(layer)
    model.load_state_dict(reference.state_dict())
    if degrees.get("scan_layers"):  # the microbatch loop and the layers' scan, forward and backward
        assert Counter(e.primitive.name for e in equations(lm_step.trace(model, ids).jaxpr))["scan"] >= 3
    hlo = lm_step.lower(model, ids).compile().as_text()
    # what stays: the position embedding's gradient (its lookup's ids are one row for the whole batch) and the loss
    assert _loop_all_reduce_bytes(hlo, shards) < 0.02 * _parameter_bytes(reference)
    lm_step(model, ids)
    grads = named_grads(model.grads)
    for param_name, p in reference.named_parameters():
        assert_close(grads[param_name], p.grad, 1e-5, floor=1e-6)


class SequenceFirst(torch.nn.Module):
    """Layers on [sequence, batch, features], as ``batch_first=False`` transformers run them."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 10)

    def forward(self, x):
        h = self.norm(F.relu(self.up(x.transpose(0, 1))))  # [16 positions, rows, 16]
        return F.log_softmax(self.head(h.mean(0)), dim=1)


def test_rows_split_where_the_batch_is_not_first_move_nothing():
    """A layer's input [sequence, batch, ...] is split over the replicas along its batch, not its first dimension
    (which would move every row between devices at each call)."""
    torch.manual_seed(0)
    net = SequenceFirst()
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(ROWS, 16, 8, generator=generator)
    labels = torch.randint(0, 10, (ROWS,), generator=generator)
    for rows in _microbatch_rows(ROWS, SHARDS):
        (F.nll_loss(net(inputs[rows]), labels[rows]) / MICROBATCHES).backward()

    smp.init({"microbatches": MICROBATCHES, "ddp": True})
    model = smp.DistributedModel(SequenceFirst())
    model.load_state_dict(net.state_dict())
    hlo = classifier_step.lower(model, inputs, labels).compile().as_text()
    assert not re.search(r" all-to-all(?:-start)?\(", hlo)
    assert _loop_all_reduce_bytes(hlo, SHARDS) < 0.05 * _parameter_bytes(net)
    classifier_step(model, inputs, labels)
    grads = named_grads(model.grads)
    for name, p in net.named_parameters():
        assert_close(grads[name], p.grad, 1e-5, floor=1e-6)
