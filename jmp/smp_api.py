"""SMP v1's API as `jmp` exports it (`jmp/__init__.py` imports it, except in the launcher's own process)."""

from jmp import amp, comm, eager, model, nn, optimizers, state_mod, torch_bridge  # noqa: F401 (eager: outside a step)

# SMP's modules whose name its package gives another object (smp.checkpoint the function, smp.step the decorator),
# loaded before those objects are bound below, as SMP's __init__ loads them: the package's attribute is then the object
from jmp import checkpoint as checkpoint_module  # noqa: F401
from jmp import step as step_module  # noqa: F401
from jmp.comm import *  # noqa: F403 (SMP's comm names are smp's too)
from jmp.comm import __all__ as _comm_names
from jmp.compiled_step.function import StepOutput, is_tracing, step
from jmp.compiled_step.memory_estimate import MemoryEstimate, estimate_memory, what_fits
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
from jmp.optim import grad_clipping
from jmp.optim.distributed_optimizer import DistributedOptimizer
from jmp.pipeline import partition, set_partition
from jmp.remat.api import checkpoint, checkpoint_sequential, set_activation_checkpointing
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
from jmp.runtime.policy_syntax import RematPolicy
from jmp.runtime.process_groups import get_dp_group, get_mp_group, get_pp_group, get_rdp_group, get_tp_group
from jmp.runtime.smp_state import state
from jmp.saving import load, resume_from_checkpoint, save, save_checkpoint, set_preemption_user_content
from jmp.sharding import set_tensor_parallelism, tensor_parallelism
from jmp.sharding.tensor_parallel import tp_register, tp_register_with_module
from jmp.wrapped_model.creation import model_creation
from jmp.wrapped_model.delayed_init import delay_param_initialization
from jmp.wrapped_model.distributed_model import DistributedModel

grad_clipping.install()  # torch.nn.utils.clip_grad_norm_ on a DistributedModel's parameters


__all__ = [
    *_comm_names,
    "ActivationCheckpointingError", "amp", "ArgumentTypeError", "checkpoint", "checkpoint_sequential",
    "CheckpointError", "CommError", "ConfigError", "ConversionError", "delay_param_initialization",
    "DistributedModel", "DistributedOptimizer", "dp_rank", "dp_size", "estimate_memory", "get_config",
    "get_dp_group", "get_mesh", "get_mp_group", "get_pp_group", "get_rdp_group", "get_tp_group", "init",
    "is_initialized", "is_tracing", "JmpError", "load", "local_rank", "local_size", "LoweringError",
    "MemoryEstimate", "model", "model_creation", "ModelLookupError", "mp_rank", "mp_size", "nn", "OptimizerError",
    "optimizers", "partition", "PipelineError", "pp_rank", "pp_size", "rank", "rdp_rank", "rdp_size", "RematPolicy",
    "resume_from_checkpoint", "save", "save_checkpoint", "set_activation_checkpointing", "set_partition",
    "set_preemption_user_content", "set_tensor_parallelism", "size", "state", "StateDictError", "step", "StepError",
    "StepOutput", "tensor_parallelism", "torch_bridge", "tp_rank", "tp_register", "tp_register_with_module",
    "tp_size", "TracedControlFlowError", "UnsupportedOpError", "what_fits"
]  # fmt: skip
