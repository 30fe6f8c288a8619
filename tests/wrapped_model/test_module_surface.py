"""DistributedModel behaves like the torch module it wraps, as SMP scripts use it (SMP v1's DistributedModel API)."""

from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import jmp as smp
from jmp.errors import ArgumentTypeError, ConfigError
from tests.front_end.helpers import SmallNet, batches, torch_train, train_step
from tests.pipeline.models import NormNet, nll_step

NO_DECAY = ["bias", "norm.weight"]


def decay_groups(named, weight_decay: float) -> list[dict]:
    """The param groups SMP's examples build: no weight decay for biases and norm weights."""
    named = list(named)
    return [
        {"params": [p for n, p in named if not any(nd in n for nd in NO_DECAY)], "weight_decay": weight_decay},
        {"params": [p for n, p in named if any(nd in n for nd in NO_DECAY)], "weight_decay": 0.0},
    ]


def test_param_groups_split_by_name_train_as_in_torch():
    smp.init({})
    module, data = SmallNet(), batches(4)
    reference = copy.deepcopy(module)
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(decay_groups(model.named_parameters(), 0.5), lr=1e-2))
    groups = optimizer.torch_optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [0.5, 0.0]
    assert {id(p) for p in groups[1]["params"]} == {
        id(p) for n, p in module.named_parameters() if n in ("fc1.bias", "norm.weight", "norm.bias", "fc2.bias")
    }
    expected = torch_train(reference, torch.optim.AdamW(decay_groups(reference.named_parameters(), 0.5), lr=1e-2), data)
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        _, loss = train_step(model, x, y)
        optimizer.step()
        losses.append(float(loss.reduce_mean()))
    np.testing.assert_allclose(losses, expected, rtol=1e-5, atol=1e-6)
    trained = model.state_dict()
    for name, parameter in reference.named_parameters():  # weight decay of 0.5 moves weights: groups matter
        np.testing.assert_allclose(trained[name].numpy(), parameter.detach().numpy(), rtol=1e-5, atol=1e-6)


class Buffered(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.body(x))


def test_iteration_is_the_torch_modules():
    smp.init({})
    module = Buffered()
    model = smp.DistributedModel(module)
    assert model.get_module() is module
    assert list(model.modules()) == list(module.modules())
    assert list(model.named_modules()) == list(module.named_modules())
    assert list(model.children()) == list(module.children())
    assert list(model.named_children()) == list(module.named_children())
    assert [id(p) for p in model.parameters()] == [id(p) for p in module.parameters()]
    assert [n for n, _ in model.named_parameters(prefix="m")] == [n for n, _ in module.named_parameters(prefix="m")]
    assert [(n, id(b)) for n, b in model.named_buffers()] == [(n, id(b)) for n, b in module.named_buffers()]
    assert [id(b) for b in model.buffers()] == [id(b) for b in module.buffers()]
    # one process holds every device here: its local share is the whole model
    assert [n for n, _ in model.local_named_parameters()] == [n for n, _ in module.named_parameters()]
    assert [id(p) for p in model.local_parameters()] == [id(p) for p in module.parameters()]
    assert [n for n, _ in model.local_named_buffers()] == [n for n, _ in module.named_buffers()]
    assert [id(b) for b in model.local_buffers()] == [id(b) for b in module.buffers()]
    assert list(model.local_modules()) == list(module.modules())
    assert model.partitioned


def test_device_moves_are_no_ops_and_dtype_changes_are_refused(caplog):
    smp.init({})
    model = smp.DistributedModel(SmallNet())
    with caplog.at_level(logging.INFO, logger="jmp"):
        assert model.cpu() is model
        assert model.cuda() is model and model.cuda(0) is model
        assert model.to("cuda") is model and model.to(torch.device("cpu")) is model
    assert any("no-op" in r.getMessage() for r in caplog.records)
    assert model.float() is model and model.to(torch.float32) is model  # the dtype it has: nothing changes
    for call in (model.half, model.bfloat16, lambda: model.to(torch.float16), lambda: model.to("cuda", torch.bfloat16)):
        with pytest.raises(ConfigError, match=r"smp\.model_creation\(dtype=.*'bf16' / 'fp16'"):
            call()


