"""A PyTorch training loop written without a step function runs on jmp as written, only the model wrapped:
``loss = model(**batch).loss; loss.backward(); optimizer.step()``, recorded and run as one compiled step.

The loop is Hugging Face's causal-LM fine-tuning as people write it: AdamW with decay / no-decay groups, a linear
schedule with warm-up, gradient accumulation over 2 batches (the loss divided by 2), ``clip_grad_norm_``,
``loss.item()`` logging and a ``torch.no_grad()`` evaluation. PyTorch eager runs the same loop on the same
weights and data. The torch optimizer built on the wrapped model's parameters becomes a ``DistributedOptimizer``
at its first ``step()``.
"""

from __future__ import annotations

import copy
import gc
import weakref

import jax
import numpy as np
import pytest
import torch

import jmp as smp
from jmp.errors import StepError
from jmp.runtime import notices
from tests.helpers import assert_close
from tests.sharding.models import causal_lm, token_batches

transformers = pytest.importorskip("transformers")

ACCUMULATION = 2
LAYOUTS = {
    "fsdp4xtp2": {"sharded_data_parallel_degree": 4, "tensor_parallel_degree": 2},
    "pp2-mb2": {"pipeline_parallel_degree": 2, "microbatches": 2},
}


def fine_tune(model, optimizer, scheduler, batches, evaluation):
    """The loop (what a user writes; jmp's run gets the wrapped model and optimizer)."""
    logged = []
    model.train()
    for i, ids in enumerate(batches):
        outputs = model(input_ids=ids, labels=ids, use_cache=False)
        loss = outputs.loss / ACCUMULATION
        loss.backward()
        if (i + 1) % ACCUMULATION == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            logged.append(loss.item() * ACCUMULATION)
    model.eval()
    with torch.no_grad():
        held_out = [float(model(input_ids=ids, labels=ids, use_cache=False).loss) for ids in evaluation]
    return logged, held_out


def _optimizer(model):
    no_decay = ["bias", "ln_"]
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)], "weight_decay": 0.1},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=3e-3)


def _run(net, wrap, wrap_optimizer=False):
    model = smp.DistributedModel(net) if wrap else net  # the one change to the loop: the optimizer stays torch's
    optimizer = _optimizer(model)
    if wrap_optimizer:  # a pipelined model packs its stages by param group: they must be known at the first step
        optimizer = smp.DistributedOptimizer(optimizer)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, 1, 4)
    batches = token_batches(2 * ACCUMULATION, batch=16)
    return fine_tune(model, optimizer, scheduler, batches, token_batches(1, batch=16, seed=7)), model


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_loop_trains_as_pytorch_eager(layout, caplog, monkeypatch):
    caplog.set_level("INFO", logger="jmp")
    monkeypatch.setattr(notices, "_SAID", set())  # said once per job: as if this were the first loop
    smp.init(LAYOUTS[layout])
    net = causal_lm("gpt2")
    (expected, expected_held_out), reference = _run(copy.deepcopy(net), wrap=False)
    pipelined = "pipeline_parallel_degree" in LAYOUTS[layout]
    (logged, held_out), model = _run(net, wrap=True, wrap_optimizer=pipelined)
    np.testing.assert_allclose(logged, expected, rtol=1e-5)
    np.testing.assert_allclose(held_out, expected_held_out, rtol=1e-5)
    trained = model.state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=0, atol=2e-5)
    assert caplog.text.count("wrapped in smp.DistributedOptimizer at its first step()") == (0 if pipelined else 1)


def test_the_loop_compiles_once_per_structure():
    smp.init({})
    model = smp.DistributedModel(causal_lm("gpt2"))
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for ids in token_batches(5):
        model.train()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        model.eval()
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    # the training step, its forward's shapes, the evaluation: each traced for the first batch only
    assert len(model.programs) == 3


def test_two_backward_calls_accumulate_as_one_on_both_batches():
    smp.init({})
    net = causal_lm("gpt2")
    first, second = token_batches(2)
    both = smp.DistributedModel(copy.deepcopy(net))
    both(input_ids=torch.cat([first, second]), labels=torch.cat([first, second]), use_cache=False).loss.backward()
    torch_net = copy.deepcopy(net)
    halves = smp.DistributedModel(net)
    for ids in (first, second):
        (halves(input_ids=ids, labels=ids, use_cache=False).loss / 2).backward()
    for grad, expected in zip(jax.tree.leaves(halves.grads), jax.tree.leaves(both.grads), strict=True):
        np.testing.assert_allclose(grad, expected, rtol=2e-5, atol=1e-7)
    for ids in (first, second):  # p.grad reads them as torch's .grad after the same two backward() calls
        (torch_net(input_ids=ids, labels=ids, use_cache=False).loss / 2).backward()
    for (name, parameter), (_, expected) in zip(halves.named_parameters(), torch_net.named_parameters()):
        torch.testing.assert_close(parameter.grad + 0, expected.grad, rtol=2e-4, atol=1e-6, msg=name)


