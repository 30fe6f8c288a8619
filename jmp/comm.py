"""SMP's ``smdistributed.modelparallel.torch.comm`` path: the same objects as ``smp``'s, from ``jmp.runtime``."""

from jmp.runtime.comm import (  # noqa: F401 (re-exported: __all__)
    DP_GROUP,
    MP_GROUP,
    PP_GROUP,
    RDP_GROUP,
    TP_GROUP,
    WORLD,
    CommGroup,
    RankType,
    allgather,
    barrier,
    broadcast,
    dp_barrier,
    mp_barrier,
    pp_barrier,
    rdp_barrier,
    recv_from,
    send,
    tp_barrier,
)
from jmp.runtime.process_groups import (  # noqa: F401 (re-exported: __all__)
    get_dp_process_group,
    get_mp_process_group,
    get_pp_process_group,
    get_rdp_process_group,
    get_tp_process_group,
    get_world_process_group,
)

__all__ = [name for name in dir() if not name.startswith("_")]  # the names imported above