def test_smp_constructor_arguments(caplog):
    smp.init({})
    with caplog.at_level(logging.INFO, logger="jmp"):
        model = smp.DistributedModel(
            SmallNet(),
            trace_device="cpu",
            trace_execution_times=True,
            overlapping_allreduce=False,
            backward_passes_per_step=2,
            average_grads_across_microbatches=False,
            bucket_cap_mb=50,
            trace_memory_usage=True,
            broadcast_buffers=False,
            gradient_as_bucket_view=True,
        )
    assert model.backward_passes_per_step == 2 and model.average_grads_across_microbatches is False
    logged = " ".join(r.getMessage() for r in caplog.records)
    for name in ("trace_device", "bucket_cap_mb", "gradient_as_bucket_view", "overlapping_allreduce"):
        assert f"{name}=" in logged and "no effect" in logged
    defaults = smp.DistributedModel(SmallNet(), trace_device="gpu")
    assert defaults.backward_passes_per_step == 1 and defaults.average_grads_across_microbatches is True
    with pytest.raises(ArgumentTypeError, match=r"'bucket_cap'.*bucket_cap_mb.*backward_passes_per_step"):
        smp.DistributedModel(SmallNet(), bucket_cap=25)
    with pytest.raises(ConfigError, match="backward_passes_per_step"):
        smp.DistributedModel(SmallNet(), backward_passes_per_step=0)
    with pytest.raises(ArgumentTypeError, match="average_grads_across_microbatches"):
        smp.DistributedModel(SmallNet(), average_grads_across_microbatches="yes")
    with pytest.raises(ConfigError, match="trace_device"):
        smp.DistributedModel(SmallNet(), trace_device="tpu")


def test_post_partition_hook_runs_once_at_the_first_step():
    smp.init({})
    model = smp.DistributedModel(SmallNet())
    calls, removed = [], []
    model.register_post_partition_hook(lambda m, o: calls.append((m, o)))
    model.register_post_partition_hook(lambda m, o: removed.append(m)).remove()
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert calls == []
    (x, y), *_ = batches(2)
    for _ in range(2):
        train_step(model, x, y)
    assert len(calls) == 1 and calls[0][0] is model and calls[0][1] is optimizer
    assert removed == []
    model.register_post_partition_hook(lambda m, o: calls.append((m, o)))  # partitioned: runs right away
    assert len(calls) == 2 and calls[1][1] is optimizer


def test_post_partition_hook_of_a_pipelined_model_sees_its_stages():
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False, "default_partition": 0})
    model = smp.DistributedModel(NormNet(norm=nn.LayerNorm))
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
    seen = []
    model.register_post_partition_hook(lambda m, o: seen.append((m, o, m.partitioned, m.pipeline.ready)))
    assert not model.partitioned
    data, target = torch.randn(8, 16), torch.randint(0, 4, (8,))
    nll_step(model, data, target)
    nll_step(model, data, target)
    assert seen == [(model, optimizer, True, True)]
    assert [n for n, _ in model.local_named_parameters()] == [n for n, _ in model.named_parameters()]


def test_zero_grad_drops_the_gradients():
    smp.init({})
    model = smp.DistributedModel(SmallNet())
    smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    (x, y), *_ = batches(1)
    train_step(model, x, y)
    assert model.grads is not None
    model.zero_grad()
    assert model.grads is None


def test_attributes_of_the_wrapped_module_are_readable():
    from tests.sharding.models import causal_lm

    smp.init({})
    module = causal_lm("gpt2", layers=1)
    model = smp.DistributedModel(module)
    assert model.config is module.config and model.config.n_layer == 1
    assert model.lm_head is module.lm_head
    assert model.prepare_inputs_for_generation.__self__ is model  # the class's methods run on the model
    module.head_of_module = module.get_output_embeddings  # bound to the torch module: it would not act on the model
    with pytest.raises(AttributeError, match=r"set on the instance.*model\.module\.head_of_module\(\)"):
        model.head_of_module  # noqa: B018
    with pytest.raises(AttributeError, match="nor has its GPT2LMHeadModel"):
        model.no_such_thing  # noqa: B018
    with pytest.raises(AttributeError):
        model._private  # noqa: B018 - never delegated
    with pytest.raises(ArgumentTypeError, match="torch.nn.Module"):
        smp.DistributedModel(F.relu)  # no attribute lookups recurse while it is being built


def test_the_model_keeps_its_latest_optimizer_alive():
    """As SMP's state keeps its optimizer: a script may build the optimizer in a function and reach it later."""
    import gc

    smp.init({})

    def build() -> smp.DistributedModel:
        model = smp.DistributedModel(SmallNet())
        smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        return model

    model = build()
    gc.collect()
    assert isinstance(model.attached_optimizer, smp.DistributedOptimizer)
    assert "state" in model.attached_optimizer.local_state_dict()
