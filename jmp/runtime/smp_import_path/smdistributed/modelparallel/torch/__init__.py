"""``smdistributed.modelparallel.torch`` is jmp: this module replaces itself with ``jmp`` on import, and its
submodules (``.nn``, ``.amp``, ``.patches.checkpoint``, ...) are jmp's of the same name."""

import sys

import jmp
from jmp.runtime import smp_aliases

smp_aliases.install()
smp_aliases.register_shadowed(__name__)  # .step and .checkpoint: their names on the package are other objects
sys.modules[__name__] = jmp
