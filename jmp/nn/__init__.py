"""``smp.nn``: SMP's distributed layers as the plain torch layers they extend, split over ``tp`` by jmp's rules."""

from jmp.nn.layers import DistributedEmbedding, DistributedLinear, FusedLayerNorm
from jmp.nn.transformer import (
    DistributedAttentionLayer,
    DistributedTransformer,
    DistributedTransformerLayer,
    DistributedTransformerLMHead,
    DistributedTransformerOutputLayer,
)

__all__ = [
    "DistributedAttentionLayer",
    "DistributedEmbedding",
    "DistributedLinear",
    "DistributedTransformer",
    "DistributedTransformerLMHead",
    "DistributedTransformerLayer",
    "DistributedTransformerOutputLayer",
    "FusedLayerNorm",
]
