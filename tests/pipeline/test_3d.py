"""3D parallelism: pipeline stages that are themselves split over tensor, sharded-data and expert parallelism.

Each layout trains three AdamW steps beside PyTorch on the same weights and batch: the loss and every
gradient of the first step within 1e-5 (relative, per tensor), the three losses within 1e-5 (one batch,
learnt by heart). The stages'
parameters and optimizer state are split over their other axes as well as over ``pp``.
"""

from __future__ import annotations

import collections
import math

import jax
import numpy as np
import pytest
import torch

import jmp as smp
from jmp.pipeline import engine
from tests.front_end.helpers import named_grads
from tests.sharding.models import causal_lm, lm_step, token_batches

pytest.importorskip("transformers")

LAYOUTS = {
    "gpt2-pp2xtp2xfsdp2": ("gpt2", {"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2}),
    # the layout; with dp 1 ZeRO-1 has nothing to split, so the next layout checks it with dp 2
    "llama-pp2xfsdp4-zero1": ("llama", {"sharded_data_parallel_degree": 4, "shard_optimizer_state": True}),
    "llama-pp2xfsdp2xdp2-zero1": ("llama", {"sharded_data_parallel_degree": 2, "shard_optimizer_state": True}),
    "mixtral-pp2xep2xfsdp2": ("mixtral", {"expert_parallel_degree": 2, "sharded_data_parallel_degree": 2}),
}
STEPS, LR = 3, 3e-3


def _torch_run(name: str, batches: list[torch.Tensor]) -> tuple[dict, list[float], dict]:
    """PyTorch's first-step gradients and losses, and the initial weights."""
    net = causal_lm(name)
    weights = {k: v.clone() for k, v in net.state_dict().items()}
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR)
    losses, first = [], None
    for ids in batches:
        optimizer.zero_grad()
        loss = net(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        first = first or {n: p.grad.numpy().copy() for n, p in net.named_parameters()}
        losses.append(float(loss))
        optimizer.step()
    return first, losses, weights


def _per_device_bytes(tree) -> int:
    held: collections.Counter = collections.Counter()
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device.id] += shard.data.nbytes
    return max(held.values())


@pytest.fixture(scope="module", params=list(LAYOUTS), ids=list(LAYOUTS))
def trained(request):
    name, degrees = LAYOUTS[request.param]
    batches = token_batches(1) * STEPS  # one batch learnt by heart: the loss must fall
    expected_grads, expected_losses, weights = _torch_run(name, batches)
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, **degrees})
    net = causal_lm(name)
    net.load_state_dict(weights)
    model = smp.DistributedModel(net)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.module.parameters(), lr=LR))
    losses, grads = [], None
    for ids in batches:
        optimizer.zero_grad()
        losses.append(float(lm_step(model, ids).reduce_mean()))
        grads = grads or named_grads(model.grads)
        optimizer.step()
    return model, optimizer, degrees, (grads, losses), (expected_grads, expected_losses)


def test_gradients_and_three_adamw_steps_equal_pytorch(trained):
    model, _, _, (grads, losses), (expected_grads, expected_losses) = trained
    assert grads.keys() == expected_grads.keys()
    for key, value in grads.items():
        expected = expected_grads[key]
        error = np.linalg.norm(value - expected) / max(np.linalg.norm(expected), 1e-12)
        assert error <= 1e-5, f"{key}: relative difference {error:.2e}"
    assert expected_losses[-1] < expected_losses[0]  # it trains
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)


