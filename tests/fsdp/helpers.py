"""A small Llama, its batches, and an FSDP training loop as people write it, for the FSDP tests."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

VOCAB = 128
STEPS = 2


def llama() -> torch.nn.Module:
    """A 2-layer Llama (hidden 64, vocab 128, grouped-query attention), the same weights at every call."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=32, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(config).train()


def batches(count: int = STEPS, rows: int = 8, length: int = 16) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (rows, length), generator=generator) for _ in range(count)]


def optimizer_for(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW with decay / no-decay groups (norm weights undecayed), as FSDP scripts build it."""
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if "norm" not in n], "weight_decay": 0.1},
        {"params": [p for n, p in named if "norm" in n], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=1e-2)


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data: list[torch.Tensor],
    clip: Callable[[], torch.Tensor] | None = None,
    norms: list[float] | None = None,
) -> list[float]:
    """The loop: forward, backward, clip (``clip()``, else ``torch.nn.utils.clip_grad_norm_``; the norms go to
    ``norms``), step, zero_grad, the loss read each step."""
    losses = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        norm = clip() if clip is not None else torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if norms is not None:
            norms.append(float(norm))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


class Run(NamedTuple):
    losses: list[float]
    state: dict[str, torch.Tensor]  # the model's final state_dict
    optimizer_state: dict[str, dict]  # the optimizer's state by parameter name
    norms: list[float]  # the gradients' norms before clipping


@functools.cache
def pytorch_run() -> Run:
    """The loop in plain PyTorch eager on ``llama()``."""
    model = llama()
    optimizer = optimizer_for(model)
    norms: list[float] = []
    losses = train(model, optimizer, batches(), norms=norms)
    names = {id(p): n for n, p in model.named_parameters()}
    state = {names[id(p)]: copy.deepcopy(s) for p, s in optimizer.state.items()}
    return Run(losses, copy.deepcopy(model.state_dict()), state, norms)


def checkpoints_and_host_copies(step, *args) -> tuple[int, int]:
    """(checkpointed regions, values moved to host memory) in the program ``step(*args)`` runs, from one trace."""
    import jax.extend.core as jex

    regions = copies = 0
    stack = [step.trace(*args).jaxpr.jaxpr]
    while stack:
        for eqn in stack.pop().eqns:
            regions += eqn.primitive.name == "remat2"
            to_host = any("Host" in str(d) for d in eqn.params.get("devices", ()))
            copies += eqn.primitive.name == "device_put" and to_host
            stack.extend(j.jaxpr if isinstance(j, jex.ClosedJaxpr) else j for j in jex.jaxprs_in_params(eqn.params))
    return regions, copies
