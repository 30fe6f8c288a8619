"""``smdistributed.dataparallel.torch``: see ``torch_smddp``."""
