"""Layer stacks compiled once: a model's repeated identical layers (a ``ModuleList`` of decoder layers) run as one
``jax.lax.scan`` over their stacked parameters, so compile time does not grow with depth.

``detection`` finds the stacks when a model is wrapped; ``storage`` keeps each stack weight as one array of all
its layers (``jmp.wrapped_model.parameter_store.StackStore``); ``scan`` is the call hook turning their consecutive calls
into one scan while a step traces; ``pending`` holds a layer output until something reads it.
"""

from jmp.stacks.detection import LayerStack, find_stacks
from jmp.stacks.scan import StackedLayers
from jmp.stacks.storage import stacked_groups

__all__ = ["LayerStack", "StackedLayers", "find_stacks", "stacked_groups"]
