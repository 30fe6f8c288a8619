"""Loss functions, following ATen's formulas (half-precision cross entropy and NLL accumulate in float32)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
import torch
import torch.nn.functional as F

from jmp.torch_bridge.lowering.arguments import reduction as reduction_mode
from jmp.torch_bridge.lowering.reductions import accumulation_dtype
from jmp.torch_bridge.lowering.selections import selected_or_array
from jmp.torch_bridge.registry import register_lowering
from jmp.torch_bridge.tensor import unwrap, unwrap_tree


def _reduce(loss, reduction, size_average=None, reduce=None, weight=None):
    """``loss`` (times ``weight``) reduced as ``reduction``, or torch's legacy ``size_average`` / ``reduce``, say."""
    loss = loss if weight is None else loss * weight
    reduction = reduction_mode(reduction, size_average, reduce)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return jnp.sum(loss)
    if reduction == "mean":
        return jnp.mean(loss)
    raise ValueError(f"reduction must be 'none', 'mean' or 'sum', not {reduction!r}")


def _class_axis(input):
    return 1 if input.ndim > 1 else 0


def _pick(input, index, ax):
    """``take_along_axis(input, index)`` along the class axis, as a masked sum (the same value exactly).

    A gather along an axis split over the mesh aborts XLA's partitioner inside a partially manual ``shard_map``;
    the masked sum partitions as a local sum and one all-reduce.
    """
    classes = jax.lax.broadcasted_iota(index.dtype, input.shape, ax)
    chosen = classes == jnp.expand_dims(index, ax)
    return jnp.sum(jnp.where(chosen, input, jnp.zeros((), input.dtype)), axis=ax)


