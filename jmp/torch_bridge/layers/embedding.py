"""nn.Embedding (weight [num_embeddings, dim]; the padding row gets no gradient)."""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import nn

from jmp.errors import ConversionError
from jmp.torch_bridge import dispatch, index_checks, replica_calls
from jmp.torch_bridge.convert import register_layer
from jmp.torch_bridge.lowering.nn_functional import embedding_lookup
from jmp.torch_bridge.module import ArrayModule


@register_layer(nn.Embedding)
class Embedding(ArrayModule):
    def __init__(self, torch_module: nn.Embedding, path: str, converter: Any):
        if torch_module.max_norm is not None or torch_module.scale_grad_by_freq:
            raise ConversionError(
                f"'{path}': Embedding with max_norm or scale_grad_by_freq changes weights or gradients "
                "in ways the JAX lowering does not reproduce; remove those options to convert it."
            )
        super().__init__(torch_module, path, converter)
        self.num_embeddings = torch_module.num_embeddings
        self.embedding_dim = torch_module.embedding_dim
        self.padding_idx = torch_module.padding_idx

    def forward(self, input):
        index_checks.embedding_check(input, self.num_embeddings, dispatch.where())
        return replica_calls.call(F.embedding, embedding_lookup, (input, self.weight[...], self.padding_idx), {})
