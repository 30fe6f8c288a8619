"""jmp: SageMaker-style model parallelism for PyTorch models, on JAX/XLA.

import jmp as smp
smp.init({"microbatches": 4})
model = smp.DistributedModel(torch_module)
optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.module.parameters()))

@smp.step
def train_step(model, data, target):
    loss = F.cross_entropy(model(data), target)
    model.backward(loss)
    return loss
"""

from jmp import amp, eager, nn, optimizers, torch_bridge  # noqa: F401 (eager: models called outside a step)
from jmp.compiled_step.function import StepOutput, is_tracing, step
from jmp.errors import (
    ActivationCheckpointingError,
    ArgumentTypeError,
    CheckpointError,
    CommError,
    ConfigError,
    ConversionError,
    JmpError,
    LoweringError,
    ModelLookupError,
    OptimizerError,
    PipelineError,
    StateDictError,
    StepError,
    TracedControlFlowError,
    UnsupportedOpError,
)
from jmp.model.creation import model_creation
from jmp.model.delayed_init import delay_param_initialization
from jmp.model.distributed_model import DistributedModel
from jmp.model.memory_estimate import MemoryEstimate, estimate_memory, what_fits
from jmp.optim import grad_clipping
from jmp.optim.distributed_optimizer import DistributedOptimizer
from jmp.pipeline import partition, set_partition
from jmp.remat.api import checkpoint, checkpoint_sequential, set_activation_checkpointing
from jmp.remat.policy_syntax import RematPolicy
from jmp.runtime.comm import (
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
    recv_from,
    send,
    tp_barrier,
)
from jmp.runtime.mesh_state import (
    dp_rank,
    dp_size,
    get_config,
    get_mesh,
    init,
    is_initialized,
    local_rank,
    local_size,
    mp_rank,
    mp_size,
    pp_rank,
    pp_size,
    rank,
    rdp_rank,
    rdp_size,
    size,
    tp_rank,
    tp_size,
)
from jmp.runtime.process_groups import (
    get_dp_group,
    get_dp_process_group,
    get_mp_group,
    get_mp_process_group,
    get_pp_group,
    get_pp_process_group,
    get_rdp_group,
    get_rdp_process_group,
    get_tp_group,
    get_tp_process_group,
    get_world_process_group,
)
from jmp.runtime.smp_state import state
from jmp.saving import load, resume_from_checkpoint, save, save_checkpoint, set_preemption_user_content
from jmp.sharding import set_tensor_parallelism, tensor_parallelism
from jmp.sharding.tensor_parallel import tp_register, tp_register_with_module

grad_clipping.install()  # torch.nn.utils.clip_grad_norm_ on a DistributedModel's parameters

__version__ = "0.1.0"

__all__ = [
    "ActivationCheckpointingError",
    "ArgumentTypeError",
    "CheckpointError",
    "CommError",
    "CommGroup",
    "ConfigError",
    "ConversionError",
    "DP_GROUP",
    "DistributedModel",
    "DistributedOptimizer",
    "JmpError",
    "LoweringError",
    "MP_GROUP",
    "ModelLookupError",
    "OptimizerError",
    "PP_GROUP",
    "PipelineError",
    "RDP_GROUP",
    "RankType",
    "RematPolicy",
    "StateDictError",
    "StepError",
    "StepOutput",
    "TP_GROUP",
    "TracedControlFlowError",
    "UnsupportedOpError",
    "WORLD",
    "allgather",
    "amp",
    "barrier",
    "broadcast",
    "checkpoint",
    "checkpoint_sequential",
    "dp_barrier",
    "dp_rank",
    "delay_param_initialization",
    "estimate_memory",
    "dp_size",
    "get_config",
    "get_dp_group",
    "get_dp_process_group",
    "get_mp_group",
    "get_mp_process_group",
    "get_pp_group",
    "get_pp_process_group",
    "get_rdp_group",
    "get_rdp_process_group",
    "get_tp_group",
    "get_tp_process_group",
    "get_world_process_group",
    "state",
    "get_mesh",
    "init",
    "is_initialized",
    "is_tracing",
    "load",
    "local_rank",
    "local_size",
    "mp_barrier",
    "mp_rank",
    "model_creation",
    "MemoryEstimate",
    "what_fits",
    "mp_size",
    "nn",
    "optimizers",
    "partition",
    "pp_barrier",
    "pp_rank",
    "pp_size",
    "rank",
    "rdp_rank",
    "rdp_size",
    "recv_from",
    "resume_from_checkpoint",
    "save",
    "save_checkpoint",
    "set_preemption_user_content",
    "send",
    "set_tensor_parallelism",
    "set_activation_checkpointing",
    "set_partition",
    "size",
    "step",
    "tensor_parallelism",
    "torch_bridge",
    "tp_barrier",
    "tp_register",
    "tp_register_with_module",
    "tp_rank",
    "tp_size",
]
