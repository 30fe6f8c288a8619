"""Pipeline parallelism: stages, schedules and partitioning, checked against PyTorch on the same weights."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import jmp as smp
from benchmarks.harness import all_reduce_bytes
from jmp.compiled_step import replica_gradients
from jmp.examples.models import GroupedNet
from jmp.torch_bridge import torch_name
from tests.pipeline.models import nll_step, predict
from tests.sharding.models import causal_lm, token_batches


@smp.step
def lm_step(model, ids):
    out = model(input_ids=ids, labels=ids, use_cache=False)
    model.backward(out.loss)
    return out.loss


def assert_grads_match(model, reference: nn.Module, bound: float = 1e-5) -> None:
    """Every gradient equals the torch reference's within ``bound`` of the tensor's largest entry."""
    torch_grads = {n: p.grad.numpy() for n, p in reference.named_parameters(remove_duplicate=False)}
    for path, grad in jax.tree_util.tree_leaves_with_path(model.grads):
        name = torch_name(path)
        expected = torch_grads[name]
        error = np.abs(np.asarray(grad) - expected).max() / (np.abs(expected).max() + 1e-12)
        assert error < bound, (name, error)


class ManualNet(nn.Module):
    """GroupedNet's layers placed by hand: convolutions on stage 0, linears on stage 1."""

    def __init__(self):
        super().__init__()
        with smp.partition(0):
            self.conv1 = nn.Conv2d(1, 8, 3, 1)
            self.conv2 = nn.Conv2d(8, 16, 3, 1)
        with smp.partition(1):
            self.fc1 = nn.Linear(2304, 32)
            self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = torch.flatten(F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2), 1)
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


def mnist_batch(rows: int = 16):
    generator = torch.Generator().manual_seed(3)
    return torch.randn(rows, 1, 28, 28, generator=generator), torch.randint(0, 10, (rows,), generator=generator)


@pytest.mark.parametrize("how", ["auto", "manual"])
def test_grouped_net_two_stages_equal_pytorch(how):
    config = {"pipeline_parallel_degree": 2, "microbatches": 4}
    if how == "manual":
        config |= {"auto_partition": False, "default_partition": 0}
    smp.init(config)
    net = GroupedNet() if how == "auto" else ManualNet()
    reference = type(net)()
    reference.load_state_dict(net.state_dict())
    reference.eval()
    data, target = mnist_batch()
    torch_loss = F.nll_loss(reference(data), target)
    torch_loss.backward()

    model = smp.DistributedModel(net).eval()  # eval: dropout off, as in the reference
    loss = nll_step(model, data, target).reduce_mean()
    np.testing.assert_allclose(float(loss), float(torch_loss), rtol=1e-5)
    assert_grads_match(model, reference)
    np.testing.assert_allclose(
        np.asarray(predict(model, data).concat()), reference(data).detach().numpy(), rtol=1e-5, atol=1e-6
    )

    stages = model.pipeline.layout.stages
    first, second = ("net1", "net2") if how == "auto" else ("conv", "fc")
    assert all(stages[n] == (0,) for n in stages if n.startswith(first))
    assert all(stages[n] == (1,) for n in stages if n.startswith(second))
    for buffer in model.training_state.params.values():  # each device holds one stage's row
        assert buffer.sharding.spec[0] == "pp" and buffer.addressable_shards[0].data.shape[0] == 1


def test_pipelined_training_follows_pytorch():
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    net = ManualNet()
    reference = ManualNet()
    reference.load_state_dict(net.state_dict())
    model = smp.DistributedModel(net)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2))
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    data, target = mnist_batch(8)
    for _ in range(3):
        optimizer.zero_grad()
        loss = nll_step(model, data, target).reduce_mean()
        optimizer.step()
        torch_optimizer.zero_grad()
        torch_loss = F.nll_loss(reference(data), target)
        torch_loss.backward()
        torch_optimizer.step()
        np.testing.assert_allclose(float(loss), float(torch_loss), rtol=2e-5)
    trained = model.state_dict()
    for name, value in reference.state_dict().items():
        np.testing.assert_allclose(trained[name].numpy(), value.numpy(), rtol=1e-4, atol=1e-5)
    saved = optimizer.state_dict()  # torch's per-parameter format, unpacked from the stages
    expected = torch_optimizer.state_dict()["state"]
    assert sorted(saved["state"]) == sorted(expected) == list(range(8))
    for i, entry in expected.items():
        # float32 sums in another order (per-replica gradients summed once after the schedule): 1e-5 relative
        np.testing.assert_allclose(saved["state"][i]["exp_avg"].numpy(), entry["exp_avg"].numpy(), rtol=1e-5, atol=1e-6)
    optimizer.load_state_dict(saved)  # back into the stage buffers
    assert all(
        np.array_equal(optimizer.state_dict()["state"][i]["exp_avg_sq"], saved["state"][i]["exp_avg_sq"])
        for i in range(8)
    )


