"""``smdistributed`` as SageMaker's images install it, here for jmp: ``python -m jmp.launch`` puts this directory
first on its processes' ``PYTHONPATH`` so that SMP scripts, and tools that look for SMP
(``importlib.util.find_spec("smdistributed")``), find it; ``smdistributed.modelparallel.torch`` is jmp."""