def test_values_kept_past_backward_read_as_tensors_and_misuse_says_what_to_do():
    smp.init({})
    model = smp.DistributedModel(causal_lm("gpt2"))
    ids = token_batches(1)[0]
    outputs = model(input_ids=ids, labels=ids, use_cache=False)
    loss, logits = outputs.loss, outputs.logits
    assert loss.requires_grad and loss.shape == () and logits.shape == (8, 16, 128)
    loss.backward()
    total = torch.zeros(())
    total += loss.detach()  # logged as torch tensors are
    assert float(total) == pytest.approx(loss.item())
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert float(expected) == pytest.approx(loss.item(), rel=1e-5)  # the logits kept are the step's
    with pytest.raises(StepError, match="twice"):
        loss.backward()
    with pytest.raises(StepError, match="scalar"):
        model(input_ids=ids, use_cache=False).logits.backward()


def test_a_plain_torch_optimizers_state_dict_and_zero_grad_are_the_wrappers():
    smp.init({})
    model = smp.DistributedModel(causal_lm("gpt2"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = token_batches(1)[0]
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    optimizer.step()  # wrapped here: the wrapper's step updates the model, torch's then finds no p.grad
    assert optimizer.state_dict()["state"][0]["exp_avg"].abs().sum() > 0  # the moments live on the devices
    assert not optimizer.state  # torch's own step saw no gradient: it kept no moments of its own
    assert all(p.grad is not None for p in model.parameters())  # and p.grad is back after it
    optimizer.zero_grad()
    assert model.grads is None
    reference = torch.nn.Linear(2, 2)  # optimizers of other modules are torch's as always
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference(torch.ones(1, 2)).sum().backward()
    before = reference.weight.detach().clone()
    plain.step()
    assert not torch.equal(reference.weight, before)
    gone = weakref.ref(model)
    del model, optimizer
    gc.collect()
    assert gone() is None  # the wrapper made at step() keeps neither the optimizer nor its model alive


def test_a_loss_computed_outside_the_model_and_torch_autograd_backward_give_the_models_own(caplog):
    smp.init({"microbatches": 2})
    net = causal_lm("gpt2")
    ids = token_batches(1, batch=16)[0]
    inside = smp.DistributedModel(copy.deepcopy(net))
    inside(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    outside = smp.DistributedModel(net)
    logits = outside(input_ids=ids, use_cache=False).logits
    with pytest.raises(StepError, match="cannot be split"):  # labels flattened on the host lose their batch rows
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:])  # labels keep their rows
    if loss > 0:  # a Python branch on a value runs the forward first, and says what that costs
        torch.autograd.backward(loss)
    assert "read before backward()" in caplog.text
    for grad, expected in zip(jax.tree.leaves(outside.grads), jax.tree.leaves(inside.grads), strict=True):
        np.testing.assert_allclose(grad, expected, rtol=2e-5, atol=1e-7)


def test_a_grad_scalers_scaled_loss_trains_as_the_loss_itself():
    smp.init({})
    net = causal_lm("gpt2")
    plain = smp.DistributedModel(copy.deepcopy(net))
    scaled = smp.DistributedModel(net)
    optimizers = {m: smp.DistributedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-3)) for m in (plain, scaled)}
    scaler = smp.amp.GradScaler()
    for ids in token_batches(1):
        plain(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        optimizers[plain].step()
        optimizers[plain].zero_grad()
        scaler.scale(scaled(input_ids=ids, labels=ids, use_cache=False).loss).backward()
        scaler.step(optimizers[scaled])
        scaler.update()
        optimizers[scaled].zero_grad()
    assert scaler.get_scale() == 65536.0  # float32 gradients never overflow: the scale stays
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(scaled.state_dict()[name], value, rtol=0, atol=1e-6)


@smp.step
def _lm_step(model, ids):
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    model.backward(loss)
    return loss


def test_the_loop_computes_what_the_same_loop_with_a_step_function_computes():
    smp.init({"microbatches": 2})
    net = causal_lm("gpt2")
    models = {"eager": smp.DistributedModel(copy.deepcopy(net)), "step": smp.DistributedModel(net)}
    optimizers = {k: smp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1)) for k, m in models.items()}
    losses = {"eager": [], "step": []}
    for ids in token_batches(2, batch=16):
        loss = models["eager"](input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        losses["eager"].append(loss.item())
        losses["step"].append(_lm_step(models["step"], ids).reduce_mean().item())
        for optimizer in optimizers.values():
            optimizer.step()
            optimizer.zero_grad()
    assert losses["eager"] == losses["step"]  # the same forward program: the same numbers, bit for bit
    # the eager loop's backward is a program of its own: its sums may round differently in the last bit (they do
    # under XLA:CPU's elemental emitters, the suite's: tests/conftest.py; 1e-7 of each gradient)
    stepped = models["step"].state_dict()
    for name, value in models["eager"].state_dict().items():
        assert_close(value, stepped[name], 1e-6)
