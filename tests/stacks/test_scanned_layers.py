"""Layer stacks run as one scan (jmp.stacks): the same loss, gradients and buffers as PyTorch, one compiled body
whatever the depth, and layers that differ run one by one."""

from __future__ import annotations

import collections
import logging

import numpy as np
import pytest
import torch

import jmp as smp
from tests.front_end.helpers import named_grads
from tests.helpers import assert_close
from tests.remat.helpers import equations
from tests.stacks.helpers import SIZES

transformers = pytest.importorskip("transformers")


def _decoder(config_class: type, layers: int, **extra) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config_class(**SIZES, num_hidden_layers=layers, **extra))


def _llama(layers: int) -> torch.nn.Module:
    return _decoder(transformers.LlamaConfig, layers)


def _gemma2(layers: int) -> torch.nn.Module:
    """Gemma-2: sliding-window and global attention layers in turn (a period of 2)."""
    return _decoder(transformers.Gemma2Config, layers, head_dim=8, sliding_window=8)


def _mixtral(layers: int) -> torch.nn.Module:
    """Mixtral: mixture-of-experts layers (the experts split over ep inside the scan)."""
    return _decoder(transformers.MixtralConfig, layers, num_local_experts=4, num_experts_per_tok=2)


def _t5(layers: int) -> torch.nn.Module:
    """T5: each block returns (hidden states, the position biases the first block computed and passes on)."""
    torch.manual_seed(0)
    config = transformers.T5Config(
        d_model=32,
        d_ff=64,
        num_layers=layers,
        num_heads=4,
        d_kv=8,
        vocab_size=64,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return transformers.AutoModelForSeq2SeqLM.from_config(config)


def _gpt2(layers: int, **config) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=64, n_positions=32, **config)
    return transformers.AutoModelForCausalLM.from_config(config)


NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
IDS = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(1))


@smp.step
def lm_step(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    model.backward(loss)
    return loss


def _torch_loss_and_grads(module: torch.nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
    loss = module(input_ids=IDS, labels=IDS).loss
    loss.backward()
    return float(loss), {name: p.grad for name, p in module.named_parameters()}


def _jmp_loss_and_grads(module: torch.nn.Module, config: dict) -> tuple[smp.DistributedModel, float, dict]:
    smp.init({"scan_layers": True, **config})
    model = smp.DistributedModel(module)
    loss = float(lm_step(model, IDS).reduce_mean())
    return model, loss, named_grads(model.grads)


def _primitives(model: smp.DistributedModel) -> collections.Counter:
    return collections.Counter(eqn.primitive.name for eqn in equations(lm_step.trace(model, IDS).jaxpr))


@pytest.mark.parametrize(
    ("build", "layers", "config"),
    [
        (lambda layers: _gpt2(layers, **NO_DROPOUT), 4, {"microbatches": 2}),
        (_gemma2, 6, {}),  # the first two layers as they are, then two periods of two layers scanned
        # Llama's attention with experts: experts split over ep, every matrix over fsdp and tp, inside the scan
        (_mixtral, 3, {"expert_parallel_degree": 2, "sharded_data_parallel_degree": 2, "tensor_parallel_degree": 2}),
        (_t5, 4, {}),  # blocks 2 and 3 of the encoder and of the decoder scanned (block 0 has the bias table)
    ],
    ids=["gpt2-2-microbatches", "gemma2-alternating", "mixtral-ep2xfsdp2xtp2", "t5-tuples"],
)
def test_a_scanned_stack_trains_as_pytorch(build, layers, config):
    expected_loss, expected = _torch_loss_and_grads(build(layers))
    model, loss, grads = _jmp_loss_and_grads(build(layers), config)
    assert _primitives(model)["scan"] >= 1
    assert_close(loss, expected_loss, 1e-5)
    assert grads.keys() == expected.keys()
    largest = max(float(g.abs().max()) for g in expected.values())
    for name, grad in expected.items():
        assert_close(grads[name], grad, 1e-4, floor=1e-4 * largest)
    assert list(model.state_dict()) == list(build(layers).state_dict())  # names as torch has them, one per layer


def test_the_program_holds_one_layer_body_whatever_the_depth():
    counts = []
    for layers in (3, 6):
        smp.init({"scan_layers": True})
        counts.append(_primitives(smp.DistributedModel(_llama(layers)))["dot_general"])  # traced, not compiled
    assert counts[0] == counts[1]  # the first layer as traced (to learn what it returns), then one scanned body


def test_dropout_draws_what_the_layers_run_one_by_one_draw():
    _, unscanned_loss, unscanned = _jmp_loss_and_grads(_gpt2(3).train(), {"scan_layers": False})
    model, loss, grads = _jmp_loss_and_grads(_gpt2(3).train(), {})
    assert _primitives(model)["scan"] >= 1
    assert_close(loss, unscanned_loss, 1e-6)
    for name, grad in unscanned.items():
        assert_close(grads[name], grad, 1e-5, floor=1e-6)


def test_layers_checkpointed_one_by_one_are_scanned_with_their_checkpoint():
    """SMP's examples annotate every layer on its own (``for m in layers: smp.set_activation_checkpointing(m)``):
    layers annotated with one policy are alike, so the stack is still one scan, checkpointed inside its body."""
    expected_loss, expected = _torch_loss_and_grads(_gpt2(3, **NO_DROPOUT))
    smp.init({"scan_layers": True})
    model = smp.DistributedModel(_gpt2(3, **NO_DROPOUT))
    for layer in model.module.transformer.h:
        smp.set_activation_checkpointing(layer)
    loss = float(lm_step(model, IDS).reduce_mean())
    primitives = _primitives(model)
    assert primitives["scan"] >= 1 and primitives["remat2"] == 1  # one layer body, holding the checkpoint
    assert_close(loss, expected_loss, 1e-5)
    grads = named_grads(model.grads)
    for name, grad in expected.items():
        assert_close(grads[name], grad, 1e-4, floor=1e-6)


def test_layers_configured_apart_are_not_scanned():
    # GPT-2's scale_attn_by_inverse_layer_idx gives each layer's attention its own scaling attribute
    expected_loss, expected = _torch_loss_and_grads(_gpt2(3, scale_attn_by_inverse_layer_idx=True, **NO_DROPOUT))
    model, loss, grads = _jmp_loss_and_grads(_gpt2(3, scale_attn_by_inverse_layer_idx=True, **NO_DROPOUT), {})
    assert model.stacks == [] and _primitives(model)["scan"] == 0
    assert_close(loss, expected_loss, 1e-5)
    for name, grad in expected.items():
        assert_close(grads[name], grad, 1e-4, floor=1e-6)


class _Numbered(torch.nn.Module):
    """A layer whose forward computes with its number: alike in every attribute but the number."""

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.linear(x)) / (self.layer_idx + 1)


def test_layers_that_compute_with_their_number_run_one_by_one(caplog):
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[_Numbered(i) for i in range(4)])
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(2))
    expected = layers(x).square().mean()
    smp.init({"scan_layers": True})
    model = smp.DistributedModel(layers)
    with caplog.at_level(logging.INFO, logger="jmp"):
        loss = _forward_step(model, x)
    assert "'' (its layers run one by one" in caplog.text or "run one by one" in caplog.text
    assert_close(float(loss.reduce_mean()), float(expected), 1e-6)


