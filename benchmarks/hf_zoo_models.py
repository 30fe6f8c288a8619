"""One Hugging Face architecture, built small and checked: PyTorch's loss and gradients against jmp's under jit.

``architectures(family)`` lists the model classes of one of transformers' auto mappings; ``shrink(config)``
makes any default config tiny through one set of rules over the attribute names configs share (layers,
width, heads, vocabulary, experts, image size, dropout); ``check(family, model_type)`` builds the model
from the shrunk config, runs PyTorch's forward and backward on CPU and, when PyTorch runs, the converted
model's loss and gradients under ``nnx.jit``. The sweep (``benchmarks/hf_zoo.py``) runs ``check`` once per
architecture, each in its own process.
"""

from __future__ import annotations

import inspect
import traceback
from typing import Any

import numpy as np
import torch
import transformers
from transformers.models.auto import configuration_auto, modeling_auto

# family -> the auto mapping whose classes it sweeps
FAMILIES = {
    "causal_lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked_lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "sequence_classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "token_classification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "image_classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "ctc": "MODEL_FOR_CTC_MAPPING_NAMES",
    "audio_classification": "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
}

VOCAB = 256
WIDTH = 64
HEADS = 4
LAYERS = 2
BATCH, SEQUENCE = 2, 16
IMAGE = 32
AUDIO_SAMPLES = 1600
# Loss and each gradient within this of PyTorch's, relative to the largest magnitude of the tensor (or a
# tenth of the largest gradient, for gradients that are float noise around zero).
RTOL = 1e-3

# attribute name -> the shrunk value (applied only where the default config has the attribute, as an int)
_LAYER_NAMES = (
    "num_hidden_layers",
    "n_layer",
    "n_layers",
    "num_layers",
    "encoder_layers",
    "decoder_layers",
    "num_encoder_layers",
    "num_decoder_layers",
    "num_hidden_groups",
    "num_self_attends_per_block",
)
_WIDTH_NAMES = (
    "hidden_size",
    "d_model",
    "n_embd",
    "dim",
    "embed_dim",
    "emb_dim",
    "embedding_size",
    "word_embed_proj_dim",
    "entity_emb_size",
    "d_latents",
    "hidden_size_global",  # BLT's local encoder / decoder: the global transformer's width
)
_FFN_NAMES = (
    "intermediate_size",
    "d_ff",
    "ffn_dim",
    "n_inner",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "ffn_hidden_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "expert_ffn_hidden_size",  # LongCat-Flash
    "hidden_dim",
    "mlp_dim",
)
_HEAD_NAMES = (
    "num_attention_heads",
    "n_head",
    "n_heads",
    "num_heads",
    "encoder_attention_heads",
    "decoder_attention_heads",
)
_TOKEN_ID_NAMES = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id")


