"""The compiled step holds the collectives each strategy implies, counted in its optimized HLO."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import jmp as smp
from tests.front_end.helpers import named_grads
from tests.helpers import PooledNet, assert_close, classifier_step
from tests.sharding.models import causal_lm, lm_step, token_batches

pytest.importorskip("transformers")

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


def _collectives(name: str, config: dict) -> dict[str, int]:
    smp.init(config)
    model = smp.DistributedModel(causal_lm(name))
    hlo = lm_step.lower(model, token_batches(1)[0]).compile().as_text()
    return {kind: len(re.findall(rf" {kind}(?:-start)?\(", hlo)) for kind in KINDS}


def test_sharded_data_parallel_gathers_weights_and_reduces_gradients():
    counts = _collectives("gpt2", {"sharded_data_parallel_degree": 8})
    assert counts["all-gather"] >= 9  # every split weight is gathered for use (9 are split)
    # gradients: a reduce-scatter where XLA forms one (GPU, TPU); XLA:CPU emits all-reduce + dynamic-slice
    assert counts["reduce-scatter"] + counts["all-reduce"] >= 1


def test_tensor_parallel_all_reduces_and_does_not_gather_weights():
    counts = _collectives("llama", {"tensor_parallel_degree": 4})
    assert counts["all-reduce"] >= 2 * 2  # row-parallel outputs: attention and MLP of each of 2 layers
    assert counts["all-gather"] == 0


@pytest.mark.parametrize(
    "degrees",
    [
        {"sharded_data_parallel_degree": 8},
        {"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 4},
        {"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2},
    ],
    ids=["fsdp8", "tp2xfsdp4", "tp2xfsdp2"],
)
def test_sharded_data_parallel_gathers_weights_not_the_whole_batch(degrees):
    """FSDP moves weights; the activations stay split over the batch.

    Two layouts used to gather the whole batch's activations instead. The embedding table's features are split over
    fsdp, and the lookup's output carried that split down the residual stream with the batch whole: 14 whole-batch
    all-gathers a step for this 2-layer Llama at fsdp8, 16 at tp2 x fsdp4 (``sharding.embedding_outputs`` gathers
    the table for the lookup and lays its output out as the batch). The transposed gathering of a Linear's weight
    asked for its gradient whole, and XLA gathered every device's activations to compute it: 14 at tp2 x fsdp2 with
    hidden 64 (``sharding.gathering``). Left: the embedding's gradient (a scatter-add into its table) may gather the
    whole batch's output gradient once (here at fsdp8)."""
    smp.init(degrees)
    model = smp.DistributedModel(causal_lm("llama", hidden=256))
    ids = token_batches(1, batch=8, length=64)[0]
    hlo = lm_step.lower(model, ids).compile().as_text()
    whole_batch = rf"= \w+\[{ids.shape[0]},{ids.shape[1]},[\d,]*\]\S* all-gather(?:-start)?\(.*op_name=\"([^\"]*)\""
    sources = re.findall(whole_batch, hlo)
    assert len(sources) <= 1 and all("_take" in source for source in sources), sources  # the embedding's, if any
    assert len(re.findall(r" all-gather(?:-start)?\(", hlo)) >= 9  # the split weights are gathered for use


def test_expert_parallel_sends_tokens_all_to_all():
    counts = _collectives("mixtral", {"expert_parallel_degree": 4})
    # 2 MoE layers x 4 exchanges (rows, expert ids, used flags out; results back) forward, and backward
    assert counts["all-to-all"] >= 2 * 4


def test_data_parallel_pooling_reduces_gradients_and_moves_no_activations():
    torch.manual_seed(0)
    net = PooledNet()
    images = torch.randn(16, 1, 12, 12, generator=torch.Generator().manual_seed(1)).round()  # ties in the windows
    labels = torch.arange(16) % 10
    F.nll_loss(net(images), labels).backward()
    smp.init({"microbatches": 2})  # data parallel over the 8 devices
    model = smp.DistributedModel(PooledNet())
    model.load_state_dict(net.state_dict())
    hlo = classifier_step.lower(model, images, labels).compile().as_text()
    counts = {kind: len(re.findall(rf" {kind}(?:-start)?\(", hlo)) for kind in KINDS}
    # the pooling gradient's scatter stays on each device's rows (indexed by row, it gathered every row everywhere)
    assert counts["all-gather"] == 0 and counts["all-reduce"] >= 1, counts
    classifier_step(model, images, labels)
    grads = named_grads(model.grads)
    for name, p in net.named_parameters():  # each window's gradient to its first maximum, as torch's
        assert_close(grads[name], p.grad, 1e-5, floor=1e-6)
