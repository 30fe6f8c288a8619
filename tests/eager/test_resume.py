"""A loop without a step function checkpoints and resumes as PyTorch loops do: ``torch.save`` of the model's, the
plain torch optimizer's and the scheduler's ``state_dict()`` after some steps; a fresh setup (new model, optimizer
and scheduler) loads them and carries on as if never stopped.

The fresh optimizer loads its state before its first ``step()``, while it is still torch's own: the
``DistributedOptimizer`` it becomes at that step takes the loaded state to the devices.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

import jmp as smp
from jmp.eager import plain_optimizers
from jmp.errors import OptimizerError
from tests.sharding.models import causal_lm, token_batches

transformers = pytest.importorskip("transformers")

SAVED_AFTER = 2  # of 5 steps


def _setup(net, wrap):
    model = smp.DistributedModel(net) if wrap else net
    no_decay = ["bias", "ln_"]
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)], "weight_decay": 0.1},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=3e-3)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, num_warmup_steps=1, num_training_steps=6)
    return model, optimizer, scheduler


def _train(model, optimizer, scheduler, batches):
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_loop_resumed_from_torch_saved_state_dicts_goes_on_as_the_uninterrupted_run(tmp_path):
    smp.init({"sharded_data_parallel_degree": 8})  # the optimizer state split over the 8 devices
    batches = token_batches(5)
    expected = _train(*_setup(causal_lm("gpt2"), wrap=False), batches)

    model, optimizer, scheduler = _setup(causal_lm("gpt2"), wrap=True)
    before = _train(model, optimizer, scheduler, batches[:SAVED_AFTER])
    path = tmp_path / "checkpoint.pt"
    saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    torch.save(saved, path)
    uninterrupted = before + _train(model, optimizer, scheduler, batches[SAVED_AFTER:])

    model, optimizer, scheduler = _setup(causal_lm("gpt2"), wrap=True)  # as a new process would build them
    checkpoint = torch.load(path)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])  # before its first step(): still torch's own optimizer
    scheduler.load_state_dict(checkpoint["scheduler"])
    resumed = before + _train(model, optimizer, scheduler, batches[SAVED_AFTER:])

    np.testing.assert_allclose(resumed, uninterrupted, rtol=1e-6)
    np.testing.assert_allclose(uninterrupted, expected, rtol=1e-5)
    assert not optimizer.state  # torch's copy of the loaded state went to the devices, not kept twice
    moments = optimizer.state_dict()["state"][0]["exp_avg_sq"]
    assert moments.shape == optimizer.param_groups[0]["params"][0].shape and moments.abs().sum() > 0
    on_devices = getattr(optimizer, plain_optimizers.WRAPPER).opt_state
    placed = [array.sharding for array in jax.tree.leaves(on_devices)]
    optimizer.load_state_dict(optimizer.state_dict())
    on_devices = getattr(optimizer, plain_optimizers.WRAPPER).opt_state
    assert [array.sharding for array in jax.tree.leaves(on_devices)] == placed  # the compiled update's own layout


def test_a_state_loaded_into_meta_device_parameters_is_refused_at_the_first_step():
    smp.init({})
    reference = causal_lm("gpt2")
    trained = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    ids = token_batches(1)[0]
    reference(input_ids=ids, labels=ids).loss.backward()
    trained.step()
    with smp.delay_param_initialization():
        model = smp.DistributedModel(causal_lm("gpt2"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # on the meta-device parameters
    optimizer.load_state_dict(trained.state_dict())  # torch moves the values to the meta device
    plain_optimizers.install()  # as the model's first call does
    with pytest.raises(OptimizerError, match="smp.DistributedOptimizer\\(optimizer\\), then call its load_state_dict"):
        optimizer.step()


def test_smp_checkpoints_take_the_plain_torch_optimizer_of_the_loop(tmp_path):
    smp.init({"sharded_data_parallel_degree": 8})
    batches = token_batches(4)
    model, optimizer, scheduler = _setup(causal_lm("gpt2"), wrap=True)
    before = _train(model, optimizer, scheduler, batches[:SAVED_AFTER])
    smp.save_checkpoint(tmp_path, "after-2", model=model, optimizer=optimizer)  # the torch AdamW the loop holds
    schedule = scheduler.state_dict()
    uninterrupted = before + _train(model, optimizer, scheduler, batches[SAVED_AFTER:])

    model, optimizer, scheduler = _setup(causal_lm("gpt2"), wrap=True)
    smp.resume_from_checkpoint(tmp_path, "after-2", optimizer=optimizer)  # before its first step()
    scheduler.load_state_dict(schedule)  # the loop's own to keep, as with torch.save
    resumed = before + _train(model, optimizer, scheduler, batches[SAVED_AFTER:])
    np.testing.assert_allclose(resumed, uninterrupted, rtol=1e-6)
