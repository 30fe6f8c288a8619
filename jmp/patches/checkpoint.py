"""``from jmp.patches.checkpoint import checkpoint, checkpoint_sequential``, as SMP's patches module offers."""

from jmp.remat.api import checkpoint, checkpoint_sequential

__all__ = ["checkpoint", "checkpoint_sequential"]
