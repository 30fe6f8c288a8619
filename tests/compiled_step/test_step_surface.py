"""@smp.step as SMP scripts use it: any non-tensor argument, model.backward(tensors, grad_tensors), dict and
ModelOutput results, torch.no_grad() evaluation, smp.is_tracing(), and summed gradients over microbatches."""

from __future__ import annotations

import argparse
import copy

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import jmp as smp
from jmp.errors import StepError
from tests.front_end.helpers import SmallNet, batches, named_grads
from tests.sharding.models import causal_lm, token_batches


def _model(config: dict) -> smp.DistributedModel:
    smp.init(config)
    return smp.DistributedModel(SmallNet())


def _reset_grads(model: smp.DistributedModel) -> None:
    model.training_state.grads = None  # what optimizer.zero_grad() does


def _assert_grads_equal(model: smp.DistributedModel, reference: nn.Module, scale: float = 1.0) -> None:
    grads = named_grads(model.grads)
    for name, param in reference.named_parameters():
        np.testing.assert_allclose(grads[name], param.grad.numpy() * scale, rtol=2e-5, atol=1e-6, err_msg=name)


# --- non-tensor arguments -------------------------------------------------------------------------------------


@smp.step
def scaled_step(model, data, target, args):
    loss = F.cross_entropy(model(data), target) * args.scale
    model.backward(loss)
    return loss


def test_a_namespace_argument_is_baked_in_and_the_same_object_reuses_the_program():
    model = _model({"microbatches": 2})
    x, y = batches(1, batch=16)[0]
    args = argparse.Namespace(scale=1.0, name="run")
    first = float(scaled_step(model, x, y, args).reduce_mean())
    scaled_step(model, x, y, args)
    assert len(model.programs) == 1
    doubled = float(scaled_step(model, x, y, argparse.Namespace(scale=2.0, name="run")).reduce_mean())
    assert len(model.programs) == 2
    np.testing.assert_allclose(doubled, 2 * first, rtol=1e-6)
    np.testing.assert_allclose(first, float(F.cross_entropy(model.module(x), y).detach()), rtol=1e-5)


def test_an_unhashable_argument_is_read_when_traced_so_mutating_it_later_reuses_the_program():
    model = _model({"microbatches": 2})
    x, y = batches(1, batch=16)[0]
    args = argparse.Namespace(scale=1.0)
    first = float(scaled_step(model, x, y, args).reduce_mean())
    args.scale = 3.0  # documented: by identity, like SMP's single trace; a new object retraces
    np.testing.assert_allclose(float(scaled_step(model, x, y, args).reduce_mean()), first, rtol=1e-6)
    assert len(model.programs) == 1


@smp.step
def settings_step(model, data, settings, columns, optimizer):
    out = model(data)[:, columns] * settings["factor"]
    assert isinstance(optimizer, torch.optim.SGD) and settings["tags"] == {"a"}
    return out


def test_lists_dicts_and_objects_of_any_type_pass_through_hashable_values_by_value():
    model = _model({"microbatches": 2})
    x, _ = batches(1, batch=16)[0]
    optimizer = torch.optim.SGD(model.module.parameters(), lr=0.1)
    expected = model.module(x).detach()
    out = settings_step(model, x, {"factor": 2.0, "tags": {"a"}}, [0, 3], optimizer)
    np.testing.assert_allclose(out.concat(), 2.0 * expected[:, [0, 3]], rtol=1e-5, atol=1e-6)
    out = settings_step(model, x, {"factor": 2.0, "tags": {"a"}}, [1, 2], optimizer)
    np.testing.assert_allclose(out.concat(), 2.0 * expected[:, [1, 2]], rtol=1e-5, atol=1e-6)
    assert len(model.programs) == 2  # the set is a new object each call: by identity
    tags = {"a"}
    settings_step(model, x, {"factor": 2.0, "tags": tags}, [1, 2], optimizer)
    settings_step(model, x, {"factor": 2.0, "tags": tags}, [1, 2], optimizer)
    assert len(model.programs) == 3
    settings_step(model, x, {"factor": 2, "tags": tags}, [1, 2], optimizer)
    assert len(model.programs) == 4  # 2 and 2.0 are different constants


# --- detach_outputs and is_tracing ----------------------------------------------------------------------------


