"""Hugging Face Accelerate's training loop, as its documentation writes it, runs on a ``smp.DistributedModel``.

Accelerate is code nobody here wrote: ``accelerator.prepare`` takes the wrapped model, a plain torch AdamW, a
``DataLoader`` and a linear schedule with warm-up; ``accelerator.accumulate`` accumulates gradients over 2 batches
(``accelerator.backward`` divides the loss), ``accelerator.clip_grad_norm_`` clips where gradients sync, and the
prepared optimizer and scheduler step only there. The same loop on the unwrapped torch module is the reference
(one process, no launcher): its losses, gradient norms and final weights are PyTorch's.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import jmp as smp
from tests.sharding.models import causal_lm, token_batches

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

# Accelerate's wrappers see the same model whatever its layout; fsdp4 x tp2 runs the same loop in
# test_training_loop.py, so the sharded case here is the cheapest to compile: parameters and state split 8 ways
LAYOUTS = {
    "replicated": {},
    "sdp8": {"sharded_data_parallel_degree": 8},
}


def accelerate_loop(model, examples):
    """Accelerate's loop (https://huggingface.co/docs/accelerate, gradient accumulation): losses and clip norms."""
    _fresh_accelerate_state()
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    dataloader = DataLoader(examples, batch_size=8)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, num_warmup_steps=1, num_training_steps=4)
    model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader, scheduler)
    model.train()
    losses, norms = [], []
    for batch in dataloader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms, accelerator.unwrap_model(model)


def _fresh_accelerate_state():
    """Accelerate keeps its process state in singletons: each loop starts from none, as a new script would."""
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    accelerate.state.GradientState._reset_state()


@pytest.fixture(autouse=True)
def _no_accelerate_state_left():
    yield
    _fresh_accelerate_state()  # later tests in this process see no Accelerator


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_accelerates_loop_trains_a_distributed_model_as_pytorch(layout):
    smp.init(LAYOUTS[layout])
    net = causal_lm("gpt2")
    examples = [{"input_ids": row, "labels": row} for row in torch.cat(token_batches(6))]
    expected, expected_norms, reference = accelerate_loop(copy.deepcopy(net), examples)
    losses, norms, model = accelerate_loop(smp.DistributedModel(net), examples)
    assert isinstance(model, smp.DistributedModel)  # prepared as it is: one process, nothing to wrap it in
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    np.testing.assert_allclose(norms, expected_norms, rtol=1e-5)
    assert max(expected_norms) > 1.0  # the clipping clipped
    trained = model.state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=0, atol=2e-5, msg=name)


def test_accelerates_mixed_precision_forward_runs_under_its_autocast():
    """``Accelerator(mixed_precision="bf16")`` sets ``model.forward`` to the forward under ``torch.autocast``: the
    wrapped model runs it, as ``nn.Module.__call__`` does (ignoring it would train in float32 without a word)."""
    smp.init({})
    net = causal_lm("gpt2")
    ids = token_batches(1)[0]
    _fresh_accelerate_state()
    accelerator = accelerate.Accelerator(mixed_precision="bf16", cpu=True)
    model = accelerator.prepare(smp.DistributedModel(copy.deepcopy(net)))
    outputs = model(input_ids=ids, labels=ids)
    accelerator.backward(outputs.loss)
    assert outputs.logits.dtype == torch.float32  # Accelerate's convert_outputs_to_fp32, recorded on the values
    by_accelerate = outputs.loss.item()

    explicit = smp.DistributedModel(copy.deepcopy(net))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = explicit(input_ids=ids, labels=ids).loss
    loss.backward()
    assert by_accelerate == loss.item()  # the same program: the forward under bf16 autocast
    full = smp.DistributedModel(net)
    in_float32 = full(input_ids=ids, labels=ids).loss
    in_float32.backward()
    assert by_accelerate != in_float32.item()
    assert by_accelerate == pytest.approx(in_float32.item(), rel=2e-2)