@smp.step
def _forward_step(model, x):
    loss = model(x).square().mean()
    model.backward(loss)
    return loss


class _Memo:
    """State layers share through an argument (Gemma-4's KV-sharing dict): not a tensor, a scan cannot carry it."""


class _Remembering(torch.nn.Linear):
    def forward(self, x, memo):
        return torch.tanh(super().forward(x))


class _Scaled(torch.nn.Module):
    """Three stacks of alike layers: ``alike`` called in a chain, ``apart`` each with its own scale, ``shared``
    each with an object that is not a tensor."""

    def __init__(self):
        super().__init__()
        self.alike = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(4))
        self.apart = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.shared = torch.nn.ModuleList(_Remembering(8, 8) for _ in range(3))

    def forward(self, x):
        for layer in self.alike:
            x = layer(x)
        for scale, layer in enumerate(self.apart):
            x = torch.tanh(layer(x) * (scale + 1))  # each layer takes what the one before it returned, scaled
        memo = _Memo()
        for layer in self.shared:
            x = layer(x, memo)
        return x


def test_each_stack_says_once_how_its_layers_ran(caplog):
    torch.manual_seed(0)
    module = _Scaled()
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(2))
    expected = module(x).square().mean()
    smp.init({"scan_layers": True, "microbatches": 2})  # two microbatches: traced more than once, said once
    model = smp.DistributedModel(module)
    with caplog.at_level(logging.INFO, logger="jmp"):
        loss = _forward_step(model, x)
    notices = [r.getMessage() for r in caplog.records if r.getMessage().startswith("layer stack")]
    assert notices == [
        "layer stack 'alike': its 4 layers run as one scan",
        "layer stack 'apart': its 3 layers run one by one: none was called on the previous layer's output with "
        "arguments like its twin's before it",
        "layer stack 'shared': its 3 layers run one by one: a layer takes a _Memo, which the scan does not carry",
    ]
    assert_close(float(loss.reduce_mean()), float(expected), 1e-6)


