"""``import smdistributed.dataparallel.torch.torch_smddp`` registers ``torch.distributed``'s ``"smddp"`` backend,
as SMDDP does before a script's ``dist.init_process_group("smddp")``. Here the backend is gloo under that name:
torch.distributed carries only the host tensors a script holds between steps (the model's collectives are XLA's,
inside the compiled step). In jmp's launched processes ``init_process_group`` starts gloo for any backend name
anyway (``smp_import_path/sitecustomize.py``); the registration serves ``new_group(backend="smddp")`` and
``torch.distributed.is_backend_available("smddp")``.
"""

import datetime

import torch.distributed as dist

BACKEND = "smddp"


def _gloo(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> dist.ProcessGroup:
    return dist.ProcessGroupGloo(store, rank, size, timeout)


if BACKEND not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND, _gloo, devices=["cpu"])
