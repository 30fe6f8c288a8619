"""Standard torch layers as Flax NNX modules (torch names and layouts, JAX forward); importing registers them."""

from jmp.torch_bridge.layers import (  # noqa: F401  (imported for their registrations)
    attention,
    containers,
    convolution,
    dropout,
    embedding,
    functional,
    linear,
    normalization,
)