def _shrunk_value(name: str, value: Any, image: int = IMAGE) -> Any:
    """The small value for one config attribute, or ``value`` itself when no rule names it."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        if name in _LAYER_NAMES:
            return min(value, LAYERS)
        if name in _WIDTH_NAMES:
            return min(value, WIDTH)
        if name in _FFN_NAMES:
            return min(value, 2 * WIDTH)
        if name in _HEAD_NAMES:
            return min(value, HEADS)
        if name == "num_key_value_heads":
            return min(value, HEADS // 2)
        if name.endswith("head_dim") or name in ("d_kv", "attention_head_size", "kv_channels"):
            return min(value, WIDTH // HEADS)
        if name == "rotary_dim":
            return min(value, WIDTH // HEADS // 2)
        if name.endswith("lora_rank"):
            return min(value, 32)
        if name in ("n_group", "topk_group"):
            return 1
        # vocab_size_per_layer_input (Gemma 3n / 4), entity_vocab_size (LUKE), encoder_hash_byte_group_vocab (BLT)
        if "vocab_size" in name or name.endswith("_vocab"):
            return min(value, VOCAB)
        if name in _TOKEN_ID_NAMES:
            return value if value < VOCAB else {"pad_token_id": 0, "bos_token_id": 1}.get(name, 2)
        if name in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"):
            return min(value, 4)
        if name in ("num_experts_per_tok", "moe_topk", "moe_k", "top_k", "num_selected_experts"):
            return min(value, 2)
        if name == "image_size":
            return image
        if name == "num_labels":
            return 2
    if isinstance(value, float) and ("dropout" in name or "drop_" in name or name.endswith("drop")):
        return 0.0
    if isinstance(value, float) and name in ("width_coefficient", "depth_coefficient", "width_multiplier"):
        return min(value, 1.0)  # EfficientNet-style compound scaling: the base network
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        if name in ("depths", "num_layers_per_stage", "block_repeats"):
            return [1] * len(value)
        if name in ("hidden_sizes", "embed_dims", "embed_dim", "dims", "widths"):
            return [16 * (i + 1) for i in range(len(value))]
        if name in ("num_heads", "num_attention_heads"):
            return [1] * len(value)
        if name == "axial_pos_embds_dim":  # Reformer: the factors sum to the (shrunk) width
            return [WIDTH // 4, WIDTH - WIDTH // 4]
    return value


def _head_shape(name: str) -> bool:
    return name.endswith(("head_dim", "lora_rank", "key_value_heads")) or name in (
        "d_kv",
        "attention_head_size",
        "kv_channels",
        "rotary_dim",
    )


def _kept_at(level: int, name: str, value: Any) -> bool:
    """Whether shrink level ``level`` applies the rule for ``name``: 0 all of them; 1 all but the head shapes
    (some models derive one from another); 2 only counts (layers, vocabulary, experts, labels, dropout, image
    size), the widths left at their defaults."""
    if level == 0:
        return True
    if level == 1:
        return not _head_shape(name)
    counts = _LAYER_NAMES + _TOKEN_ID_NAMES + ("vocab_size", "num_labels", "image_size", "depths")
    counts += ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "n_group", "topk_group")
    return name in counts or isinstance(value, float)


def shrink_overrides(config_dict: dict, level: int = 0, image: int = IMAGE) -> dict:
    """The keys of a config's ``to_dict()`` that the rules of ``level`` change, with their small values;
    sub-configs (nested dicts with a ``model_type``) recursively."""
    overrides = {}
    for name, value in config_dict.items():
        if isinstance(value, dict) and "model_type" in value:
            nested = shrink_overrides(value, level, image)
            if nested:
                overrides[name] = {"model_type": value["model_type"], **nested}
            continue
        small = _shrunk_value(name, value, image)
        if small != value and _kept_at(level, name, value):
            overrides[name] = small
    return overrides


SHRINK_LEVELS = 3
LARGEST = 30_000_000  # parameters: a model this large at shrink level 2 is left out (CPU time and memory)


def shrink(
    config_class: type, level: int = 0, by_attributes: bool = False, image: int = IMAGE
) -> transformers.PretrainedConfig:
    """``config_class``'s default config made tiny. By default its constructor sees only the changed keys, so
    what it derives from them (``layer_types`` from the layer count, ...) stays consistent; ``by_attributes``
    sets them on the default config instead (sub-configs keep what their parent gave them), cutting lists
    as long as the old layer count to the new one."""
    default = config_class()
    overrides = shrink_overrides(default.to_dict(), level, image)
    config = _set_attributes(default, overrides) if by_attributes else config_class(**overrides)
    if "vocab_size" in config.to_dict() and config.vocab_size is None:
        config.vocab_size = VOCAB  # a default config that leaves the vocabulary to the checkpoint (ESM)
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = 0  # sequence classification finds the last token through it
    if config.is_encoder_decoder and getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = config.pad_token_id  # T5's convention; the labels' shift needs one
    return config


def _set_attributes(config: Any, overrides: dict) -> Any:
    layers = {n: getattr(config, n) for n in _LAYER_NAMES if isinstance(getattr(config, n, None), int)}
    for name, value in overrides.items():
        if isinstance(value, dict):
            _set_attributes(getattr(config, name), {k: v for k, v in value.items() if k != "model_type"})
        else:
            setattr(config, name, value)
    counts = {old: getattr(config, n) for n, old in layers.items()}
    for name, value in list(vars(config).items()):
        if isinstance(value, list) and len(value) in counts and counts[len(value)] < len(value):
            setattr(config, name, value[: counts[len(value)]])
    return config


def architectures(family: str) -> dict[str, str]:
    """model_type -> model class name, for one family's auto mapping (its first class where it names several:
    DeiT's plain classifier before the one with a distillation head)."""
    mapping = getattr(modeling_auto, FAMILIES[family])
    return {k: v[0] if isinstance(v, (tuple, list)) else v for k, v in mapping.items()}


