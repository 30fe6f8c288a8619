"""``tsm.transform``: SMP v2's model transformation for tensor and expert parallelism, on jmp's rules.

jmp keeps every module and splits parameters by its rule tables when the model is wrapped
(``jmp.sharding.tensor_parallel``, ``jmp.sharding.experts``). ``transform`` does what scripts can see of SMP's:
decoder layers become ``TransformerLayer`` instances, the model is cast to ``dtype``, and the layout is checked
now (a degree that does not divide a layer is an error; a model the rules do not split is said once). Unlike
SMP v2, jmp's rules also split an untransformed model when ``tensor_parallel_degree`` > 1.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from jmp.errors import ArgumentTypeError, ConfigError, JmpError
from jmp.runtime import mesh_state, notices
from jmp.sharding.experts import expert_specs, experts_modules
from jmp.sharding.tensor_parallel import tensor_parallel_specs
from jmp.tsm.moe.moe_config import MoEConfig
from jmp.tsm.tensor_parallel.transformer import layer_class

logger = logging.getLogger("jmp")

CP_COMM_TYPES = ("p2p", "all_gather")


def transform(
    model: nn.Module,
    device: Any = None,
    dtype: torch.dtype | None = None,
    config: MoEConfig | None = None,
    load_state_dict_from_rank0: bool = False,
    cp_comm_type: str = "p2p",
) -> nn.Module:
    """SMP v2's ``torch.sagemaker.transform``: ``model`` itself, its decoder layers made ``TransformerLayer`` instances.

    ``model``: a Hugging Face causal LM or a model whose layers are an ``nn.ModuleList`` (meta device too);
    ``dtype`` casts it; ``config``: a ``MoEConfig``. ``device``, ``load_state_dict_from_rank0`` and
    ``cp_comm_type`` are accepted with no effect (``JMP_CONTEXT_PARALLEL_ATTENTION`` picks the latter's exchange).
    Raises ``JmpError`` before ``tsm.init``, ``ConfigError`` for no decoder layers, a degree that does not divide
    a layer, or ``smp_moe`` without an experts module.
    """
    if not isinstance(model, nn.Module):
        raise ArgumentTypeError(f"tsm.transform takes a torch nn.Module, not {type(model).__name__}")
    if config is not None and not isinstance(config, MoEConfig):
        raise ArgumentTypeError(f"tsm.transform(config=...) takes a MoEConfig or None, not {type(config).__name__}")
    if cp_comm_type not in CP_COMM_TYPES:
        raise ConfigError(f"tsm.transform: cp_comm_type must be one of {CP_COMM_TYPES}, not {cp_comm_type!r}")
    if not mesh_state.is_initialized():
        raise JmpError("tsm.transform needs the run's degrees: call tsm.init() first")
    _note_accepted(device, load_state_dict_from_rank0, cp_comm_type)
    if dtype is not None:
        model.to(dtype)
    layers = decoder_layers(model)
    for layer in layers:
        layer.__class__ = layer_class(type(layer))
    _check_layout(model, config)
    logger.info("tsm.transform: %d %s layers are TransformerLayers", len(layers), type(layers[0]).__name__)
    return model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers: a Hugging Face model's ``GradientCheckpointingLayer``s (the base class of its
    decoder layers), else the longest ``nn.ModuleList`` / ``nn.Sequential`` of modules of one class."""
    hugging_face = _hugging_face_layer_class(model)
    if hugging_face is not None:
        found = [m for m in model.modules() if isinstance(m, hugging_face)]
        if found:
            return found
    stacks = [
        list(m.children())
        for m in model.modules()
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len({type(c) for c in m.children()}) == 1
    ]
    stacks = [s for s in stacks if s and not isinstance(s[0], (nn.ModuleList, nn.Sequential))]
    if not stacks:
        raise ConfigError(
            f"tsm.transform found no decoder layers in {type(model).__name__}: it takes a Hugging Face model (its "
            "layers derive from GradientCheckpointingLayer) or a model whose layers are an nn.ModuleList of one class"
        )
    return max(stacks, key=len)


def _hugging_face_layer_class(model: nn.Module) -> type | None:
    """Hugging Face's base class of decoder layers, for a Hugging Face model (transformers is not jmp's dependency)."""
    if not type(model).__module__.startswith("transformers."):
        return None
    from transformers.modeling_layers import GradientCheckpointingLayer

    return GradientCheckpointingLayer


def _check_layout(model: nn.Module, config: MoEConfig | None) -> None:
    """Compute the tensor- and expert-parallel specs the mesh will give the model (errors now, not at wrapping)."""
    mesh = mesh_state.get_mesh()
    tp, ep = mesh.shape["tp"], mesh.shape["ep"]
    if config is not None:
        config.log_what_jmp_does()
        if config.smp_moe and not experts_modules(model):
            raise ConfigError(
                f"tsm.transform(config=MoEConfig(smp_moe=True)): {type(model).__name__} has no experts module "
                "(a module with an int num_experts whose parameters are stacked on a leading num_experts axis, like "
                "Hugging Face's MixtralExperts); pass config=None for a dense model"
            )
    if tp > 1:
        split = tensor_parallel_specs(model, tp)
        if not split:
            notices.warn_once(
                "tsm.transform:no-tp",
                f"tsm.transform: jmp's tensor-parallel rules split none of {type(model).__name__}'s parameters; "
                f"they are replicated over the {tp} tensor-parallel devices",
            )
        else:
            logger.info("tsm.transform: %d parameters split over tp=%d", len(split), tp)
    if ep > 1:
        split = expert_specs(model, ep, tp)
        if not split:
            raise ConfigError(
                f"expert_parallel_degree is {ep}, but {type(model).__name__} has no experts module to split over "
                "it (like Hugging Face's MixtralExperts); set expert_parallel_degree to 1 for a dense model"
            )
        logger.info("tsm.transform: %d expert parameters split over ep=%d", len(split), ep)


_ACCEPTED = {
    "device": "tsm.transform(device=...) has no effect: jmp places the parameters on the mesh's devices when the "
    "model is wrapped",
    "rank0": "tsm.transform(load_state_dict_from_rank0=True): the layers are kept, so rank 0's weights stay in its "
    "model; FSDP(sync_module_states=True) gives them to the other ranks",
    "cp": "tsm.transform(cp_comm_type='all_gather') has no effect: jmp's attention over split sequences takes the "
    "ring (p2p) unless the environment sets JMP_CONTEXT_PARALLEL_ATTENTION=all_gather",
}


def _note_accepted(device: Any, load_state_dict_from_rank0: bool, cp_comm_type: str) -> None:
    given = {"device": device is not None, "rank0": load_state_dict_from_rank0, "cp": cp_comm_type != "p2p"}
    for key in (key for key, value in given.items() if value):
        notices.info_once(f"tsm.transform:{key}", _ACCEPTED[key])