def test_stage_parameters_are_split_over_their_other_axes(trained):
    """Per device: the stage buffers hold at most 1.15x the stage's parameters split as each one's spec says."""
    model, optimizer, degrees, _, _ = trained
    layout, mesh = model.pipeline.layout, model.layout.mesh
    shares = [0.0] * mesh.shape["pp"]
    for name, places in layout.places.items():
        axes = [a for entry in layout.param_shardings[name].spec if entry for a in np.atleast_1d(entry)]
        nbytes = math.prod(layout.packing[name].shape) * layout.buffers[places[0].key].dtype.itemsize
        for place in places:
            shares[place.stage] += nbytes / math.prod(mesh.shape[a] for a in axes)
    ideal = max(shares)
    assert ideal <= 0.6 * max(layout.stage_bytes())  # the specs split most of a stage (over fsdp, and tp or ep)
    held = _per_device_bytes(model.training_state.params)
    assert held <= 1.15 * ideal, f"{held} bytes on the fullest device vs {ideal:.0f} ideal"
    zero1 = mesh.shape["dp"] if degrees.get("shard_optimizer_state") else 1
    state = _per_device_bytes(optimizer.opt_state)  # AdamW: two moments per parameter, and a step count
    assert state <= 1.15 * 2 * ideal / zero1 + 1024, f"{state} bytes of optimizer state vs {2 * ideal / zero1:.0f}"


def test_a_collective_permute_inside_stage_code_is_refused_before_it_runs():
    """Only one stage's devices run a branch; a collective permute there would wait for all of them."""
    mesh = jax.make_mesh((2, 4), ("pp", "dp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    pairs = [(i, (i + 1) % 4) for i in range(4)]

    def per_device(x):
        branches = [lambda v: jax.lax.ppermute(v, "dp", pairs), lambda v: v * 2]
        return jax.lax.switch(jax.lax.axis_index("pp"), branches, x)

    spec = jax.sharding.PartitionSpec(("pp", "dp"))
    program = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=spec))
    compiled = program.lower(jax.ShapeDtypeStruct((8,), np.float32)).compile()
    with pytest.raises(smp.PipelineError, match="collective permute inside a pipeline stage"):
        engine.check_compiled(compiled)


def test_llama_under_tensor_parallelism_keeps_its_embedding_rows_without_a_collective_permute():
    """Llama pp2 x tp2 x fsdp2: its stage 0 keeps the embedding rows it gathered (the norm's input) for its
    backward; XLA reordered that gather's output over tp and fsdp with a collective permute (refused) until the
    rows were gathered whole along their features."""
    ids = token_batches(1)[0]
    reference = causal_lm("llama")
    reference(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, **LAYOUTS["gpt2-pp2xtp2xfsdp2"][1]})
    model = smp.DistributedModel(causal_lm("llama"))
    lm_step(model, ids)
    for key, value in named_grads(model.grads).items():
        expected = reference.get_parameter(key).grad.numpy()
        error = np.linalg.norm(value - expected) / max(np.linalg.norm(expected), 1e-12)
        assert error <= 1e-5, f"{key}: relative difference {error:.2e}"


CHECKPOINTED = {
    "gpt2-pp2xtp2xfsdp2": ("gpt2", LAYOUTS["gpt2-pp2xtp2xfsdp2"][1], "transformer.h"),
    "mixtral-pp2xep2xfsdp2": ("mixtral", LAYOUTS["mixtral-pp2xep2xfsdp2"][1], "model.layers"),
    "mixtral-ep4-unpipelined": (
        "mixtral",
        {"expert_parallel_degree": 4, "pipeline_parallel_degree": 1, "microbatches": 1},
        "model.layers",
    ),
}


@pytest.mark.parametrize("case", CHECKPOINTED)
def test_layers_checkpointed_inside_sharded_stages_equal_pytorch(case):
    """Activation checkpointing of each layer inside a stage: the same loss and gradients as PyTorch."""
    name, degrees, layers = CHECKPOINTED[case]
    ids = token_batches(1)[0]
    reference = causal_lm(name)
    reference(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    expected = {n: p.grad.numpy() for n, p in reference.named_parameters()}
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, **degrees})
    model = smp.DistributedModel(causal_lm(name))
    smp.set_activation_checkpointing(model.module.get_submodule(layers), strategy="each")
    assert "remat" in str(lm_step.trace(model, ids).jaxpr)  # the layers are checkpointed regions
    lm_step(model, ids)
    for key, value in named_grads(model.grads).items():
        error = np.linalg.norm(value - expected[key]) / max(np.linalg.norm(expected[key]), 1e-12)
        assert error <= 1e-5, f"{key}: relative difference {error:.2e}"