def _inputs(family: str, model: torch.nn.Module, config: Any) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    vocab = min(getattr(config, "vocab_size", None) or VOCAB, VOCAB)
    ids = torch.randint(3, vocab, (BATCH, SEQUENCE), generator=generator)
    eos = getattr(config, "eos_token_id", None)
    if family == "sequence_classification" and isinstance(eos, int) and eos < vocab:
        ids[:, -1] = eos  # BART-style classifiers pool at each example's last end-of-sequence token
    labels_count = getattr(config, "num_labels", 2)
    name = model.main_input_name
    if name == "pixel_values" or family == "image_classification":  # Perceiver names its input "inputs"
        channels = getattr(config, "num_channels", 3)
        size = getattr(config, "image_size", IMAGE)
        height, width = (size, size) if isinstance(size, int) else tuple(size)[:2] if size else (IMAGE, IMAGE)
        inputs = {name: torch.randn(BATCH, channels, height, width, generator=generator)}
    elif name == "input_values":
        inputs = {name: torch.randn(BATCH, AUDIO_SAMPLES, generator=generator)}
    elif name == "input_features":
        names = ("feature_projection_input_dim", "num_mel_bins", "feature_size")  # Wav2Vec2-BERT stacks 2 frames
        bins = next((getattr(config, n) for n in names if getattr(config, n, None)), 80)
        inputs = {name: torch.randn(BATCH, 64, bins, generator=generator)}
    else:
        inputs = {name: ids}
    if family in ("causal_lm", "masked_lm", "seq2seq"):
        inputs["labels"] = ids
    elif family == "token_classification":
        inputs["labels"] = torch.randint(0, labels_count, (BATCH, SEQUENCE), generator=generator)
    elif family == "ctc":
        inputs["labels"] = torch.randint(1, vocab, (BATCH, 4), generator=generator)
    else:
        inputs["labels"] = torch.randint(0, labels_count, (BATCH,), generator=generator)
    if "use_cache" in inspect.signature(model.forward).parameters:
        inputs["use_cache"] = False
    return inputs


def _failure(stage: str, error: BaseException) -> dict:
    from jmp.errors import UnsupportedOpError

    category = "op" if isinstance(error, UnsupportedOpError) else "construct"
    lines = str(error).strip().splitlines()
    return {
        "status": stage,
        "category": category,
        "error_type": type(error).__name__,
        "error": lines[0][:400] if lines else "",
        "traceback_tail": traceback.format_exc().strip().splitlines()[-6:],
    }


def _relative_error(actual: np.ndarray, expected: np.ndarray, floor: float) -> float:
    scale = max(float(np.max(np.abs(expected))) if expected.size else 0.0, floor, 1e-12)
    return float(np.max(np.abs(actual - expected))) / scale if expected.size else 0.0


def check(family: str, model_type: str) -> dict:
    """Build ``model_type``'s ``family`` class from its shrunk default config; PyTorch's loss and gradients,
    then (when PyTorch runs) jmp's under ``nnx.jit``, compared. A dict: ``status`` is ``pass``,
    ``torch_fails`` (excluded), ``convert`` / ``jax`` (a failure, with its ``category``) or ``numerics``."""
    class_name = architectures(family)[model_type]
    result: dict[str, Any] = {"family": family, "model_type": model_type, "class": class_name}
    first_error = None
    # a larger image where the default config has one: deep CNNs downsample a small one to nothing
    images = (IMAGE, 2 * IMAGE) if _default_has_image(model_type) else (IMAGE,)
    levels = [(lv, by_attributes) for lv in range(SHRINK_LEVELS) for by_attributes in (False, True)]
    attempts = [(level, by_attributes, image) for image in images for level, by_attributes in levels]
    for level, by_attributes, image in attempts:  # the first shrunk config PyTorch runs
        try:
            model, inputs, loss, expected = _torch_run(family, model_type, class_name, level, by_attributes, image)
            break
        except Exception as error:  # noqa: BLE001 - any PyTorch failure excludes the architecture
            first_error = first_error or error
    else:
        lines = str(first_error).strip().splitlines()
        error = (lines or [""])[0][:400]
        return {**result, "status": "torch_fails", "error_type": type(first_error).__name__, "error": error}
    result["shrink_level"] = level
    result["shrunk_by_attributes"] = by_attributes
    if image != IMAGE:
        result["image_size"] = image
    result["parameters"] = sum(p.numel() for p in model.parameters())
    return {**result, **_compare_with_jmp(model, inputs, loss.item(), expected)}


def _default_has_image(model_type: str) -> bool:
    try:
        return _has_image(configuration_auto.CONFIG_MAPPING[model_type]().to_dict())
    except Exception:  # noqa: BLE001 - a default config that cannot be built: the attempts record the error
        return False


