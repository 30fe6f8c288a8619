"""SMP v2's ``torch.sagemaker`` API on jmp (``import jmp.tsm as tsm``; under ``jmp.launch``, ``torch.sagemaker``)."""

from jmp.tsm.initialization import init, is_initialized
from jmp.tsm.transformation import transform
from jmp.tsm.tsm_state import state

__all__ = ["init", "is_initialized", "state", "transform"]
