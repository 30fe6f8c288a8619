"""``torch.sagemaker.checkpoint``: SMP v2's checkpoint helpers the scripts import (``utils``)."""
