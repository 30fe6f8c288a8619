"""SMP's ``smdistributed.modelparallel.torch.checkpoint`` path (``jmp.saving``); ``smp.checkpoint`` is remat's."""

from jmp.saving import load, resume_from_checkpoint, save, save_checkpoint

__all__ = ["load", "resume_from_checkpoint", "save", "save_checkpoint"]
