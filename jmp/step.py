"""SMP's ``smdistributed.modelparallel.torch.step``: the ``step`` decorator and the ``StepOutput`` it returns
(``jmp.compiled_step.function``).

As in SMP, ``smp.step`` is the decorator, not this module, which is reached by its import path only
(``from smdistributed.modelparallel.torch.step import StepOutput``, for ``isinstance`` checks).
"""

from jmp.compiled_step.function import StepOutput, step

__all__ = ["StepOutput", "step"]
