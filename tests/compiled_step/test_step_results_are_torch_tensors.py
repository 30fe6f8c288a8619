"""What a step hands back to user code is plain torch: every StepOutput reading is a ``torch.Tensor`` that torch
code adds up, saves, stacks, formats and gives to numpy, with the values PyTorch computes on the same weights
and data; an evaluation step returning a Hugging Face output with a key/value cache runs (the cache comes back
as None, with one note)."""

from __future__ import annotations

import io
import logging

import pytest
import torch
import torch.nn.functional as F

import jmp as smp
from jmp.compiled_step import outputs as step_outputs
from tests.front_end.helpers import SmallNet, batches
from tests.sharding.models import causal_lm, token_batches


@smp.step
def train_step(model, data, target):
    output = model(data)
    loss = F.cross_entropy(output, target)
    model.backward(loss)
    return output, loss, output.argmax(dim=1) == target, (output.argmax(dim=1) == target).sum()


@pytest.fixture
def model() -> smp.DistributedModel:
    smp.init({"microbatches": 2})
    return smp.DistributedModel(SmallNet())


def test_every_reading_of_a_step_output_is_a_plain_torch_tensor(model):
    x, y = batches(1, batch=16)[0]
    output, loss, right, count = train_step(model, x, y)
    readings = [loss.reduce_mean(), loss.reduce_sum(), output.concat(), output.stack(), *output.outputs]
    readings += [output.detach().concat(), loss.detach().reduce_mean(), right.concat(), count.reduce_sum()]
    assert {type(value) for value in readings} == {torch.Tensor}
    assert all(type(value) is torch.Tensor for value in model.state_dict().values())
    # the same values as torch on the same weights and data
    expected = model.module(x).detach()
    torch.testing.assert_close(output.concat(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss.reduce_mean(), F.cross_entropy(expected, y), rtol=1e-5, atol=0)
    hits = expected.argmax(dim=1) == y
    assert torch.equal(right.concat(), hits)
    # counts sum to int64 and average to floats, as torch's sum and true division do
    assert count.reduce_sum().dtype == torch.int64 and int(count.reduce_sum()) == int(hits.sum())
    assert right.reduce_sum().dtype == torch.int64
    assert count.reduce_mean().dtype == torch.float32 and float(count.reduce_mean()) == hits.sum().item() / 2


def test_a_loss_is_added_saved_stacked_and_formatted_like_any_torch_tensor(model):
    losses, total = [], torch.zeros(())
    for x, y in batches(3, batch=16):
        _, loss_mb, _, _ = train_step(model, x, y)
        loss = loss_mb.reduce_mean()
        total += loss  # in place into a torch tensor
        losses.append(loss.detach().cpu())
    stacked = torch.stack(losses)
    torch.testing.assert_close(total, stacked.sum())
    buffer = io.BytesIO()
    torch.save({"losses": stacked, "last": losses[-1]}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert torch.equal(loaded["losses"], stacked) and torch.equal(loaded["last"], losses[-1])
    assert losses[0].item() == float(losses[0]) == float(losses[0].numpy())
    assert f"{losses[0]:.4f}" == f"{losses[0].item():.4f}"
    assert (stacked + 1).numpy().shape == (3,)


@smp.step
def lm_eval_step(model, ids):
    return model(input_ids=ids)


def test_an_evaluation_step_returning_a_key_value_cache_gives_the_outputs_and_drops_the_cache(caplog, monkeypatch):
    monkeypatch.setattr(step_outputs, "_noted_caches", set(), raising=False)  # the note comes once per process
    smp.init({"microbatches": 2})
    model = smp.DistributedModel(causal_lm("gpt2"))
    model.eval()
    ids = token_batches(1, batch=16)[0]
    with caplog.at_level(logging.INFO, logger="jmp"), torch.no_grad():
        first = lm_eval_step(model, ids)
        second = lm_eval_step(model, ids)
    expected = model.module(input_ids=ids)
    assert type(expected.past_key_values).__name__ == "DynamicCache"  # what torch returns: a cache by default
    assert first.past_key_values is None and second.past_key_values is None
    torch.testing.assert_close(first.logits.concat(), expected.logits.detach(), rtol=1e-4, atol=1e-5)
    notes = [r.getMessage() for r in caplog.records if "DynamicCache" in r.getMessage()]
    assert len(notes) == 1 and "use_cache=False" in notes[0]
