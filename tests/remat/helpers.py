"""Models, a causal-LM step, and readers of a step's jaxpr for the activation-checkpointing tests."""

from __future__ import annotations

import collections
import functools

import jax.extend.core as jex
import pytest
import torch

import jmp as smp
from tests.front_end.helpers import named_grads
from tests.helpers import assert_close

transformers = pytest.importorskip("transformers")

VOCAB = 96


def gpt2(layers: int = 3, width: int = 32, positions: int = 32, vocab: int = VOCAB, **config) -> torch.nn.Module:
    """A GPT-2 causal LM from a small config (no download), dropout 0.1 on, same weights for the same arguments."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=vocab, n_embd=width, n_layer=layers, n_head=4, n_positions=positions, **config
    )
    return transformers.AutoModelForCausalLM.from_config(cfg).train()


@smp.step
def lm_step(model, ids):
    out = model(input_ids=ids, labels=ids)
    model.backward(out.loss)
    return out.loss


def token_batch(batch: int = 8, length: int = 16, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(3))


def lm_loss_and_grads(model: smp.DistributedModel, ids: torch.Tensor) -> tuple[float, dict]:
    loss = lm_step(model, ids)
    return float(loss.reduce_mean()), named_grads(model.grads)


@functools.cache
def lm_without_checkpointing(microbatches: int = 1) -> tuple[float, dict]:
    """Loss and gradients of ``gpt2()`` on ``token_batch(8 * microbatches)``, no checkpointing (computed once)."""
    smp.init({"microbatches": microbatches})
    return lm_loss_and_grads(smp.DistributedModel(gpt2()), token_batch(8 * microbatches))


def assert_same_grads(actual: dict, expected: dict, rtol: float = 1e-6) -> None:
    """Every gradient equal up to ``rtol`` of its tensor's largest magnitude."""
    assert actual.keys() == expected.keys()
    largest = max(float(abs(g).max()) for g in expected.values())
    for name, grad in expected.items():
        assert_close(actual[name], grad, rtol, floor=1e-3 * largest)


def equations(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in it (scan bodies, jit calls, checkpoints)."""
    stack = [jaxpr.jaxpr if isinstance(jaxpr, jex.ClosedJaxpr) else jaxpr]
    while stack:
        for eqn in stack.pop().eqns:
            yield eqn
            stack.extend(j.jaxpr if isinstance(j, jex.ClosedJaxpr) else j for j in jex.jaxprs_in_params(eqn.params))


def primitives(step, *args) -> collections.Counter:
    """How often each primitive occurs in the program ``step(*args)`` runs."""
    return collections.Counter(eqn.primitive.name for eqn in equations(step.trace(*args).jaxpr))


def saved_shapes(step, *args) -> collections.Counter:
    """Shapes of the values the backward pass's recomputations start from (inputs and what the policy keeps)."""
    return collections.Counter(
        tuple(v.aval.shape)
        for eqn in equations(step.trace(*args).jaxpr)
        if eqn.primitive.name == "remat2"
        for v in eqn.invars
    )


def recomputations(step, *args) -> int:
    """How many checkpointed regions the step's backward pass recomputes."""
    return primitives(step, *args)["remat2"]


def host_transfers(step, *args) -> int:
    """How many values the step program moves to host memory (``device_put`` to the host memory space)."""
    return sum(
        eqn.primitive.name == "device_put" and any("Host" in str(d) for d in eqn.params.get("devices", ()))
        for eqn in equations(step.trace(*args).jaxpr)
    )
