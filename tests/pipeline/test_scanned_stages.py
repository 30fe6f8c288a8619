"""A pipeline over one layer stack: cut into equal layer counts a stage, each stage's layers one scan.

The program then holds each stage's layer body once, whatever the depth, and trains as PyTorch does, with the cut
made automatically or by hand.
"""

from __future__ import annotations

import collections
import logging
import re

import numpy as np
import pytest
import torch

import jmp as smp
from tests.front_end.helpers import named_grads
from tests.sharding.models import causal_lm, lm_step, token_batches

CONFIG = {"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True}


def lowered_ops(layers: int, caplog) -> tuple[collections.Counter, str]:
    """(the pipelined step's StableHLO operations by name, the partition log) for a Llama of ``layers``."""
    smp.init(CONFIG)
    model = smp.DistributedModel(causal_lm("llama", hidden=32, layers=layers))
    with caplog.at_level(logging.INFO, logger="jmp"):
        text = lm_step.lower(model, token_batches(1)[0]).as_text()
    partition = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Partition assignments"))
    caplog.clear()
    return collections.Counter(re.findall(r"= (?:\"?)([a-z_]+\.[a-z_]+)", text)), partition


def test_each_stage_runs_its_equal_share_of_the_layers_as_one_scan(caplog):
    """The program is the same at either depth: one layer body a stage, forward and backward, and each weight of a
    stage's layers read from its buffer as one slice, its gradient written back as one (not one a layer)."""
    ops_4, partition_4 = lowered_ops(4, caplog)
    ops_8, partition_8 = lowered_ops(8, caplog)
    assert ops_4["stablehlo.dot_general"] > 0 and ops_4 == ops_8, ops_8 - ops_4
    stage_0, stage_1 = partition_8.split("; stage 1: ")
    assert "model.layers.0-3" in stage_0 and "model.layers.4-7" in stage_1
    assert "model.embed_tokens" in stage_0 and "lm_head" in stage_1


TENSOR_PARALLEL = {"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2}


@pytest.mark.parametrize(
    "name, partition, degrees",
    [("llama", "automatic", {}), ("llama", "manual", {}), ("gpt2", "automatic", TENSOR_PARALLEL)],
    ids=["llama-automatic", "llama-manual", "gpt2-tp2xfsdp2"],
)
def test_scanned_stages_train_as_pytorch(name, partition, degrees):
    """Three AdamW steps of a 5-layer model at pp2, cut automatically (layers 0-2 / 3-4) or by hand (0-1 / 2-4): the
    first step's gradients and every loss as PyTorch's (float32 rounding only, as tests/pipeline/test_3d). Under
    tensor parallelism GPT-2's fused q/k/v split inside the scanned body needs the stage's constraints
    (``graph.run_equations`` replays the body); without them XLA moves it with a collective permute."""
    reference, module = causal_lm(name, hidden=32, layers=5), causal_lm(name, hidden=32, layers=5)
    config = dict(CONFIG) | degrees
    if partition == "manual":
        config |= {"auto_partition": False, "default_partition": 0}
        for layer in module.model.layers[2:]:
            smp.set_partition(layer, 1)
        smp.set_partition(module.model.norm, 1)
        smp.set_partition(module.lm_head, 1)
    smp.init(config)
    trains_as_pytorch(smp.DistributedModel(module), reference)


def test_equal_middle_stages_compile_once_and_train_as_pytorch():
    """pp4 over 8 layers: stages 1 and 2 (two layers each, nothing else) trace to the same program, compiled once:
    the stage switch holds an idle branch and a forward and a backward for each of the 3 distinct stages, not 4."""
    reference, module = causal_lm("llama", hidden=32, layers=8), causal_lm("llama", hidden=32, layers=8)
    smp.init({"pipeline_parallel_degree": 4, "microbatches": 4, "ddp": True})
    model = smp.DistributedModel(module)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3))
    text = lm_step.lower(model, token_batches(1)[0]).compile().as_text()
    (branches,) = re.findall(r"conditional\(.*branch_computations=\{([^}]*)\}", text)
    assert len(branches.split(",")) == 1 + 2 * 3, branches
    trains_as_pytorch(model, reference, optimizer)


def trains_as_pytorch(model: smp.DistributedModel, reference: torch.nn.Module, optimizer=None) -> None:
    """Three AdamW steps of ``model`` and of PyTorch's ``reference``: the same first gradients and losses."""
    optimizer = optimizer or smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3))
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    losses, torch_losses, grads, torch_grads = [], [], None, None
    for ids in token_batches(1) * 3:
        losses.append(float(lm_step(model, ids).reduce_mean()))
        grads = grads or named_grads(model.grads)
        optimizer.step()
        optimizer.zero_grad()
        loss = reference(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch_losses.append(float(loss))
        torch_grads = torch_grads or {n: p.grad.numpy().copy() for n, p in reference.named_parameters()}
        torch_optimizer.step()
        torch_optimizer.zero_grad()
    assert grads.keys() == torch_grads.keys()
    for name, expected in torch_grads.items():
        error = np.linalg.norm(grads[name] - expected) / max(np.linalg.norm(expected), 1e-12)
        assert error <= 1e-5, f"{name}: relative difference {error:.2e}"
    assert torch_losses[-1] < torch_losses[0]  # it trains
    np.testing.assert_allclose(losses, torch_losses, rtol=1e-5)
