"""SMP's ``smdistributed.modelparallel.torch.checkpoint``: ``save`` / ``load`` and ``save_checkpoint`` /
``resume_from_checkpoint`` (``jmp.saving``).

As in SMP, the package's own ``smp.checkpoint`` is another object, the activation-checkpointing function
(``smp.checkpoint(module, *args)``); this module is reached by its import path only
(``from smdistributed.modelparallel.torch.checkpoint import save_checkpoint``).
"""

from jmp.saving import load, resume_from_checkpoint, save, save_checkpoint

__all__ = ["load", "resume_from_checkpoint", "save", "save_checkpoint"]
