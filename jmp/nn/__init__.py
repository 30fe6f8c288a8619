"""``smp.nn``: SMP's distributed layers as the plain torch layers they extend, split over ``tp`` by jmp's rules.

Each keeps its torch base's parameters, forward and ``state_dict`` keys and takes SMP's constructor arguments;
``jmp.sharding.tensor_parallel`` gives its parameters a ``PartitionSpec`` over ``tp`` and XLA inserts the
collectives. ``DistributedLinear`` is split as a Megatron pair where the rules pair it, else column-parallel;
``DistributedEmbedding`` over the vocabulary; ``FusedLayerNorm`` stays whole; the transformer classes
(``jmp.nn.transformer``) by heads and as a Megatron MLP pair.
"""

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
