"""PyTorch ``nn.Module`` -> Flax NNX, with torch ops lowered to JAX.

converted = jmp.torch_bridge.convert(torch_module)
logits = converted(jnp.asarray(x))          # jax.jit / nnx.grad friendly
torch_module.load_state_dict(jmp.torch_bridge.to_state_dict(converted))
"""

from jmp.torch_bridge import layers as _layers  # noqa: F401  (registers the standard layers)
from jmp.torch_bridge import lowering as _lowering  # noqa: F401  (fills the lowering registry)
from jmp.torch_bridge.convert import convert, register_layer
from jmp.torch_bridge.module import (
    Buffer,
    CallHook,
    GenericModule,
    TorchModule,
    bound_tensors,
    call_hooks,
    torch_forward,
)
from jmp.torch_bridge.registry import register_lowering
from jmp.torch_bridge.state_dict import named_variables, to_state_dict, torch_name
from jmp.torch_bridge.tensor import JaxTensor

__all__ = [
    "Buffer",
    "CallHook",
    "GenericModule",
    "JaxTensor",
    "TorchModule",
    "bound_tensors",
    "call_hooks",
    "convert",
    "named_variables",
    "register_layer",
    "register_lowering",
    "to_state_dict",
    "torch_forward",
    "torch_name",
]
