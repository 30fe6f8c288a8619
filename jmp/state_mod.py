"""SMP's ``smdistributed.modelparallel.torch.state_mod``: the module of ``smp.state`` (``jmp.runtime.smp_state``)."""

from jmp.runtime.smp_state import state

__all__ = ["state"]
