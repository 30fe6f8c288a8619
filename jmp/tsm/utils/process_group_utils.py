"""``torch.sagemaker.utils.process_group_utils``: ``get_global_ranks``, the ranks of a process group."""

from __future__ import annotations

import torch.distributed as dist


def get_global_ranks(process_group: dist.ProcessGroup | None = None) -> list[int]:
    """The global ranks of ``process_group``'s members, in its order (None: every process)."""
    group = dist.group.WORLD if process_group is None else process_group
    return list(dist.get_process_group_ranks(group))
