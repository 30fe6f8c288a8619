"""A step whose forward needs concrete values (data-dependent shapes and branches) runs op by op and trains as
PyTorch does: the fallback of ``jmp.compiled_step.uncompiled``."""

import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import jmp as smp
from jmp.compiled_step import segments, uncompiled
from jmp.errors import StepError, TracedControlFlowError


class LabelledRowsClassifier(nn.Module):
    """What BART-style and DeBERTa classifiers do around their heads: a check that every row has as many end
    tokens (``unique_consecutive``), the labelled rows kept with ``nonzero``, a Python list of the kept rows."""

    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(8, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x, labels):
        ends = (x == 0).sum(-1)
        if torch.unique_consecutive(ends).numel() > 1:
            raise ValueError("All examples must have the same number of end tokens.")
        logits = self.head(torch.tanh(self.hidden(x)))
        index = (labels >= 0).nonzero()
        self.kept_rows = index.view(-1).tolist()
        kept = torch.gather(logits, 0, index.expand(index.size(0), logits.size(1)))
        return F.cross_entropy(kept, torch.gather(labels, 0, index.view(-1))), logits


@smp.step
def train_step(model, x, labels):
    loss, logits = model(x, labels)
    model.backward(loss)
    return loss, logits


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    out = []
    for index in range(count):
        x = torch.randn(16, 8, generator=generator)
        x[:, -1] = 0.0
        labels = torch.randint(0, 3, (16,), generator=generator)
        labels[index::3] = -100  # unlabelled rows, a different number in each microbatch
        out.append((x, labels))
    return out


def test_a_step_with_data_dependent_shapes_trains_as_pytorch_over_microbatches(caplog):
    """Two microbatches x 8 data-parallel devices, three AdamW steps: every loss, the logits and the weights equal
    PyTorch's computing the same microbatches and averaging their gradients; one notice names the call."""
    module = LabelledRowsClassifier()
    reference = LabelledRowsClassifier()
    reference.load_state_dict(module.state_dict())
    smp.init({"microbatches": 2})
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.05))
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05)
    with caplog.at_level(logging.WARNING, logger="jmp"):
        for x, labels in _batches(3):
            optimizer.zero_grad()
            loss, logits = train_step(model, x, labels)
            optimizer.step()
            reference_optimizer.zero_grad()
            # each microbatch takes one row of each of the 8 data shards: the even rows, then the odd ones
            expected = [reference(x[half::2], labels[half::2]) for half in (0, 1)]
            (sum(loss for loss, _ in expected) / 2).backward()
            reference_optimizer.step()
            np.testing.assert_allclose(
                [float(v) for v in loss.outputs], [float(e.detach()) for e, _ in expected], rtol=1e-5
            )
            np.testing.assert_allclose(logits.outputs[1].numpy(), expected[1][1].detach().numpy(), rtol=1e-5, atol=1e-6)
    for name, value in reference.state_dict().items():
        np.testing.assert_allclose(model.state_dict()[name].numpy(), value.numpy(), rtol=1e-5, atol=1e-6)
    notices = [r.getMessage() for r in caplog.records if "op by op" in r.getMessage()]
    assert len(notices) == 1 and "unique_consecutive" in notices[0] and "test_uncompiled_fallback.py" in notices[0]
    with pytest.raises(StepError, match="runs op by op"):
        train_step.lower(model, *_batches(1)[0])


def test_the_models_own_checks_still_raise_on_bad_data():
    smp.init()
    model = smp.DistributedModel(LabelledRowsClassifier())
    x, labels = _batches(1)[0]
    x[3, -1] = 1.0  # one row without its end token
    with pytest.raises(ValueError, match="same number of end tokens"):
        train_step(model, x, labels)


def test_with_the_fallback_off_the_tracing_error_is_raised(monkeypatch):
    monkeypatch.setenv(uncompiled.ENVIRONMENT, "0")
    smp.init()
    model = smp.DistributedModel(LabelledRowsClassifier())
    with pytest.raises(TracedControlFlowError, match="unique_consecutive"):
        train_step(model, *_batches(1)[0])


def test_a_plain_pytorch_loop_over_such_a_model_trains_as_pytorch():
    """No step function: ``loss.backward()`` and a torch optimizer on the model's parameters (the eager loop)."""
    module = LabelledRowsClassifier()
    reference = LabelledRowsClassifier()
    reference.load_state_dict(module.state_dict())
    smp.init()
    model = smp.DistributedModel(module)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05)
    for x, labels in _batches(2):
        optimizer.zero_grad()
        loss, logits = model(x, labels)
        loss.backward()
        optimizer.step()
        reference_optimizer.zero_grad()
        expected, _ = reference(x, labels)
        expected.backward()
        reference_optimizer.step()
        assert tuple(logits.shape) == (16, 3)
        np.testing.assert_allclose(float(loss), float(expected.detach()), rtol=1e-5)
    for name, value in reference.state_dict().items():
        np.testing.assert_allclose(model.state_dict()[name].numpy(), value.numpy(), rtol=1e-5, atol=1e-6)


