"""``smdistributed.dataparallel`` (SageMaker's data-parallel library, SMDDP) as jmp's launched processes see it:
only what SMP v2 scripts import from it, ``smdistributed.dataparallel.torch.torch_smddp``, which registers the
``"smddp"`` backend of ``torch.distributed``. Data parallelism itself is jmp's (the ``dp`` and ``fsdp`` mesh axes)."""
