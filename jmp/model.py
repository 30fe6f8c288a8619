"""SMP's ``smdistributed.modelparallel.torch.model`` path, for ``isinstance(model, smp.model.DistributedModel)``."""

from jmp.wrapped_model.distributed_model import DistributedModel

__all__ = ["DistributedModel"]
