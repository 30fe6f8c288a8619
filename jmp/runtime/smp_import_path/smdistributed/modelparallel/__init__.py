"""``smdistributed.modelparallel``: its ``torch`` subpackage is jmp (see ``jmp.runtime.smp_aliases``)."""

# The SMP v1 release whose API jmp follows; tools compare it (Hugging Face takes SMP >= 1.10's code paths).
__version__ = "1.15.0"