@register_lowering(F.nll_loss)
def nll_loss(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean"):
    reduction = reduction_mode(reduction, size_average, reduce)
    out_dtype = input.dtype
    input = input.astype(accumulation_dtype(out_dtype))
    ax = _class_axis(input)
    ignored = target == ignore_index
    safe = jnp.where(ignored, 0, target)
    picked = _pick(input, safe, ax)
    w = jnp.ones((), input.dtype) if weight is None else weight.astype(input.dtype)[safe]
    w = jnp.where(ignored, jnp.zeros((), input.dtype), w)
    loss = -w * picked
    if reduction == "mean":
        return (jnp.sum(loss) / jnp.sum(jnp.broadcast_to(w, loss.shape))).astype(out_dtype)
    return _reduce(loss, reduction).astype(out_dtype)


@register_lowering(F.cross_entropy)
def cross_entropy(
    input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean", label_smoothing=0.0
):
    reduction = reduction_mode(reduction, size_average, reduce)
    wide = accumulation_dtype(input.dtype)
    logp = jax.nn.log_softmax(input.astype(wide), axis=_class_axis(input)).astype(input.dtype).astype(wide)
    weight = None if weight is None else weight.astype(wide)
    return _cross_entropy(logp, target, weight, ignore_index, reduction, label_smoothing).astype(input.dtype)


def _cross_entropy(logp, target, weight, ignore_index, reduction, label_smoothing):
    ax = _class_axis(logp)
    n_classes = logp.shape[ax]
    w_shape = [1] * logp.ndim
    w_shape[ax] = n_classes
    if jnp.issubdtype(target.dtype, jnp.floating):  # class probabilities
        if label_smoothing > 0:
            target = target * (1 - label_smoothing) + label_smoothing / n_classes
        terms = logp * target
        if weight is not None:
            terms = terms * weight.reshape(w_shape)
        if reduction == "mean":
            return -jnp.sum(terms) / (logp.size / n_classes)
        if reduction == "sum":
            return -jnp.sum(terms)
        return -jnp.sum(terms, axis=ax)
    nll = nll_loss(logp, target, weight, ignore_index=ignore_index, reduction=reduction)
    if label_smoothing <= 0:
        return nll
    ignored = target == ignore_index
    weighted = logp if weight is None else logp * weight.reshape(w_shape)
    smooth = jnp.where(ignored, 0.0, -jnp.sum(weighted, axis=ax))
    if reduction == "mean":
        if weight is None:
            denominator = jnp.sum(~ignored)
        else:
            denominator = jnp.sum(jnp.where(ignored, 0.0, weight[jnp.where(ignored, 0, target)]))
        smooth = jnp.sum(smooth) / denominator
    elif reduction == "sum":
        smooth = jnp.sum(smooth)
    return (1 - label_smoothing) * nll + smooth * (label_smoothing / n_classes)


def _pointwise_loss(elementwise):
    def lowering(input, target, size_average=None, reduce=None, reduction="mean", weight=None):
        return _reduce(elementwise(input - target), reduction, size_average, reduce, weight)

    return lowering


register_lowering(F.mse_loss)(_pointwise_loss(jnp.square))
register_lowering(F.l1_loss)(_pointwise_loss(jnp.abs))


@register_lowering(F.smooth_l1_loss)
def smooth_l1_loss(input, target, size_average=None, reduce=None, reduction="mean", beta=1.0):
    diff = jnp.abs(input - target)
    loss = diff if beta == 0 else jnp.where(diff < beta, 0.5 * diff * diff / beta, diff - 0.5 * beta)
    return _reduce(loss, reduction, size_average, reduce)


@register_lowering(F.huber_loss)
def huber_loss(input, target, reduction="mean", delta=1.0, weight=None):
    diff = jnp.abs(input - target)
    loss = jnp.where(diff <= delta, 0.5 * diff * diff, delta * (diff - 0.5 * delta))
    return _reduce(loss, reduction, weight=weight)


@register_lowering(F.binary_cross_entropy)
def binary_cross_entropy(input, target, weight=None, size_average=None, reduce=None, reduction="mean"):
    log_x = jnp.maximum(jnp.log(input), -100.0)
    log_1mx = jnp.maximum(jnp.log1p(-input), -100.0)
    loss = -(target * log_x + (1 - target) * log_1mx)
    return _reduce(loss, reduction, size_average, reduce, weight)


@register_lowering(F.binary_cross_entropy_with_logits)
def binary_cross_entropy_with_logits(
    input, target, weight=None, size_average=None, reduce=None, reduction="mean", pos_weight=None
):
    softplus_neg = jnp.log1p(jnp.exp(-jnp.abs(input))) + jnp.maximum(-input, 0)
    if pos_weight is not None:
        log_weight = 1 + (pos_weight - 1) * target
        loss = (1 - target) * input + log_weight * softplus_neg
    else:
        loss = (1 - target) * input + softplus_neg
    return _reduce(loss, reduction, size_average, reduce, weight)


@register_lowering(F.kl_div)
def kl_div(input, target, size_average=None, reduce=None, reduction="mean", log_target=False):
    if log_target:
        loss = jnp.exp(target) * (target - input)
    else:
        loss = jax.scipy.special.xlogy(target, target) - target * input
    reduction = reduction_mode(reduction, size_average, reduce)
    if reduction == "batchmean":
        return jnp.sum(loss) / (input.shape[0] if input.ndim else 1)
    return _reduce(loss, reduction)


@register_lowering(F.soft_margin_loss)
def soft_margin_loss(input, target, size_average=None, reduce=None, reduction="mean"):
    return _reduce(jnp.log1p(jnp.exp(-target * input)), reduction, size_average, reduce)


@register_lowering(F.margin_ranking_loss)
def margin_ranking_loss(input1, input2, target, margin=0.0, size_average=None, reduce=None, reduction="mean"):
    loss = jnp.maximum(0.0, -target * (input1 - input2) + margin)
    return _reduce(loss, reduction, size_average, reduce)


@register_lowering(F.hinge_embedding_loss)
def hinge_embedding_loss(input, target, margin=1.0, size_average=None, reduce=None, reduction="mean"):
    margin_part = jnp.where(target != 1, jnp.maximum(margin - input, 0.0), 0.0)
    self_part = jnp.where(target != -1, input, 0.0)
    return _reduce(margin_part + self_part, reduction, size_average, reduce)


@register_lowering(F.poisson_nll_loss)
def poisson_nll_loss(
    input, target, log_input=True, full=False, size_average=None, eps=1e-8, reduce=None, reduction="mean"
):
    loss = jnp.exp(input) - target * input if log_input else input - target * jnp.log(input + eps)
    if full:
        stirling = target * jnp.log(target) - target + 0.5 * jnp.log(2 * math.pi * target)
        loss = loss + jnp.where(target > 1, stirling, 0.0)
    return _reduce(loss, reduction, size_average, reduce)


@register_lowering(F.gaussian_nll_loss)
def gaussian_nll_loss(input, target, var, full=False, eps=1e-6, reduction="mean"):
    if jnp.shape(var) != input.shape and jnp.shape(var) == input.shape[:-1]:
        var = var[..., None]  # one variance per sample, shared by its last dimension
    var = var + jax.lax.stop_gradient(jnp.maximum(var, eps) - var)  # clamped under no_grad in torch
    loss = 0.5 * (jnp.log(var) + jnp.square(input - target) / var)
    if full:
        loss = loss + 0.5 * math.log(2 * math.pi)
    return _reduce(loss, reduction)


@register_lowering(F.multilabel_soft_margin_loss)
def multilabel_soft_margin_loss(input, target, weight=None, size_average=None, reduce=None, reduction="mean"):
    loss = -(target * jax.nn.log_sigmoid(input) + (1 - target) * jax.nn.log_sigmoid(-input))
    if weight is not None:
        loss = loss * weight
    loss = jnp.sum(loss, axis=-1) / input.shape[-1]
    return _reduce(loss, reduction, size_average, reduce)


@register_lowering(F.cosine_embedding_loss)
def cosine_embedding_loss(input1, input2, target, margin=0.0, size_average=None, reduce=None, reduction="mean"):
    eps = 1e-12
    prod = jnp.sum(input1 * input2, axis=-1)
    mag1 = jnp.sum(input1 * input1, axis=-1) + eps
    mag2 = jnp.sum(input2 * input2, axis=-1) + eps
    cos = prod / jnp.sqrt(mag1 * mag2)
    loss = jnp.where(target == 1, 1 - cos, jnp.where(target == -1, jnp.maximum(cos - margin, 0.0), 0.0))
    return _reduce(loss, reduction, size_average, reduce)


_CTC_LOG_EPSILON = -1e5  # optax's stand-in for log(0); an alignment-free sequence costs at least -this / 2


@register_lowering(F.ctc_loss, torch.ctc_loss, raw=True)
def ctc_loss_of_tensors(log_probs, targets, *args, **kwargs):
    """``ctc_loss`` on the bridge's tensors, taking ``masked_select``'s padded selection as concatenated ``targets``."""
    return ctc_loss(unwrap(log_probs), selected_or_array(targets), *unwrap_tree(args), **unwrap_tree(kwargs))


def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, reduction="mean", zero_infinity=False):
    """Connectionist temporal classification (``optax.ctc_loss``) on torch's layouts and reductions.

    ``targets`` padded (N, S) or concatenated (gathered into rows of static length); an impossible alignment
    costs ``inf`` (0 with ``zero_infinity``).
    """
    reduction = {0: "none", 1: "mean", 2: "sum"}.get(reduction, reduction)  # torch.ctc_loss takes ATen's enum
    unbatched = log_probs.ndim == 2
    if unbatched:
        log_probs, targets = log_probs[:, None], jnp.asarray(targets)[None]
    logits = jnp.swapaxes(log_probs, 0, 1)  # (N, T, C)
    batch, steps = logits.shape[:2]
    input_lengths = jnp.broadcast_to(jnp.asarray(input_lengths), (batch,))
    target_lengths = jnp.broadcast_to(jnp.asarray(target_lengths), (batch,))
    targets = jnp.asarray(targets)
    if targets.ndim == 1:  # concatenated: row i starts where the rows before it end
        starts = jnp.cumsum(target_lengths) - target_lengths
        positions = starts[:, None] + jnp.arange(targets.shape[0])[None]
        targets = targets[jnp.clip(positions, 0, targets.shape[0] - 1)]
    label_paddings = (jnp.arange(targets.shape[1])[None] >= target_lengths[:, None]).astype(logits.dtype)
    logit_paddings = (jnp.arange(steps)[None] >= input_lengths[:, None]).astype(logits.dtype)
    losses = optax.ctc_loss(
        logits, logit_paddings, targets, label_paddings, blank_id=blank, log_epsilon=_CTC_LOG_EPSILON
    )
    losses = jnp.where(losses >= -_CTC_LOG_EPSILON / 2, 0.0 if zero_infinity else jnp.inf, losses)
    if reduction == "mean":
        return jnp.mean(losses / jnp.maximum(target_lengths, 1).astype(losses.dtype))
    return _reduce(losses[0] if unbatched else losses, reduction)