def test_detach_outputs_is_accepted_and_is_tracing_is_true_only_while_the_step_is_traced():
    model = _model({"microbatches": 2})
    seen = []

    @smp.step(detach_outputs=False)
    def step_fn(model, data):
        seen.append(smp.is_tracing())
        return model(data)

    x, _ = batches(1, batch=16)[0]
    assert not smp.is_tracing()
    out = step_fn(model, x)
    traced = len(seen)  # the body runs while traced (maybe more than once), not at the second call
    step_fn(model, x)
    assert traced and seen == [True] * traced and not smp.is_tracing()
    np.testing.assert_allclose(out.concat(), model.module(x).detach(), rtol=1e-5, atol=1e-6)


# --- model.backward(tensors, grad_tensors) --------------------------------------------------------------------


@smp.step
def vector_backward_step(model, data, grad):
    out = model(data)
    model.backward(out, grad)
    return out


@smp.step
def list_backward_step(model, data, grad):
    out = model(data)
    model.backward([out, out.pow(2).mean()], [grad, None])
    return out


@pytest.mark.parametrize("microbatches", [1, 2])
def test_backward_with_grad_tensors_equals_torch_autograd_backward(microbatches):
    model = _model({"microbatches": microbatches})
    reference = copy.deepcopy(model.module)
    x, _ = batches(1, batch=16)[0]
    g = torch.randn(16, 5)
    vector_backward_step(model, x, g)
    torch.autograd.backward(reference(x), g)
    # each microbatch differentiates its rows' <out, g>; the step averages over microbatches
    _assert_grads_equal(model, reference, 1 / microbatches)


def test_backward_of_a_list_of_tensors_with_a_none_gradient_for_a_scalar_equals_torch():
    model = _model({"microbatches": 1})
    reference = copy.deepcopy(model.module)
    x, _ = batches(1, batch=16)[0]
    g = torch.randn(16, 5)
    list_backward_step(model, x, g)
    out = reference(x)
    torch.autograd.backward([out, out.pow(2).mean()], [g, None])
    _assert_grads_equal(model, reference)


def test_backward_refuses_mismatched_shapes_and_a_non_scalar_without_gradients():
    model = _model({"microbatches": 1})
    x, _ = batches(1, batch=16)[0]

    @smp.step
    def no_grad_tensors(model, data):
        model.backward(model(data))

    @smp.step
    def wrong_shape(model, data):
        model.backward(model(data), torch.ones(3))

    @smp.step
    def wrong_count(model, data):
        out = model(data)
        model.backward([out, out], [torch.ones_like(out)])

    with pytest.raises(StepError, match="needs a scalar loss; got shape \\(16, 5\\)"):
        no_grad_tensors(model, x)
    with pytest.raises(StepError, match="must match"):
        wrong_shape(model, x)
    with pytest.raises(StepError, match="2 tensors and 1 grad_tensors"):
        wrong_count(model, x)


# --- dict and ModelOutput results -----------------------------------------------------------------------------


@smp.step
def dict_step(model, data, target):
    logits = model(data)
    loss = F.cross_entropy(logits, target)
    model.backward(loss)
    return {"logits": logits, "loss": loss, "aux": None, "parts": [loss * 2], "kind": "train"}


