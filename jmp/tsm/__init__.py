"""SMP v2's ``torch.sagemaker`` API on jmp.

In a plain process: ``import jmp.tsm as tsm``. Under ``python -m jmp.launch``, ``import torch.sagemaker as tsm``
(and every ``torch.sagemaker.X`` a script imports) is this package (``jmp.runtime.smp_aliases``), so SMP v2
scripts run with no edit; ``import jmp`` alone leaves ``torch`` without a ``sagemaker``.

    import torch.sagemaker as tsm
    tsm.init()                      # SMP v2's config (SM_HP_MP_PARAMETERS), a dict or a JSON file -> jmp.init
    model = tsm.transform(model)    # decoder layers become TransformerLayers; tp / ep layouts checked
    tsm.state.tp_rank, tsm.state.ranker.get_rep_rank(rank), ...

Submodules at SMP v2's paths: ``delayed_param`` (``DelayedParamIniter``), ``grad_norm`` (``clip_grad_norm_``),
``tensor_parallel.transformer`` (``TransformerLayer``), ``moe.moe_config`` (``MoEConfig``), ``utils.utils``
(``timeit``), ``utils.process_group_utils`` (``get_global_ranks``), ``checkpoint.utils``
(``limit_num_subdirs``, ``SORT_BY_LAST_INT``), ``logger`` (``get_logger``).
"""

from jmp.tsm.initialization import init, is_initialized
from jmp.tsm.transformation import transform
from jmp.tsm.tsm_state import state

__all__ = ["init", "is_initialized", "state", "transform"]