@pytest.mark.parametrize("copies", [True, False], ids=["per-replica-copies", "plain"])
def test_a_pipeline_over_data_parallel_replicas_reduces_gradients_once_after_its_schedule(copies, monkeypatch):
    """pp2 x dp4: each stage's row-local calls run per replica on copies of its parameters, so the schedule's loop
    holds no all-reduce of gradients; without the copies each backward tick reduces its stage's gradients (the
    numbers, with copies: the tests above)."""
    if not copies:
        monkeypatch.setattr(replica_gradients, "replicated_axes", lambda model, signature: ())
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4, "auto_partition": False, "default_partition": 0})
    net = ManualNet()
    model = smp.DistributedModel(net)
    data, target = mnist_batch()
    reduced = all_reduce_bytes(nll_step.lower(model, data, target).compile().as_text(), group=4)
    parameter_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    if copies:
        assert reduced["in_loop"] < 0.01 * parameter_bytes  # the loss's
    else:
        assert reduced["in_loop"] >= parameter_bytes


@pytest.fixture(scope="module")
def gpt2_reference():
    net = causal_lm("gpt2", layers=4)
    reference = causal_lm("gpt2", layers=4)
    reference.load_state_dict(net.state_dict())
    ids = token_batches(1, batch=16)[0]
    out = reference(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    return net, reference, ids, float(out.loss)


@pytest.mark.parametrize(("schedule", "recompute"), [("simple", True), ("interleaved", False)])
def test_gpt2_four_stages_equal_pytorch(gpt2_reference, schedule, recompute):
    """Whether a stage's backward reads the residuals its forward kept or runs the forward again."""
    net, reference, ids, torch_loss = gpt2_reference
    config = {"pipeline_parallel_degree": 4, "microbatches": 8, "pipeline": schedule, "pipeline_recompute": recompute}
    smp.init(config)  # dp = 2 on 8 devices
    model = smp.DistributedModel(net)
    loss = lm_step(model, ids).reduce_mean()
    np.testing.assert_allclose(float(loss), torch_loss, rtol=1e-5)
    assert_grads_match(model, reference)

    layout = model.pipeline.layout
    assert layout.stages["transformer.wte.weight"] == (0, 3)  # tied to lm_head: held by both ends
    assert [layout.stages[f"transformer.h.{i}.attn.c_attn.weight"] for i in range(4)] == [(0,), (1,), (2,), (3,)]
    held = sum(b.addressable_shards[0].data.nbytes for b in model.training_state.params.values())
    own = layout.stage_bytes()
    assert held <= 1.10 * max(own)  # a device holds its stage's parameters (rows are padded to the largest stage)
    whole = sum(p.numel() * 4 for p in net.parameters())
    assert held < 0.4 * whole


def test_dropout_in_checkpointed_layers_is_the_same_kept_or_recomputed():
    """GPT-2 with dropout, each layer checkpointed, pp2: a stage that keeps its residuals (dropout masks; the
    checkpointed layers' random keys derived again) gives the loss and gradients of one that recomputes its
    forward, and dropout is on (the loss differs from the evaluation loss)."""
    ids = token_batches(1)[0]
    net = causal_lm("gpt2")
    net.config.resid_pdrop = net.config.embd_pdrop = net.config.attn_pdrop = 0.1
    net = type(net)(net.config)
    with torch.no_grad():
        evaluation = float(net.eval()(input_ids=ids, labels=ids, use_cache=False).loss)
    results = []
    for recompute in (False, True):
        smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "pipeline_recompute": recompute})
        fresh = type(net)(net.config).train()
        fresh.load_state_dict(net.state_dict())
        model = smp.DistributedModel(fresh)
        smp.set_activation_checkpointing(model.module.get_submodule("transformer.h"), strategy="each")
        loss = float(lm_step(model, ids).reduce_mean())
        results.append((loss, {n: np.asarray(g) for n, g in model.layout.by_name(model.grads).items()}))
    (kept, kept_grads), (recomputed, recomputed_grads) = results
    assert abs(kept - evaluation) > 1e-3
    np.testing.assert_allclose(kept, recomputed, rtol=1e-6)
    for name, grad in recomputed_grads.items():
        np.testing.assert_allclose(kept_grads[name], grad, rtol=1e-5, atol=1e-7, err_msg=name)


