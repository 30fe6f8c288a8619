"""The lowering families; importing this package fills the registry."""

from jmp.torch_bridge.lowering import (  # noqa: F401  (imported for their registrations)
    activations,
    attention,
    autograd_function,
    complex_numbers,
    control_flow,
    conversions,
    convolution,
    elementwise,
    factories,
    fft,
    indexing,
    initialisers,
    linalg,
    losses,
    nn_functional,
    normalization,
    random,
    reductions,
    shape,
    sliding_blocks,
)
