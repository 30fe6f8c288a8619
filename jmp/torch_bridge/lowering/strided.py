"""``as_strided``: a view of the input's row-major elements, gathered at indices fixed by the sizes and strides."""

from __future__ import annotations

import numpy as np
import torch

from jmp.torch_bridge.registry import register_lowering

T = torch.Tensor


@register_lowering(torch.as_strided, T.as_strided, view=True)
def as_strided(input, size, stride, storage_offset=None):
    size, stride = tuple(int(n) for n in size), tuple(int(s) for s in stride)
    if len(size) != len(stride):
        raise ValueError(f"as_strided: mismatch in length of strides and shape ({len(stride)} vs {len(size)})")
    positions = np.full((), int(storage_offset or 0), dtype=np.int64)
    for count, step in zip(size, stride):
        positions = positions[..., None] + np.arange(count, dtype=np.int64) * step
    if positions.size and (positions.min() < 0 or positions.max() >= input.size):
        raise ValueError(
            f"as_strided: size {list(size)}, stride {list(stride)} and offset {storage_offset or 0} reach element "
            f"{int(positions.max())} of a storage of {input.size} elements (the input's, row-major)"
        )
    return input.reshape(-1)[positions]