class _Listed(torch.nn.Module):
    """A block returning a list of its output (GPT-1's blocks return [hidden, *attention outputs])."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return [torch.tanh(self.linear(x))]


class _ListedStack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Listed() for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)[0]
        return x


def test_layers_returning_a_list_scan():
    torch.manual_seed(0)
    module = _ListedStack()
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(2))
    module(x).square().mean().backward()
    expected = {name: p.grad for name, p in module.named_parameters()}
    smp.init({"scan_layers": True})
    model = smp.DistributedModel(module)
    _forward_step(model, x)
    assert sum(eqn.primitive.name == "scan" for eqn in equations(_forward_step.trace(model, x).jaxpr)) >= 1
    grads = named_grads(model.grads)
    for name, grad in expected.items():
        assert_close(grads[name], grad, 1e-5, floor=1e-7)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.norm = torch.nn.BatchNorm1d(8)

    def forward(self, x):
        return x + torch.tanh(self.norm(self.linear(x)))


def test_buffers_of_scanned_layers_update_as_in_pytorch():
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(*[_Block() for _ in range(4)])
    reference = torch.nn.Sequential(*[_Block() for _ in range(4)])
    reference.load_state_dict(blocks.state_dict())
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(2))
    reference(x).square().mean().backward()

    smp.init({"scan_layers": True})
    model = smp.DistributedModel(blocks)
    _forward_step(model, x)
    assert sum(eqn.primitive.name == "scan" for eqn in equations(_forward_step.trace(model, x).jaxpr)) >= 1
    state = model.state_dict()
    for name, value in reference.state_dict().items():  # running means and variances, batches tracked
        assert_close(state[name], value, 1e-5, floor=1e-7)
    grads = named_grads(model.grads)
    largest = max(float(p.grad.abs().max()) for p in reference.parameters())
    for name, p in reference.named_parameters():
        if name.endswith("linear.bias"):  # before a batch norm: a gradient of zero, here and in PyTorch rounding noise
            assert np.abs(grads[name]).max() < 1e-2 * largest and float(p.grad.abs().max()) < 1e-2 * largest
        else:
            assert_close(grads[name], p.grad, 1e-4, floor=1e-3 * largest)


class _BatchNormAct(torch.nn.BatchNorm2d):
    """timm's ``BatchNormAct2d``: torch's batch-norm forward written out (``num_batches_tracked.add_(1)`` in
    place, then ``F.batch_norm``) and an activation, in a generic module rather than the bridge's BatchNorm."""

    def forward(self, x):
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
        x = torch.nn.functional.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, self.training, self.momentum, self.eps
        )
        return torch.nn.functional.silu(x)


class _ConvBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.norm = _BatchNormAct(4)

    def forward(self, x):
        return x + self.norm(self.conv(x))


class _ConvNet(torch.nn.Module):
    """A generic module around the stack: its forward binds the blocks' buffers too, and reads the stack's output
    (running the scan) while they are bound."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.blocks = torch.nn.Sequential(*[_ConvBlock() for _ in range(4)])

    def forward(self, x):
        return self.blocks(self.stem(x)).mean(dim=(2, 3))


@pytest.mark.parametrize("config", [{}, {"sharded_data_parallel_degree": 8}], ids=["dp8", "sdp8"])
def test_in_place_buffer_updates_of_generic_scanned_layers_stay_out_of_the_scan(config):
    """A generic layer's in-place buffer write also lands in the tensor its parent's forward bound: inside the
    scan that was the body's tracer, which leaked out of it (UnexpectedTracerError, timm's EfficientNet)."""
    torch.manual_seed(0)
    blocks = _ConvNet().train()
    reference = _ConvNet().train()
    reference.load_state_dict(blocks.state_dict())
    xs = torch.randn(2, 8, 3, 6, 6, generator=torch.Generator().manual_seed(2))
    smp.init({"scan_layers": True, **config})
    model = smp.DistributedModel(blocks)
    for x in xs:  # two steps: the buffers the first one wrote are read by the second
        reference.zero_grad()
        reference(x).square().mean().backward()
        model.training_state.grads = None
        _forward_step(model, x)
    assert sum(eqn.primitive.name == "scan" for eqn in equations(_forward_step.trace(model, xs[1]).jaxpr)) >= 1
    state = model.state_dict()
    for name, value in reference.state_dict().items():  # running means and variances, batches tracked (2)
        assert_close(state[name], value, 1e-5, floor=1e-7)
    grads = named_grads(model.grads)
    for name, p in reference.named_parameters():
        assert_close(grads[name], p.grad, 1e-4, floor=1e-7)


def _gptj(layers: int) -> torch.nn.Module:
    """GPT-J: each block returns (hidden states, attention weights)."""
    torch.manual_seed(0)
    config = transformers.GPTJConfig(
        n_embd=32,
        n_layer=layers,
        n_head=4,
        rotary_dim=4,
        vocab_size=64,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.AutoModelForCausalLM.from_config(config)


def test_hidden_states_and_attention_weights_of_scanned_layers_are_pytorchs():
    # layers 1-4 of 5 scanned: hidden_states[3] is the output of the scan's second layer, attentions[3] the weights
    # its third layer returns beside its output
    expected = _gptj(5)(input_ids=IDS, output_hidden_states=True, output_attentions=True)
    smp.init({"scan_layers": True})
    model = smp.DistributedModel(_gptj(5))

    @smp.step
    def forward(model, ids):
        out = model(input_ids=ids, output_hidden_states=True, output_attentions=True)
        return out.hidden_states[3], out.hidden_states[5], out.attentions[3]

    middle, last, weights = forward(model, IDS)
    assert sum(eqn.primitive.name == "scan" for eqn in equations(forward.trace(model, IDS).jaxpr)) == 1
    assert_close(middle.concat(), expected.hidden_states[3], 1e-5, floor=1e-6)
    assert_close(last.concat(), expected.hidden_states[5], 1e-5, floor=1e-6)
    assert_close(weights.concat(), expected.attentions[3], 1e-5, floor=1e-6)
