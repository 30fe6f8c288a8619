"""The activation-checkpointing seed's three examples, with only their import lines changed.

Each trains one step through ``@smp.step``; the gradients equal PyTorch's on the same weights (examples
1 and 2, where ``checkpoint`` outside a step just calls the module) or those of the same model without
checkpointing, dropout on (example 3), and the step's backward pass recomputes one region per checkpoint.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

import jmp as smp
from jmp.patches.checkpoint import checkpoint, checkpoint_sequential
from tests.front_end.helpers import named_grads
from tests.helpers import assert_close
from tests.remat.helpers import (
    assert_same_grads,
    gpt2,
    lm_loss_and_grads,
    lm_step,
    lm_without_checkpointing,
    primitives,
    recomputations,
    saved_shapes,
    token_batch,
)


class CheckpointedCNN(nn.Module):  # example 1
    def __init__(self):
        super(CheckpointedCNN, self).__init__()  # noqa: UP008 (as in the seed)
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = self.conv1(x)
        x = self.conv2(x)
        x = F.max_pool2d(x, 2)
        x = torch.flatten(x, 1)
        # This call of fc1 will be checkpointed
        x = checkpoint(self.fc1, x)
        x = self.fc2(x)
        return F.log_softmax(x, 1)


class CheckpointedSequential(nn.Module):  # example 2
    def __init__(self):
        super(CheckpointedSequential, self).__init__()  # noqa: UP008
        self.seq = nn.Sequential(nn.Conv2d(1, 20, 5), nn.ReLU(), nn.Conv2d(20, 64, 5), nn.ReLU())

    def forward(self, x):
        # This call of self.seq will be checkpointed
        x = checkpoint_sequential(self.seq, x)
        return F.log_softmax(x, 1)


@smp.step
def classify_step(model, data, target):
    output = model(data)
    loss = F.nll_loss(output.flatten(2).mean(2) if output.dim() > 2 else output, target)
    model.backward(loss)
    return loss


def _torch_grads(net, data, target):
    net.zero_grad()
    output = net(data)  # plain PyTorch: checkpoint / checkpoint_sequential just run the modules
    F.nll_loss(output.flatten(2).mean(2) if output.dim() > 2 else output, target).backward()
    return {name: p.grad.numpy() for name, p in net.named_parameters()}


def _check_against_torch(net, data, target, checkpoints):
    smp.init()
    model = smp.DistributedModel(net)
    classify_step(model, data, target)
    grads = named_grads(model.grads)
    expected = _torch_grads(net, data, target)
    largest = max(float(abs(g).max()) for g in expected.values())
    for name, grad in expected.items():
        assert_close(grads[name], grad, 1e-5, floor=1e-3 * largest)
    assert recomputations(classify_step, model, data, target) == checkpoints


def test_example_1_checkpointing_fc1_inside_forward_keeps_torch_gradients():
    data, target = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    _check_against_torch(CheckpointedCNN(), data, target, checkpoints=1)


def test_example_2_checkpoint_sequential_checkpoints_each_layer_and_keeps_torch_gradients():
    data, target = torch.randn(8, 1, 12, 12), torch.randint(0, 64, (8,))
    _check_against_torch(CheckpointedSequential(), data, target, checkpoints=4)


def test_example_3_hugging_face_layers_checkpointed_each_keep_gradients_with_dropout():
    expected_loss, expected = lm_without_checkpointing()
    ids = token_batch()
    for config in (None, {"scan_layers": False}):  # the seed's smp.init() scans the layers; then one by one
        smp.init(config)
        model = smp.DistributedModel(gpt2())
        # Call set_activation_checkpointing API
        transformer_layers = model.module.module.module.transformer.seq_layers
        smp.set_activation_checkpointing(transformer_layers, pack_args_as_tuple=True, strategy="each")
        assert transformer_layers is model.module.transformer.h  # SMP's path and the model's own: the same layers
        loss, grads = lm_loss_and_grads(model, ids)
        assert_close(loss, expected_loss, 1e-6)
        assert_same_grads(grads, expected)
    # the program of the layers run one by one: a checkpoint per layer (inside a scan: tests/stacks)
    program = primitives(lm_step, model, ids)
    assert program["remat2"] == 3
    assert program["random_bits"] > 0, "dropout draws masks in the step"
    saved = saved_shapes(lm_step, model, ids)
    assert saved[(8, 16, 32)] > 0 and saved[(8, 16, 128)] == saved[(8, 4, 16, 16)] == 0  # inputs, no internals
