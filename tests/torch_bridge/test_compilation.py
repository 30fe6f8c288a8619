"""A converted module traces once per input shape: the torch code runs only at trace time."""

import jax
import jax.numpy as jnp
from flax import nnx

import jmp
from jmp.examples.models import GroupedNet


def test_one_compilation_per_input_shape():
    converted = jmp.torch_bridge.convert(GroupedNet().eval())
    graphdef, state = nnx.split(converted)
    traces = []

    @jax.jit
    def forward(state, x):
        traces.append(x.shape)
        return nnx.merge(graphdef, state)(x)

    forward(state, jnp.ones((2, 1, 28, 28)))
    forward(state, jnp.zeros((2, 1, 28, 28)))
    assert traces == [(2, 1, 28, 28)]
    assert forward._cache_size() == 1

    forward(state, jnp.ones((3, 1, 28, 28)))
    assert traces == [(2, 1, 28, 28), (3, 1, 28, 28)]
    assert forward._cache_size() == 2


def test_nnx_jit_reuses_the_compiled_forward():
    converted = jmp.torch_bridge.convert(GroupedNet().eval())
    traces = []

    @nnx.jit
    def forward(module, x):
        traces.append(x.shape)
        return module(x)

    for _ in range(3):
        forward(converted, jnp.ones((2, 1, 28, 28)))
    assert len(traces) == 1