class NormedClassifier(LabelledRowsClassifier):
    """The same with a BatchNorm between its layers: a compiled segment whose buffers change."""

    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(16)

    def forward(self, x, labels):
        if torch.unique_consecutive((x == 0).sum(-1)).numel() > 1:
            raise ValueError("All examples must have the same number of end tokens.")
        logits = self.head(self.norm(torch.tanh(self.hidden(x))))
        index = (labels >= 0).nonzero()
        kept = torch.gather(logits, 0, index.expand(index.size(0), logits.size(1)))
        return F.cross_entropy(kept, torch.gather(labels, 0, index.view(-1))), logits


@pytest.mark.parametrize("segments", ["on", "off"])
def test_the_modules_that_trace_run_as_compiled_segments(monkeypatch, segments):
    """The root needs values and runs op by op; its layers trace and run as compiled segments (off: op by op too).
    Either way two SGD steps over 2 microbatches equal PyTorch's: losses, weights and BatchNorm's running stats."""
    monkeypatch.setenv("JMP_COMPILED_SEGMENTS", "1" if segments == "on" else "0")
    module = NormedClassifier()
    reference = NormedClassifier()
    reference.load_state_dict(module.state_dict())
    smp.init({"microbatches": 2})
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for x, labels in _batches(2):
        optimizer.zero_grad()
        loss, _ = train_step(model, x, labels)
        optimizer.step()
        reference_optimizer.zero_grad()
        expected = [reference(x[half::2], labels[half::2])[0] for half in (0, 1)]
        (sum(expected) / 2).backward()
        reference_optimizer.step()
        np.testing.assert_allclose([float(v) for v in loss.outputs], [float(e.detach()) for e in expected], rtol=1e-5)
    for name, value in reference.state_dict().items():
        np.testing.assert_allclose(model.state_dict()[name].numpy(), value.numpy(), rtol=1e-5, atol=1e-6)
    program = next(p for p, _ in model.programs if isinstance(p, uncompiled.UncompiledProgram))
    assert program.segments.compiled_paths == ({"hidden", "norm", "head"} if segments == "on" else set())
    assert set(program.segments.op_by_op) == ({""} if segments == "on" else set())


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x, factor):
        return self.linear(x) * factor


class ScalingLoop(nn.Module):
    """Calls its layer with a new Python float each time, after a data-dependent selection."""

    def __init__(self):
        super().__init__()
        self.scaled = Scaled()

    def forward(self, x):
        x = x[(x[:, 0] > -10).nonzero().view(-1)]
        for step in range(12):
            x = torch.tanh(self.scaled(x, 1.0 + step / 10))
        return x.square().mean()


@smp.step
def loss_step(model, x):
    loss = model(x)
    model.backward(loss)
    return loss


def test_a_module_called_with_ever_new_arguments_stops_compiling():
    """Each new float keys a new segment; past MAX_KEYS_PER_MODULE the layer runs op by op, the loss unchanged."""
    module = ScalingLoop()
    reference = ScalingLoop()
    reference.load_state_dict(module.state_dict())
    smp.init()
    model = smp.DistributedModel(module)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(2))
    loss = loss_step(model, x)
    np.testing.assert_allclose(float(loss.reduce_mean()), float(reference(x).detach()), rtol=1e-5)
    program = next(p for p, _ in model.programs if isinstance(p, uncompiled.UncompiledProgram))
    assert sum(key[0] == "scaled" for key in program.segments.compiled) == segments.MAX_KEYS_PER_MODULE
    assert "different non-tensor arguments" in program.segments.op_by_op["scaled"]


class TiedHeadRouter(nn.Module):
    """A language model whose head is tied to its embedding (the head is a compiled segment holding a tensor first
    named outside it) and whose middle sends each token's hidden state through the layer a Python list picks, as
    JetMoe's router does with ``expert_size.tolist()``."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        hidden = self.embed(ids)
        counts = (hidden[..., 0] > 0).long().sum().view(1).tolist()  # a concrete value: the step runs op by op
        routed = self.experts[counts[0] % 2](hidden)
        logits = self.head(torch.tanh(routed))
        return F.cross_entropy(logits[:, :-1].reshape(-1, 32), ids[:, 1:].reshape(-1))


def test_a_tied_head_compiled_as_a_segment_takes_each_microbatchs_embedding():
    """The head's compiled segment is traced once, in the first microbatch; the second microbatch and the next step
    call it again and must hand it their embedding, not the first's (an escaped tracer before). Against PyTorch."""
    module = TiedHeadRouter()
    reference = TiedHeadRouter()
    reference.load_state_dict(module.state_dict())
    smp.init({"microbatches": 2})
    model = smp.DistributedModel(module)
    ids = torch.randint(0, 32, (16, 6), generator=torch.Generator().manual_seed(3))
    loss = loss_step(model, ids)
    expected = [reference(ids[half::2]) for half in (0, 1)]  # one row of each of 8 shards a microbatch
    (sum(expected) / 2).backward()
    np.testing.assert_allclose([float(v) for v in loss.outputs], [float(e) for e in expected], rtol=1e-5)
    program = next(p for p, _ in model.programs if isinstance(p, uncompiled.UncompiledProgram))
    assert "head" in program.segments.compiled_paths
    grads = {name: p.grad for name, p in model.named_parameters()}
    for name, parameter in reference.named_parameters():
        np.testing.assert_allclose(grads[name].numpy(), parameter.grad.numpy(), rtol=1e-5, atol=1e-6)
    again = loss_step(model, ids)  # the next step calls the segment again too
    np.testing.assert_allclose([float(v) for v in again.outputs], [float(e) for e in expected], rtol=1e-5)