def _temp_bytes(schedule: str, microbatches: int, recompute: bool = False) -> int:
    smp.init(
        {
            "pipeline_parallel_degree": 2,
            "microbatches": microbatches,
            "pipeline": schedule,
            "pipeline_recompute": recompute,
        }
    )
    model = smp.DistributedModel(causal_lm("gpt2", hidden=64, layers=2))
    ids = token_batches(1, batch=8 * microbatches, length=32)[0]  # 2 rows per microbatch per data shard (dp4)
    return lm_step.lower(model, ids).compile().memory_analysis().temp_size_in_bytes  # lowering cuts the stages


def test_interleaved_memory_follows_stages_not_microbatches():
    interleaved = [_temp_bytes("interleaved", m) for m in (4, 16)]
    simple = [_temp_bytes("simple", m) for m in (4, 16)]
    assert interleaved[1] < 1.5 * interleaved[0]
    # simple keeps every microbatch's stage input and output cotangent until its backward: going from 4 to 16
    # microbatches adds 12 x 2 hidden states per device (2 rows x 32 tokens x 64 features, float32) at least
    per_microbatch = 2 * (2 * 32 * 64 * 4)
    assert simple[1] - simple[0] >= 12 * per_microbatch
    assert interleaved[1] - interleaved[0] < 0.25 * (simple[1] - simple[0])
    # keeping only each microbatch's stage input, and running the forward again in the backward, holds less
    recomputed = _temp_bytes("interleaved", 16, recompute=True)
    assert recomputed < 0.6 * interleaved[1]


def test_checkpoint_across_stages_is_skipped_with_a_warning(caplog):
    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            with smp.partition(0):
                self.a = nn.Linear(16, 16)
            with smp.partition(1):
                self.b = nn.Linear(16, 4)

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = Body()

        def forward(self, x):
            return F.log_softmax(smp.checkpoint(self.body, x), dim=1)

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False, "default_partition": 0})
    net = Root()
    reference = Root()
    reference.load_state_dict(net.state_dict())
    data, target = torch.randn(8, 16), torch.randint(0, 4, (8,))
    F.nll_loss(reference(data), target).backward()
    model = smp.DistributedModel(net)
    with caplog.at_level(logging.WARNING, logger="jmp"):
        nll_step(model, data, target)
    assert any("cannot span stages" in r.getMessage() for r in caplog.records)
    assert model.pipeline.layout.stages["body.b.weight"] == (1,)
    assert_grads_match(model, reference)


def test_errors_say_what_to_change():
    with pytest.raises(smp.ConfigError, match="default_partition"):
        smp.init({"pipeline_parallel_degree": 2, "auto_partition": False})
    with pytest.raises(smp.ConfigError, match="non-negative integer"):
        with smp.partition(-1):
            pass

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False, "default_partition": 0})
    with smp.partition(0):
        net = GroupedNet()  # everything on stage 0: stage 1 would get nothing
    model = smp.DistributedModel(net)
    with pytest.raises(smp.PipelineError, match=r"stage\(s\) \[1\] got no computation"):
        nll_step(model, *mnist_batch(8))


def test_active_microbatches_changes_the_schedule_not_the_gradients():
    """SMP's active_microbatches=1: one microbatch in flight per stage, the same loss and gradients."""
    data, target = mnist_batch()
    net = GroupedNet()
    results = []
    for extra in ({}, {"active_microbatches": 1}):
        smp.init({"pipeline_parallel_degree": 2, "microbatches": 4, **extra})
        fresh = GroupedNet()
        fresh.load_state_dict(net.state_dict())
        model = smp.DistributedModel(fresh).eval()
        loss = float(nll_step(model, data, target).reduce_mean())
        results.append((loss, {n: np.asarray(g) for n, g in model.layout.by_name(model.grads).items()}))
    (loss, grads), (loss_one, grads_one) = results
    np.testing.assert_allclose(loss_one, loss, rtol=1e-6)
    for name, grad in grads.items():
        np.testing.assert_allclose(grads_one[name], grad, rtol=1e-5, atol=1e-7)
