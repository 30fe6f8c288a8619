"""``variable_writes.write``: ``variable[...] = value`` without asking a tracer for its sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jmp.torch_bridge.variable_writes import write


@pytest.mark.parametrize(
    "value",
    [
        np.arange(6, dtype=np.float32).reshape(2, 3),  # the Variable's shape and dtype
        np.arange(6, dtype=np.float32).reshape(2, 3).astype(jnp.bfloat16),  # cast, as .at[...].set casts
        np.float32(2.5),  # broadcast
    ],
    ids=["same", "cast", "broadcast"],
)
def test_a_traced_write_leaves_what_an_indexed_assignment_leaves_without_reading_the_tracers_sharding(
    monkeypatch, value
):
    def written(assign):
        def run(x):
            variable = nnx.BatchStat(jnp.zeros((2, 3), jnp.float32))
            assign(variable, x)
            return variable.get_value()

        return jax.jit(run)(value)

    def indexed(variable, x):
        variable[...] = x

    expected = written(indexed)
    asked = []
    sharding = jax.core.Tracer.sharding
    monkeypatch.setattr(jax.core.Tracer, "sharding", property(lambda t: asked.append(t) or sharding.fget(t)))
    result = written(write)
    assert not asked  # on a tracer, .sharding builds an error message that walks the whole trace
    assert result.dtype == expected.dtype == jnp.float32
    np.testing.assert_array_equal(result, expected)


def test_a_concrete_write_keeps_the_variables_sharding():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    variable = nnx.BatchStat(jax.device_put(jnp.zeros((4,)), sharding))
    write(variable, jnp.arange(4.0))
    np.testing.assert_array_equal(variable.get_value(), np.arange(4.0))
    assert variable.get_value().sharding == sharding
