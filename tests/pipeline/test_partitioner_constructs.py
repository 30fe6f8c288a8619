"""The XLA partitioner construct behind pipeline x tensor parallelism, reduced to a minimal JAX program.

Inside a ``shard_map`` manual over ``pp`` only (the pipeline's), with ``lax.switch`` on the stage, a gather
whose gathered axis is split over an automatic mesh axis (cross entropy's ``take_along_axis`` on logits
split over ``tp`` by the vocabulary) aborts the process in XLA's SPMD partitioner:

    spmd_partitioner_util.cc:497 Check failed: partition_group_list.num_replica_groups() * ...
    (ExpandDeviceGroupsWithIota <- AllReduceAlongShardingDims <- PartitionGatherTrivialSlicedOperandDimensions)

``XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.pipeline.test_partitioner_constructs
take_along_axis`` runs that program (and aborts, with jax 0.10.2). jmp's cross entropy picks the target's
log-probability as a masked sum instead (the same value exactly), which partitions into a local sum and one
all-reduce over ``tp``; the test runs that form.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jmp.torch_bridge.lowering.losses import _pick

VOCAB, HIDDEN = 32, 16


def stage_losses(pick: str) -> np.ndarray:
    """Each stage's loss of the minimal program: logits split over tp by the vocabulary, one pick per token."""
    mesh = jax.make_mesh((2, 2, 2), ("pp", "dp", "tp"), axis_types=(AxisType.Auto,) * 3)
    inside = mesh.abstract_mesh.update_axis_types({"pp": AxisType.Manual})

    def nll(logits, ids):
        logp = jax.nn.log_softmax(logits, -1)
        if pick == "take_along_axis":
            return -jnp.take_along_axis(logp, ids[..., None], -1).sum()
        return -_pick(logp, ids, logp.ndim - 1).sum()

    def per_device(w, x, ids):
        w = jax.lax.with_sharding_constraint(w[0], NamedSharding(inside, P(None, "tp")))
        branches = [lambda w: nll(x @ w, ids), lambda w: 2 * nll(jnp.tanh(x @ w), ids)]
        return jax.lax.switch(jax.lax.axis_index("pp"), branches, w)[None]

    w = jax.device_put(jnp.linspace(-1, 1, 2 * HIDDEN * VOCAB).reshape(2, HIDDEN, VOCAB), NamedSharding(mesh, P("pp")))
    x = jax.device_put(jnp.linspace(-1, 1, 4 * 4 * HIDDEN).reshape(4, 4, HIDDEN), NamedSharding(mesh, P("dp")))
    ids = jax.device_put(jnp.arange(16).reshape(4, 4) % VOCAB, NamedSharding(mesh, P("dp")))
    program = jax.shard_map(
        per_device, mesh=mesh, in_specs=(P("pp"), P(), P()), out_specs=P("pp"), axis_names={"pp"}, check_vma=False
    )
    return np.asarray(jax.jit(program)(w, x, ids))


def test_the_masked_sum_partitions_inside_the_pipeline_and_equals_the_gather():
    w = np.linspace(-1, 1, 2 * HIDDEN * VOCAB).reshape(2, HIDDEN, VOCAB)
    x = np.linspace(-1, 1, 4 * 4 * HIDDEN).reshape(4, 4, HIDDEN)
    ids = np.arange(16).reshape(4, 4) % VOCAB

    def expected(stage: int) -> float:
        logits = x @ w[stage] if stage == 0 else np.tanh(x @ w[stage])
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        return -(1 + stage) * np.take_along_axis(logp, ids[..., None], -1).sum()

    np.testing.assert_allclose(stage_losses("masked_sum"), [expected(0), expected(1)], rtol=1e-5)


if __name__ == "__main__":
    print(stage_losses(sys.argv[1] if len(sys.argv) > 1 else "masked_sum"))
