"""``smp.set_partition`` assigns a module with all its submodules, as SMP's (``recurse=True``); a later call on a
submodule overrides its parent's."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

import jmp as smp
from jmp.runtime import notices
from tests.pipeline.models import nll_step
from tests.pipeline.test_pipeline import assert_grads_match
from tests.sharding.models import causal_lm, lm_step, token_batches

MANUAL = {"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False, "default_partition": 0}


def test_the_gpt2_scripts_manual_partition_puts_whole_layers_on_their_stages(caplog):
    """AWS's gpt2 train.py: ``smp.set_partition(layer, stage)`` per layer, then each layer checkpointed."""
    smp.init(MANUAL)
    net, reference = causal_lm("gpt2", layers=2), causal_lm("gpt2", layers=2)
    ids = token_batches(1)[0]
    reference(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    model = smp.DistributedModel(net)
    for i, layer in enumerate(model.get_module().transformer.h.children()):
        smp.set_partition(layer, [0, 1][i])
        smp.set_activation_checkpointing(layer)
    with caplog.at_level(logging.WARNING, logger="jmp"):
        lm_step(model, ids)
    assert not any("cannot span stages" in r.getMessage() for r in caplog.records)
    stages = model.pipeline.layout.stages
    assert {stages[n] for n in stages if n.startswith("transformer.h.0.")} == {(0,)}
    assert {stages[n] for n in stages if n.startswith("transformer.h.1.")} == {(1,)}
    assert_grads_match(model, reference)


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class Root(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = Block(16)
        self.body = Block(16)

    def forward(self, x):
        return F.log_softmax(self.body(self.stem(x)), dim=1)


def test_a_later_call_on_a_submodule_overrides_its_parents_assignment():
    smp.init(MANUAL)
    net = Root()
    reference = Root()
    reference.load_state_dict(net.state_dict())
    data, target = torch.randn(8, 16), torch.randint(0, 16, (8,))
    F.nll_loss(reference(data), target).backward()
    model = smp.DistributedModel(net)
    smp.set_partition(model.module, 1)  # everything on stage 1 ...
    smp.set_partition(model.module.stem, 0)  # ... but the stem, with its layers
    nll_step(model, data, target)
    stages = model.pipeline.layout.stages
    assert {n: stages[n] for n in stages} == {
        **{f"stem.{layer}.{p}": (0,) for layer in ("fc1", "fc2") for p in ("weight", "bias")},
        **{f"body.{layer}.{p}": (1,) for layer in ("fc1", "fc2") for p in ("weight", "bias")},
    }
    assert_grads_match(model, reference)


class TwoHeads(nn.Module):
    """A head that only some calls use (an auxiliary loss's), on the last stage."""

    def __init__(self):
        super().__init__()
        with smp.partition(0):
            self.body = nn.Linear(16, 16)
        with smp.partition(1):
            self.head = nn.Linear(16, 4)
            self.aux = nn.Linear(16, 4)

    def forward(self, x, aux=True):
        hidden = torch.tanh(self.body(x))
        return F.log_softmax(self.head(hidden) + (self.aux(hidden) if aux else 0), dim=1)


@smp.step
def without_aux_step(model, data, target):
    loss = F.nll_loss(model(data, aux=False), target)
    model.backward(loss)
    return loss


def test_a_later_step_function_may_leave_parameters_of_the_cut_unread():
    """The cut is made by the first step function; a later one that does not read the auxiliary head trains the
    rest as torch does (it was refused: an unread parameter counted as read on stage 0)."""
    smp.init(MANUAL)
    net, reference = TwoHeads(), TwoHeads()
    reference.load_state_dict(net.state_dict())
    data, target = torch.randn(8, 16), torch.randint(0, 4, (8,))
    model = smp.DistributedModel(net)
    nll_step(model, data, target)
    assert model.pipeline.layout.stages["aux.weight"] == (1,)
    without_aux_step(model, data, target)
    for aux in (True, False):  # no zero_grad between the steps: the gradients add up, as torch's do
        F.nll_loss(reference(data, aux=aux), target).backward()
    assert_grads_match(model, reference)


class TwoStages(nn.Module):
    """Linear layers (widths in order, tanh between) on stage 0, then on stage 1, then a head of 10 classes."""

    def __init__(self, stage0: list[int], stage1: list[int]):
        super().__init__()
        with smp.partition(0):
            self.first = nn.Sequential(*[nn.Linear(a, b) for a, b in zip(stage0, stage0[1:])])
        with smp.partition(1):
            self.second = nn.Sequential(*[nn.Linear(a, b) for a, b in zip(stage1, stage1[1:])])

    def forward(self, x):
        for layer in [*self.first, *self.second]:
            x = torch.tanh(layer(x))
        return F.log_softmax(x, dim=1)


def _uneven_warnings(records) -> list[str]:
    return [r.getMessage() for r in records if r.getMessage().startswith("Pipeline stages of uneven size")]


def _steps(stage0: list[int], stage1: list[int], models: int = 1) -> None:
    x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
    for _ in range(models):
        nll_step(smp.DistributedModel(TwoStages(stage0, stage1)), x, y)


def test_stages_of_uneven_size_warn_once_with_what_each_device_holds(caplog, monkeypatch):
    """One program runs every stage, so each device stores the largest stage's row: said once, with the bytes.
    Stage 0 holds (16 x 16 + 16) x 4 = 1,088 bytes; stage 1 (8,704 + 262,656 + 5,130) x 4 = 1,105,960 bytes."""
    monkeypatch.setattr(notices, "_SAID", set())
    smp.init(MANUAL)
    with caplog.at_level(logging.WARNING, logger="jmp"):
        _steps([16, 16], [16, 512, 512, 10], models=2)  # a second model of the same layout says nothing new
    (message,) = _uneven_warnings(caplog.records)
    assert "a device of each stage holds 1 / 1080 KiB" in message
    assert "every device stores 1080 KiB" in message and "move modules between smp.partition blocks" in message


def test_stages_of_similar_size_say_nothing(caplog):
    smp.init(MANUAL)
    with caplog.at_level(logging.WARNING, logger="jmp"):
        _steps([16, 512, 512], [512, 512, 10])  # 271,360 and 267,786 parameters
    assert not _uneven_warnings(caplog.records)


def test_an_automatic_cut_that_cannot_even_the_stages_suggests_balancing_bytes(caplog, monkeypatch):
    """The automatic cut goes between module calls: a 512 x 1024 layer beside small ones leaves a stage small."""
    monkeypatch.setattr(notices, "_SAID", set())
    smp.init({**MANUAL, "auto_partition": True})
    with caplog.at_level(logging.WARNING, logger="jmp"):
        _steps([16, 16, 512], [512, 1024, 10])
    (message,) = _uneven_warnings(caplog.records)
    assert "(automatic partition)" in message and "set optimize='memory'" in message
