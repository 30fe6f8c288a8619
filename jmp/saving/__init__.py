"""Saving and resuming: SMP's checkpoints (partial on Orbax, full as torch state_dicts) and ``smp.save``/``load``."""

from jmp.saving.checkpoints import resume_from_checkpoint, save_checkpoint
from jmp.saving.objects import load, save
from jmp.saving.partial import wait_for_saves
from jmp.saving.preemption import set_preemption_user_content

__all__ = [
    "load",
    "resume_from_checkpoint",
    "save",
    "save_checkpoint",
    "set_preemption_user_content",
    "wait_for_saves",
]
