"""SMP's ``smdistributed.modelparallel.torch.model``: the module that holds ``DistributedModel``.

Scripts and tools test ``isinstance(model, smp.model.DistributedModel)`` (Hugging Face's ``Trainer`` does), so the
path is SMP's; the class lives in ``jmp.wrapped_model``, which may not take SMP's public name.
"""

from jmp.wrapped_model.distributed_model import DistributedModel

__all__ = ["DistributedModel"]