def test_dict_results_give_a_step_output_per_entry_and_none_and_strings_as_they_are():
    model = _model({"microbatches": 2})
    x, y = batches(1, batch=16)[0]
    out = dict_step(model, x, y)
    assert set(out) == {"logits", "loss", "aux", "parts", "kind"}
    assert out["aux"] is None and out["kind"] == "train"
    assert len(out["logits"].outputs) == 2
    np.testing.assert_allclose(out["logits"].concat(), model.module(x).detach(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(out["parts"][0].reduce_mean()), 2 * float(out["loss"].reduce_mean()), rtol=1e-6)


def test_a_step_returning_an_object_that_is_not_a_tensor_says_what_to_return():
    model = _model({"microbatches": 1})

    @smp.step
    def returns_an_object(model, data):
        return model(data), object()

    with pytest.raises(StepError, match="returned a value of type object"):
        returns_an_object(model, batches(1, batch=16)[0][0])


@smp.step
def lm_step(model, ids):
    out = model(input_ids=ids, labels=ids, use_cache=False)
    model.backward(out.loss)
    return out


def test_a_hugging_face_model_output_gives_a_step_output_per_field():
    smp.init({"microbatches": 2})
    module = causal_lm("gpt2")
    model = smp.DistributedModel(module)
    ids = token_batches(1, batch=16)[0]
    out = lm_step(model, ids)
    assert type(out).__name__ == "CausalLMOutputWithCrossAttentions"
    assert len(out["logits"].outputs) == 2 and tuple(out["logits"].outputs[0].shape) == (8, 16, 128)
    expected = module(input_ids=ids, labels=ids, use_cache=False)
    # every microbatch has as many tokens, so the mean of their losses is the batch's loss
    np.testing.assert_allclose(float(out.loss.reduce_mean()), float(expected.loss.detach()), rtol=1e-4)
    np.testing.assert_allclose(out["logits"].concat(), expected.logits.detach(), rtol=1e-4, atol=1e-4)


# --- torch.no_grad() ------------------------------------------------------------------------------------------


@smp.step
def eval_step(model, data):
    return model(data)


@smp.step
def train_when_grad_enabled(model, data, target):
    loss = F.cross_entropy(model(data), target)
    if torch.is_grad_enabled():
        model.backward(loss)
    return loss


def test_an_evaluation_step_under_no_grad_records_no_gradients():
    model = _model({"microbatches": 2})
    model.eval()
    x, _ = batches(1, batch=16)[0]
    with torch.no_grad():
        out = eval_step(model, x)
    assert model.grads is None
    np.testing.assert_allclose(out.concat(), model.module(x).detach(), rtol=1e-5, atol=1e-6)


def test_grad_mode_is_part_of_the_program_so_a_later_training_call_gets_gradients():
    model = _model({"microbatches": 2})
    reference = copy.deepcopy(model.module)
    x, y = batches(1, batch=16)[0]
    with torch.no_grad():
        train_when_grad_enabled(model, x, y)
    assert model.grads is None
    train_when_grad_enabled(model, x, y)
    assert len(model.programs) == 2
    F.cross_entropy(reference(x), y).backward()
    _assert_grads_equal(model, reference)


def test_backward_under_no_grad_is_an_error_as_in_torch():
    model = _model({"microbatches": 1})
    x, y = batches(1, batch=16)[0]

    @smp.step
    def always_backward(model, data, target):
        model.backward(F.cross_entropy(model(data), target))

    with torch.no_grad(), pytest.raises(StepError, match="no_grad"):
        always_backward(model, x, y)


# --- average_grads_across_microbatches ------------------------------------------------------------------------


@smp.step
def loss_step(model, data, target):
    loss = F.cross_entropy(model(data), target)
    model.backward(loss)
    return loss


def _averaged_and_summed(model: smp.DistributedModel, x, y) -> tuple[dict, dict]:
    loss_step(model, x, y)
    averaged = named_grads(model.grads)
    _reset_grads(model)
    model.average_grads_across_microbatches = False
    loss_step(model, x, y)
    assert len(model.programs) == 2  # the flag is part of the program
    return averaged, named_grads(model.grads)


def test_summed_gradients_are_the_microbatch_count_times_the_averaged_ones():
    model = _model({"microbatches": 4})
    reference = copy.deepcopy(model.module)
    x, y = batches(1, batch=32)[0]
    averaged, summed = _averaged_and_summed(model, x, y)
    F.cross_entropy(reference(x), y).backward()
    for name, param in reference.named_parameters():
        np.testing.assert_allclose(averaged[name], param.grad.numpy(), rtol=2e-5, atol=1e-6, err_msg=name)
        np.testing.assert_array_equal(summed[name], 4 * averaged[name])


def test_summed_gradients_through_a_pipeline_are_the_microbatch_count_times_the_averaged_ones():
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4})
    torch.manual_seed(0)
    model = smp.DistributedModel(nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 32), nn.Linear(32, 5)))
    x, y = batches(1, batch=16)[0]
    averaged, summed = _averaged_and_summed(model, x, y)
    assert jax.tree.leaves(model.grads)
    for name in averaged:
        np.testing.assert_array_equal(summed[name], 4 * averaged[name])
