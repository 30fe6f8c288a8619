"""The start of an SMP v2 training script as AWS's ``train_lib.py`` writes it (module-level ``torch.sagemaker``
imports, ``dist.init_process_group("smddp")`` before ``tsm.init()``), run with no edit by ``python -m jmp.launch``
(``test_launched.py``). Prints one JSON line per process: what the names resolved to, ``tsm.state``, and a
collective on its tensor-parallel group; then the same after ``tsm.init`` with two data-parallel replicas; then,
FSDP's sharding over both processes, ``tests/fsdp/launched_fsdp.py``'s training, state dicts and checkpoints (in the
directory the first argument names). Its INFO records go to stderr, as a script that configures logging shows
them: jmp's notices must be once per job."""

from __future__ import annotations

import datetime
import json
import logging
import sys
from pathlib import Path

import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401 (registers the "smddp" backend)
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as torch_state_dict  # torch's own module, which imports FSDP
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
    offload_wrapper,
)
from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # before torch.sagemaker: no need to wait for it
from torch.distributed.fsdp import ShardingStrategy

# isort: split
import torch.sagemaker as tsm
import torch.sagemaker.checkpoint.utils as tsm_checkpoint
import torch.sagemaker.utils.utils as tsm_utils
from torch.sagemaker import state, transform
from torch.sagemaker.delayed_param import DelayedParamIniter
from torch.sagemaker.grad_norm import clip_grad_norm_
from torch.sagemaker.logger import get_logger
from torch.sagemaker.tensor_parallel.transformer import TransformerLayer
from torch.sagemaker.utils.process_group_utils import get_global_ranks

from tests.fsdp import launched_fsdp


def layout() -> dict:
    rank = dist.get_rank()
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total, group=state.tp_process_group)
    return {
        "tp": [state.tp_rank, state.tp_size, state.tensor_parallel_degree, state.hybrid_shard_degree],
        "tp_group": get_global_ranks(state.tp_process_group),
        "tp_sum": total.item(),
        "replicas": [state.ranker.get_rep_groups(), state.ranker.get_rep_rank(rank)],
    }


logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
dist.init_process_group("smddp", timeout=datetime.timedelta(seconds=120))
tsm.init()
import jmp.tsm  # noqa: E402 (after the script's own start: what torch.sagemaker is)

report = {
    "rank": dist.get_rank(),
    "world": dist.get_world_size(),
    "backend": dist.get_backend(),
    "torch_sagemaker_is_jmp_tsm": tsm is jmp.tsm and state is jmp.tsm.state and sys.modules["torch.sagemaker"] is tsm,
    "names": [f.__module__ for f in (transform, DelayedParamIniter, clip_grad_norm_, get_logger, TransformerLayer)]
    + [tsm_checkpoint.__name__, tsm_utils.__name__],
    "env_config": layout(),
    "fsdp_names": {
        f.__name__: f.__module__
        for f in (FSDP, apply_activation_checkpointing, checkpoint_wrapper, offload_wrapper)
        + (load_sharded_optimizer_state_dict,)
    },
    "torch_keeps": [ShardingStrategy.__module__, CheckpointImpl.__module__, torch_state_dict.FSDP.__module__],
}
tsm.init({"hybrid_shard_degree": 1})
report["two_replicas"] = layout()
tsm.init({})  # hybrid_shard_degree 0: FSDP's FULL_SHARD over both processes
report["fsdp"] = launched_fsdp.run(Path(sys.argv[1]))
print(json.dumps(report), flush=True)
dist.destroy_process_group()
