"""``torch.sagemaker.utils``: the helpers SMP v2 scripts import (``utils.timeit``, ``process_group_utils``)."""
