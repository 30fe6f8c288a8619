"""Context parallelism: ``context_parallel_degree`` adds a "cp" mesh axis and every step input's sequence is split
over it; attention takes the ring (jmp.torch_bridge.lowering.ring_attention). Llama (grouped-query attention)
at cp 2 x fsdp 2 x tp 2, with padded rows, against PyTorch on the unsplit sequences: the loss and every gradient
after one step (relative 1e-5 per tensor), and the losses and parameters over three AdamW steps; Llama at cp 4 on
unpadded rows (causal attention in the ring's load-balanced order), the loss and every gradient; Llama in a pipeline
at pp 2 x cp 2 x dp 2 with padded rows, against PyTorch on the same microbatches.
(``benchmarks/context_parallel.py`` checks GPT-2 and Llama at cp 2, cp 4 and cp 2 x fsdp 2 x tp 2 the same way,
with the ring and with the all-gather form; the suite's time allows one model here.)
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as P

import jmp as smp
from jmp.errors import ConfigError
from jmp.runtime import mesh_state
from jmp.sharding.batch_spec import batch_spec
from tests.front_end.helpers import named_grads
from tests.sharding.models import VOCAB, causal_lm, token_batches

pytest.importorskip("transformers")


def _batch() -> dict[str, torch.Tensor]:
    """Four rows of 16 tokens, two of them right-padded (masked, their labels ignored), explicit positions."""
    ids = token_batches(1, batch=4, length=16)[0]
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0
    mask[2, 5:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    positions = torch.arange(16).expand(4, 16).contiguous()
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "position_ids": positions}


@smp.step
def lm_step(model, input_ids, attention_mask, labels, position_ids):
    out = model(
        input_ids=input_ids, attention_mask=attention_mask, labels=labels, position_ids=position_ids, use_cache=False
    )
    model.backward(out.loss)
    return out.loss


def _assert_close_per_tensor(got: dict, expected: dict, rtol: float) -> None:
    for key, want in expected.items():
        error = np.linalg.norm(np.asarray(got[key]) - want) / max(np.linalg.norm(want), 1e-12)
        assert error <= rtol, f"{key}: relative difference {error:.2e}"


def test_llama_at_cp2_fsdp2_tp2_equals_pytorch_over_three_adamw_steps():
    reference = causal_lm("llama")
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    smp.init({"context_parallel_degree": 2, "sharded_data_parallel_degree": 2, "tensor_parallel_degree": 2})
    assert dict(smp.get_mesh().shape) == {"pp": 1, "dp": 1, "fsdp": 2, "ep": 1, "cp": 2, "tp": 2}
    model = smp.DistributedModel(causal_lm("llama"))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.module.parameters(), lr=3e-3))
    for step in range(3):
        torch_optimizer.zero_grad()
        optimizer.zero_grad()
        expected_loss = reference(**_batch(), use_cache=False).loss
        expected_loss.backward()
        loss = float(lm_step(model, **_batch()).reduce_mean())
        np.testing.assert_allclose(loss, expected_loss.item(), rtol=1e-5, err_msg=f"step {step}")
        if step == 0:
            expected = {n: p.grad.numpy() for n, p in reference.named_parameters()}
            _assert_close_per_tensor(named_grads(model.grads), expected, 1e-5)
        torch_optimizer.step()
        optimizer.step()
    assert loss < float(np.log(VOCAB))  # it learnt: below a uniform guess
    # Adam moves a parameter whose gradient is near zero by about lr whatever the rounding noise in it says, so
    # the parameters are compared per tensor, at 1e-4 (measured: 1.6e-5 at most)
    _assert_close_per_tensor(model.state_dict(), {k: v.numpy() for k, v in reference.state_dict().items()}, 1e-4)


def test_the_sequence_dimension_is_split_over_cp_when_it_divides():
    smp.init({"context_parallel_degree": 4, "sharded_data_parallel_degree": 2})
    mesh = smp.get_mesh()
    assert mesh.axis_names == ("pp", "dp", "fsdp", "ep", "cp", "tp")
    data = ("dp", "fsdp", "ep")
    assert batch_spec((8, 16), 0, data, mesh) == P(data, "cp")  # [batch, sequence]
    assert batch_spec((8, 16, 32), 0, data, mesh) == P(data, "cp")  # [batch, sequence, features]
    assert batch_spec((8, 6), 0, data, mesh) == P(data)  # 6 does not divide over 4: kept whole
    assert batch_spec((8,), 0, data, mesh) == P(data)  # no sequence
    assert batch_spec((3, 8, 16), 1, data, mesh) == P(None, data, "cp")  # input_split_axes: the dimension after


def test_llama_in_a_pipeline_at_pp2_cp2_dp2_equals_pytorch_on_the_same_microbatches():
    """Inside a stage only that stage's devices run: the ring's transfers go as all-to-alls over cp, Hugging Face's
    shifts of positions and labels along the split sequence run on them gathered, and its padding mask is indexed
    whole (XLA's partitioner aborted on that gather under dp x cp and dp x tp)."""
    ids = token_batches(1, batch=8, length=16)[0]
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0
    mask[2, 5:] = 0
    mask[6, 3:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    reference = causal_lm("llama")
    # under SMP each data-parallel rank splits its own rows into microbatches: the 2 dp shards hold rows 0-3 and
    # 4-7, and microbatch m takes rows 2m, 2m + 1 of each; the step's loss is the mean of the microbatches' losses
    microbatches = [[0, 1, 4, 5], [2, 3, 6, 7]]
    expected_loss = sum(reference(**{k: v[rows] for k, v in batch.items()}).loss for rows in microbatches) / 2
    expected_loss.backward()
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "context_parallel_degree": 2})
    assert dict(smp.get_mesh().shape) == {"pp": 2, "dp": 2, "fsdp": 1, "ep": 1, "cp": 2, "tp": 1}
    model = smp.DistributedModel(causal_lm("llama"))
    loss = float(lm_step(model, **batch, position_ids=torch.arange(16).expand(8, 16)).reduce_mean())
    np.testing.assert_allclose(loss, expected_loss.item(), rtol=1e-5)
    expected = {n: p.grad.numpy() for n, p in reference.named_parameters()}
    _assert_close_per_tensor(named_grads(model.grads), expected, 1e-5)


def test_degree_one_leaves_the_mesh_without_cp():
    smp.init({"context_parallel_degree": 1})
    assert smp.get_mesh().axis_names == ("pp", "dp", "fsdp", "ep", "tp")
    with pytest.raises(ConfigError, match="context_parallel_degree \\(3\\) = 3 does not divide the 8 devices"):
        smp.init({"context_parallel_degree": 3})


def test_a_sequence_split_over_devices_of_two_processes_is_refused():
    # cp 2 x tp 2 over 2 processes of 2 devices: with "tp" then "cp" fastest, each cp pair spans both processes
    device = types.SimpleNamespace
    grid = np.array([[device(process_index=p) for p in (0, 1)] for _ in range(2)])  # [tp, cp]
    mesh = types.SimpleNamespace(axis_names=("tp", "cp"), devices=grid)
    with pytest.raises(ConfigError, match="belong to several of the"):
        mesh_state._check_sequences_within_processes(mesh, 2)
    mesh_state._check_sequences_within_processes(types.SimpleNamespace(axis_names=("cp", "tp"), devices=grid), 2)
