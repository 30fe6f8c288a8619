"""Pipeline parallelism: the model cut into stages over the ``pp`` mesh axis, microbatches flowing through.

``partition``/``set_partition`` place modules by hand; otherwise ``placement.automatic`` balances the
stages. ``stepping.Pipeline`` is what a ``DistributedModel`` keeps: the cut, and where each stage's
parameters live (``layout``). The step program runs ``engine`` under a ``schedule``.
"""

from jmp.pipeline.placement import partition, set_partition

__all__ = ["partition", "set_partition"]
