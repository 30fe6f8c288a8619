"""``smp.nn``: SMP's distributed layers as torch modules that jmp converts like their torch base and splits over ``tp``.

In SMP these classes hold one tensor-parallel rank's shard and run their own
collectives. Here each is the plain torch layer it extends (same parameters,
same forward, same ``state_dict`` keys), built with SMP's constructor
arguments; jmp's tensor-parallel rules (``jmp.sharding.tensor_parallel``) give
its parameters a ``PartitionSpec`` over ``tp`` and XLA inserts the collectives:

- ``DistributedLinear``: split as a Megatron pair where jmp's rules pair it
  (by its attribute name, e.g. ``fc1`` / ``fc2``, or as two consecutive linears
  whose sizes chain: the first column-, the second row-parallel); otherwise
  column-parallel (its output features split).
- ``DistributedEmbedding``: split over the vocabulary.
- ``FusedLayerNorm``: ``nn.LayerNorm``; its parameters stay whole.
- ``DistributedTransformerLMHead`` / ``DistributedTransformer`` / ``DistributedTransformerLayer`` /
  ``DistributedAttentionLayer`` / ``DistributedTransformerOutputLayer``: plain-torch transformer layers
  (see ``jmp.nn.transformer``) whose attention is split by heads and MLP as a Megatron pair.

They are split when tensor parallelism is on for them (``smp.tensor_parallelism()``,
``smp.set_tensor_parallelism``, or no module marked at all), as any module is.
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
