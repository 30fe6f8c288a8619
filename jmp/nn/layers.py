"""``DistributedLinear``, ``DistributedEmbedding``, ``FusedLayerNorm``: torch layers with SMP's arguments."""

from __future__ import annotations

import torch
from torch import nn


class DistributedLinear(nn.Linear):
    """SMP's ``smp.nn.DistributedLinear``: an ``nn.Linear`` of the global sizes, split over ``tp`` by jmp's rules."""


class DistributedEmbedding(nn.Embedding):
    """SMP's ``smp.nn.DistributedEmbedding``: an ``nn.Embedding`` of the whole vocabulary, split over it by jmp.

    As SMP's, a new table is drawn from N(0, ``initializer_range``) (the padding row zeroed);
    ``_skip_allgather`` / ``_skip_scatter_and_merge`` tuned SMP's own collectives and have no effect here.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: torch.Tensor | None = None,
        initializer_range: float = 0.02,
        _skip_allgather: bool = False,
        _skip_scatter_and_merge: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__(
            num_embeddings, embedding_dim, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse, _weight,
            device=device, dtype=dtype,
        )  # fmt: skip
        if _weight is None and not self.weight.is_meta:
            with torch.no_grad():
                self.weight.normal_(0.0, initializer_range)
                if self.padding_idx is not None:
                    self.weight[self.padding_idx].zero_()


class FusedLayerNorm(nn.LayerNorm):
    """SMP's ``smp.nn.FusedLayerNorm`` (apex's fused layer norm): ``nn.LayerNorm``; XLA fuses it."""

    def __init__(
        self,
        normalized_shape: int | list[int] | torch.Size,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, device=device, dtype=dtype)