def _has_image(config_dict: dict) -> bool:
    """Whether a config or one of its sub-configs has an ``image_size``."""
    return "image_size" in config_dict or any(isinstance(v, dict) and _has_image(v) for v in config_dict.values())


def _torch_run(family: str, model_type: str, class_name: str, level: int, by_attributes: bool, image: int) -> tuple:
    """(model, inputs, loss, gradients by name) of PyTorch's forward and backward at one shrink level."""
    config = shrink(configuration_auto.CONFIG_MAPPING[model_type], level, by_attributes, image)
    torch.manual_seed(0)
    model = getattr(transformers, class_name)(config).eval()
    with torch.no_grad():  # zero-initialised routers score every expert alike: top-k would break ties
        for parameter in model.parameters():
            if parameter.is_floating_point():
                parameter.add_(torch.randn_like(parameter) * 0.02)
    size = sum(p.numel() for p in model.parameters())
    if size > LARGEST:
        raise ValueError(f"{size} parameters at shrink level {level}: larger than the sweep runs")
    inputs = _inputs(family, model, config)
    model.zero_grad()
    loss = model(**inputs).loss
    if loss is None or not torch.isfinite(loss):
        raise ValueError(f"the model's loss is {loss}")
    loss.backward()
    expected = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
    if not expected:
        raise ValueError("PyTorch computed no gradients")
    return model, inputs, loss, expected


def _step_uncompiled(model: torch.nn.Module, inputs: dict) -> tuple[float, dict[str, np.ndarray]]:
    """Loss and gradients by name from ``@smp.step`` on the whole model: the step a user writes, which runs op
    by op when its forward needs concrete values (``jmp.compiled_step.uncompiled``)."""
    import jax

    import jmp as smp

    smp.init({})
    distributed = smp.DistributedModel(model)
    distributed.eval()

    @smp.step
    def loss_and_backward(model, inputs):
        loss = model(**inputs).loss
        model.backward(loss)
        return loss

    loss = loss_and_backward(distributed, inputs).reduce_mean()
    flat = jax.tree_util.tree_flatten_with_path(distributed.grads)[0]
    names = [".".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)) for path, _ in flat]
    return float(loss), {name: np.asarray(leaf) for name, (_, leaf) in zip(names, flat)}


def _compare_with_jmp(model: torch.nn.Module, inputs: dict, expected_loss: float, expected: dict) -> dict:
    import jax.numpy as jnp
    from flax import nnx

    import jmp

    try:
        converted = jmp.torch_bridge.convert(model)
        converted.eval()
    except Exception as error:  # noqa: BLE001 - recorded as the architecture's failure
        return _failure("convert", error)
    arrays = {k: jnp.asarray(v.numpy()) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}

    def loss_of(module):
        return module(**arrays).loss

    path = "jit"
    try:
        graphdef, _, rest = nnx.split(converted, nnx.Param, ...)
        loss, grads = nnx.jit(nnx.value_and_grad(loss_of))(converted)
        named = dict(jmp.torch_bridge.named_variables(nnx.merge(graphdef, grads, rest)))
        actual = {name: np.asarray(named[name][...]) for name in expected if name in named}
    except jmp.TracedControlFlowError:  # data-dependent shapes: what a user's step does, run op by op
        path = "op by op"
        try:
            loss, actual = _step_uncompiled(model, inputs)
        except Exception as error:  # noqa: BLE001
            return _failure("jax", error)
    except Exception as error:  # noqa: BLE001
        return _failure("jax", error)
    missing = sorted(set(expected) - set(actual))
    largest = max(
        (float(np.max(np.abs(g))) for g in expected.values() if g.size), default=0.0
    )  # MobileBERT has empty ones
    loss_error = abs(float(loss) - expected_loss) / max(abs(expected_loss), 1e-12)
    grad_errors = {n: _relative_error(actual[n], g, 0.1 * largest) for n, g in expected.items() if n in actual}
    worst = max(grad_errors, key=grad_errors.get) if grad_errors else None
    figures = {
        "loss": float(loss),
        "torch_loss": expected_loss,
        "loss_rel_error": loss_error,
        "max_grad_rel_error": grad_errors[worst] if worst else None,
        "worst_gradient": worst,
        "gradients": len(expected),
        "path": path,
    }
    if missing or loss_error > RTOL or (worst and grad_errors[worst] > RTOL):
        reason = f"no JAX gradient for {missing[:3]}" if missing else "loss or a gradient differs from PyTorch's"
        return {"status": "numerics", "category": "numerics", "error": reason, **figures}
    return {"status": "pass", **figures}
