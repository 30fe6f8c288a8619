"""``tsm.transform``: SMP v2's model transformation for tensor and expert parallelism, on jmp's rules.

SMP v2 replaces a Hugging Face model's decoder layers by its own tensor-parallel ``TransformerLayer``s (and its
mixture-of-experts layers by its own). jmp keeps every module and splits the parameters by its rule tables when
the model is wrapped (``smp.DistributedModel``, or jmp's FSDP wrapper, which builds one): Megatron's
column / row split of the attention and MLP linears and of the vocabulary over the mesh's ``tp`` axis
(``jmp.sharding.tensor_parallel``), and the experts over ``ep`` (``jmp.sharding.experts``), with XLA inserting
the collectives. So what ``transform`` does to the model is what scripts can see of SMP's: the decoder layers
become ``TransformerLayer`` instances (their forward, attributes and state-dict keys unchanged), the model is
cast to ``dtype`` when one is given, and the layout the mesh will give it is checked now: a degree that does
not divide a layer is an error here, and a model none of whose layers the rules split is said once.

Unlike SMP v2, jmp's rules split an untransformed model too when ``tensor_parallel_degree`` > 1.
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
    """SMP v2's ``torch.sagemaker.transform``: the model, its decoder layers ``TransformerLayer`` instances.

    Args:
        model: a Hugging Face causal language model (GPT-NeoX, Llama, Mistral, Mixtral, GPT-2, ...), or a model
            whose layers are an ``nn.ModuleList``; on the meta device too (delayed parameter initialisation).
        device: accepted; jmp places the parameters on the mesh's devices when the model is wrapped.
        dtype: the parameters' dtype, as ``model.to(dtype)`` casts them.
        config: a ``MoEConfig`` for mixture-of-experts models (``smp_moe``: split the experts over ``ep``).
        load_state_dict_from_rank0: accepted: the layers are kept, so the weights rank 0 loaded stay in its
            model (``FSDP(sync_module_states=True)`` gives them to the other ranks).
        cp_comm_type: "p2p" or "all_gather", context parallelism's exchange; no effect: jmp's attention over
            split sequences takes the ring (p2p) unless the environment sets
            ``JMP_CONTEXT_PARALLEL_ATTENTION=all_gather`` (``jmp.torch_bridge.lowering.ring_attention``).

    Returns:
        ``model`` itself, transformed in place.

    Raises:
        JmpError: ``tsm.init`` was not called (the layout depends on the degrees).
        ConfigError: no decoder layers found; a degree that does not divide a layer; ``MoEConfig(smp_moe=True)``
            on a model without an experts module.
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
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # an older transformers: its layers have no common base class
        return None
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
