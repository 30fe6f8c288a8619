"""jmp: SageMaker-style model parallelism for PyTorch models, on JAX/XLA."""

from jmp import torch_bridge
from jmp.errors import (
    ConversionError,
    JmpError,
    LoweringError,
    TracedControlFlowError,
    UnsupportedOpError,
)

__version__ = "0.1.0"

__all__ = [
    "ConversionError",
    "JmpError",
    "LoweringError",
    "TracedControlFlowError",
    "UnsupportedOpError",
    "torch_bridge",
]
