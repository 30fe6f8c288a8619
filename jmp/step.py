"""SMP's ``smdistributed.modelparallel.torch.step`` path (``StepOutput``); ``smp.step`` is the decorator."""

from jmp.compiled_step.function import StepOutput, step

__all__ = ["StepOutput", "step"]
